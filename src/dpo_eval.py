"""DPO evaluation metrics as per-pair means: the same numbers on 1, 2 or 4 processes, any eval batch size, any
remainder of the validation split.

Why: TRL 1.16 logs each eval metric as the mean of per-batch means, gathered with `gather` (which keeps the pairs
accelerate duplicates to even out the last batch across ranks), and the Trainer's eval_loss repeats each rank's batch
mean; so the numbers depended on how the split fell into batches and ranks (measured: eval_loss 0.2410 on 1 process
vs 0.2380 on 2 for the same model and pairs). Best-checkpoint selection and run comparison inherit that.

How, without re-implementing TRL's loss code (every `loss_type`, `ld_alpha`, WPO and metric stays TRL's):
1. each eval batch runs TRL's `_compute_loss` once, as in training (packed or padded forward), while a tape
   (src/packed_forward.py's fused-forward wrapper) records the policy's and the reference's fused-forward outputs;
2. TRL's `_compute_loss` then runs once per pair on that pair's two rows, the model's forward replayed from the
   tape (sliced to the pair: no model compute), collectives off, its metrics read from `_metrics["eval"]`;
3. the per-pair values are gathered with `gather_for_metrics`, which drops accelerate's duplicated pairs, and
   summed. Metrics TRL weights by tokens (entropy, logits/*, mean_token_accuracy) keep their token weights.

Per pair, batch-coupled terms take their one-pair value: the `sft` term is the pair's token mean (averaged over
pairs), `aot` sorts a batch of one; the MoE `aux_loss` is its batch's. Documented in docs/results.md.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from src.packed_forward import TAPE, fused_modules, install
from src.packed_layout import PACKED_KEYS

# Which completion tokens weight each metric (as TRL's batch formula weights them); the rest weigh 1 per pair.
TOKEN_WEIGHTS = {"entropy": "both", "logits/chosen": "chosen", "logits/rejected": "rejected",
                 "mean_token_accuracy": "chosen"}
NOT_PER_PAIR = ("num_tokens",)  # TRL's running count of training tokens, logged with eval as it is


class _Tape:
    """The fused-forward outputs of one batch, in call order (policy, then the reference when it is not cached)."""

    def __init__(self):
        self.outputs: list = []
        self.replaying = False
        self.rows: list[int] | None = None
        self._next = 0

    def record(self, outputs) -> None:
        if not self.replaying:
            self.outputs.append(outputs)

    def replay(self):
        outputs = self.outputs[self._next]
        self._next += 1
        fields = {name: value[self.rows] if torch.is_tensor(value) and value.dim() > 0 else value
                  for name, value in outputs.items()}
        return type(outputs)(**fields)

    @contextlib.contextmanager
    def replaying_rows(self, rows: list[int]):
        self.replaying, self.rows, self._next = True, rows, 0
        try:
            yield
        finally:
            self.replaying, self.rows = False, None


class _NoCollectives:
    """The trainer's accelerator with gathers that return the local value: one pair's metrics, this rank only."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @staticmethod
    def gather(value):
        return value

    gather_for_metrics = gather


class PairMetrics:
    """Per-pair sums of every eval metric over one evaluation, across ranks."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.pairs = 0

    def add_batch(self, trainer, model, inputs: dict, compute_loss) -> torch.Tensor:
        """Run the batch (`compute_loss`: the trainer's own, packed or padded), then TRL's loss code per pair;
        accumulate the gathered per-pair values. Returns the batch's mean per-pair loss (for the Trainer's loop)."""
        install(fused_modules(trainer))
        tape = _Tape()
        token = TAPE.set(tape)
        try:
            compute_loss(model, inputs)
            plain = {key: value for key, value in inputs.items() if key not in PACKED_KEYS}
            names, per_pair = self._per_pair(trainer, trainer.accelerator.unwrap_model(model), plain, tape)
        finally:
            TAPE.reset(token)
        gathered = trainer.accelerator.gather_for_metrics(per_pair)  # the duplicated pairs of a last batch dropped
        for column, name in enumerate(names):
            values, weights = gathered[:, 2 * column], gathered[:, 2 * column + 1]
            self.sums[name] += float((values * weights).sum())
            self.weights[name] += float(weights.sum())
        self.pairs += gathered.shape[0]
        return per_pair[:, 0].mean()

    @staticmethod
    def _per_pair(trainer, model, inputs: dict, tape: _Tape) -> tuple[list[str], torch.Tensor]:
        """(names, (pairs, 2 * names) tensor of value, weight per metric); names[0] is "loss"."""
        from trl import DPOTrainer

        pairs = inputs["input_ids"].shape[0] // 2
        completion = inputs["completion_mask"][:, 1:].sum(dim=1).float()
        tokens = {"chosen": completion[:pairs], "rejected": completion[pairs:],
                  "both": completion[:pairs] + completion[pairs:]}
        accelerator, metrics = trainer.accelerator, trainer._metrics["eval"]
        rows, names = [], None
        trainer.accelerator = _NoCollectives(accelerator)
        try:
            for pair in range(pairs):
                select = [pair, pairs + pair]
                one = {key: (value[select] if value.shape[0] == 2 * pairs else value[pair:pair + 1])
                       if torch.is_tensor(value) and value.dim() > 0 else value for key, value in inputs.items()}
                trainer._metrics["eval"] = defaultdict(list)
                with tape.replaying_rows(select):
                    loss = DPOTrainer._compute_loss(trainer, model, one, False)
                values = {"loss": float(loss)} | {name: float(logged[-1]) for name, logged in
                                                   trainer._metrics["eval"].items() if name not in NOT_PER_PAIR}
                names = names or list(values)
                rows.append([number for name in names for number in (
                    values[name], float(tokens[TOKEN_WEIGHTS[name]][pair]) if name in TOKEN_WEIGHTS else 1.0)])
        finally:
            trainer.accelerator, trainer._metrics["eval"] = accelerator, metrics
        return names, torch.tensor(rows, dtype=torch.float64, device=accelerator.device)

    def result(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{name}": self.sums[name] / self.weights[name] if self.weights[name] else 0.0
                for name in self.sums}
