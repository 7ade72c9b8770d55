"""SimPO's trainer: TRL's CPOTrainer (trl.experimental.cpo, loss_type "simpo", cpo_alpha 0) with the toolkit's
additions, on the pairs src/data/ prepared (src/trainers/legacy_pairs.py). SimPO has no reference model: no
reference pass, no reference cache. Its step is the mean over the micro-batch's pairs (CPO-SimPO's NLL term a token mean
over the global batch: legacy_pairs `begin_step`), so the same global batch gives the same update on any split into
processes x accumulation steps x micro-batch size (tests/test_simpo.py, test_packed_objectives.py)."""

from __future__ import annotations

import warnings

from src.trainers.base import PairLengthsMixin, ToolkitTrainerMixin
from src.trainers.legacy_pairs import PreparedPairsMixin

with warnings.catch_warnings():  # trl.experimental says it is experimental on import: docs/simpo.md says so
    warnings.filterwarnings("ignore", message=".*trl.experimental")
    from trl.experimental.cpo import CPOTrainer


class PreparedSimPOTrainer(PreparedPairsMixin, PairLengthsMixin, ToolkitTrainerMixin, CPOTrainer):
    """CPOTrainer on prepared pairs, with complete-only checkpoints, the callbacks' hooks and the packed forward."""

    def averages_log_probs(self) -> bool:
        return self.loss_type in ("ipo", "simpo")  # CPOTrainer.concatenated_forward's rule

    def nll_weight(self) -> float:
        return self.cpo_alpha  # CPO-SimPO (--cpo_alpha > 0) adds the chosen answers' NLL
