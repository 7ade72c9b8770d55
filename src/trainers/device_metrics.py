"""Training metrics that stay on the device until a logging step: a training step reads no device value on the host
(each read is a GPU stall: the host waits for the device's queue to drain before it can go on queueing work).

TRL 1.16's trainers compute their metrics inside the loss call and read each at once (`gather(x).mean().item()`,
`if total > 0`): 13 `.item()` and 2 `bool()` per micro-batch in DPO, 3 and 3 in SFT (docs/speed.md). A toolkit trainer
runs TRL's loss code unchanged inside `MetricWindow.recording(trainer)`, where the accelerator's `gather` and
`gather_for_metrics` (which TRL's metric code alone calls during a training step) keep this rank's value on the device
and hand TRL a stand-in holding no device value; TRL's appends go to a list thrown away. Each micro-batch leaves one row
of sums and element counts on the device. When the trainer logs (or evaluates: eval logs the running token count),
`flush` sums the window's rows over the ranks (one all-reduce), reads them once, and appends to the trainer's
`_metrics["train"]` what TRL would have appended, micro-batch by micro-batch, from the objective's formulas
(`Ratio`: TRL's `a / b if b > 0 else 0.0` of two gathered sums; `Mean`: TRL's `gather(x).mean()`): the logged values
are TRL's (to float rounding: the sums are float64 here)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ratio:
    numerator: str
    denominator: str


@dataclass(frozen=True)
class Mean:
    value: str


@dataclass(frozen=True)
class RunningTokens:
    """TRL's `num_tokens`: the running count of training tokens (`_total_train_tokens`), one value, not appended."""
    value: str


class _NoValue:
    """What TRL's metric code gets instead of a gathered tensor: its arithmetic answers itself, comparisons False and
    `.item()` 0, so TRL's branches take their "nothing to average" side without reading anything."""

    def sum(self, *args, **kwargs):
        return self

    mean = detach = sum

    def item(self):
        return 0

    def __truediv__(self, other):
        return self

    __rtruediv__ = __floordiv__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__

    def __gt__(self, other):
        return False

    def __bool__(self):
        return False


_NO_VALUE = _NoValue()


class _RecordingAccelerator:
    """The trainer's accelerator, except that a gather keeps the local value (detached) and returns the stand-in."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self.gathered: list[torch.Tensor] = []

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def gather(self, value):
        self.gathered.append(value.detach())
        return _NO_VALUE

    gather_for_metrics = gather


class MetricWindow:
    """The metrics of the micro-batches since the last flush, as device rows: for each gathered value (named by
    `gathered`, in the order TRL's loss code gathers them) its sum, then its element count. `metrics`: name → Ratio,
    Mean or RunningTokens of those names, in the order TRL appends them; `store`: the trainer → the dict TRL appends
    them to by mode (`_metrics`; the trl.experimental pair trainers' `_stored_metrics`)."""

    def __init__(self, gathered: tuple[str, ...], metrics: dict, what: str, store):
        self.gathered = gathered
        self.metrics = metrics
        self.what = what
        self.store = store
        self.rows: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self, trainer):
        """TRL's loss code of one training micro-batch, its metrics kept on the device."""
        store = self.store(trainer)
        accelerator, metrics = trainer.accelerator, store["train"]
        recorder = trainer.accelerator = _RecordingAccelerator(accelerator)
        store["train"] = defaultdict(list)  # TRL's stand-in zeros go here, and are dropped
        try:
            yield
        finally:
            trainer.accelerator, store["train"] = accelerator, metrics
        if len(recorder.gathered) != len(self.gathered):
            raise RuntimeError(f"{self.what}'s loss code gathered {len(recorder.gathered)} metric values, the toolkit "
                               f"expects {len(self.gathered)} ({', '.join(self.gathered)}): has TRL's metric code "
                               "changed? (src/trainers/device_metrics.py)")
        values = recorder.gathered
        sums = torch.stack([value.sum().double() for value in values])
        counts = torch.stack([sums.new_full((), value.numel()) for value in values])
        self.rows.append(torch.cat([sums, counts]))

    def flush(self, trainer) -> None:
        """The window's rows summed over the ranks (every rank calls this at the same point: a log or an evaluation)
        and appended to the trainer's `_metrics["train"]` (or `store`) as TRL appends them."""
        if not self.rows:
            return
        logged = self.store(trainer)["train"]
        table = trainer.accelerator.reduce(torch.stack(self.rows), reduction="sum")
        self.rows = []
        width = len(self.gathered)
        for row in table.tolist():  # the one read, at a log or an evaluation
            sums = dict(zip(self.gathered, row[:width]))
            counts = dict(zip(self.gathered, row[width:]))
            for name, formula in self.metrics.items():
                if isinstance(formula, RunningTokens):
                    trainer._total_train_tokens += int(round(sums[formula.value])) // trainer._tp_size
                    logged[name] = [trainer._total_train_tokens]
                    continue
                if isinstance(formula, Ratio):
                    denominator = sums[formula.denominator]
                    value = sums[formula.numerator] / denominator if denominator > 0 else 0.0
                else:
                    value = sums[formula.value] / counts[formula.value]
                logged[name].append(value)
