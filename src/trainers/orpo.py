"""ORPO's trainer: TRL's ORPOTrainer (trl.experimental.orpo) with the toolkit's additions, on the pairs src/data/
prepared (src/trainers/legacy_pairs.py). No reference model. Its loss is the chosen answers' NLL, a token mean over the
global batch (legacy_pairs `begin_step`), plus beta x the odds-ratio term, a mean over its pairs, so the same global
batch gives the same update on any split into processes x accumulation steps x micro-batch size (tests/test_orpo.py)."""

from __future__ import annotations

import warnings

from src.trainers.base import PairLengthsMixin, ToolkitTrainerMixin
from src.trainers.legacy_pairs import CPO_GATHERED, PreparedPairsMixin

with warnings.catch_warnings():  # trl.experimental says it is experimental on import: docs/orpo.md says so
    warnings.filterwarnings("ignore", message=".*trl.experimental")
    from trl.experimental.orpo import ORPOTrainer


class PreparedORPOTrainer(PreparedPairsMixin, PairLengthsMixin, ToolkitTrainerMixin, ORPOTrainer):
    """ORPOTrainer on prepared pairs, with complete-only checkpoints, the callbacks' hooks and the packed forward."""

    nll_covers_prompt = True  # ORPOTrainer's NLL: every real token of prompt + chosen answer
    gathered_metrics = CPO_GATHERED + ("log_odds_ratio", "log_odds_chosen")

    def pad_value(self) -> int:
        return self.padding_value
