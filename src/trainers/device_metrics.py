"""Training metrics that stay on the device until a logging step: a training step reads no device value on the host
(each read is a GPU stall: the host waits for the device's queue to drain before it can go on queueing work).

TRL 1.16's trainers compute their metrics inside the loss call and read each at once (`gather(x).mean().item()`,
`if total > 0`): 13 `.item()` and 2 `bool()` per micro-batch in DPO, 3 and 3 in SFT (docs/speed.md). A toolkit trainer
runs TRL's loss code unchanged inside `MetricWindow.recording(trainer)`, where the accelerator's `gather`,
`gather_for_metrics` and `reduce` (which TRL's metric code alone calls during a training step) keep this rank's value
on the device and hand TRL a stand-in holding no device value; TRL's appends go to a list thrown away. Each micro-batch
leaves one row of sums, element counts, minimum and maximum on the device. When the trainer logs (or evaluates: eval
logs the running token count), `flush` gathers the window's rows from the ranks (one collective), reads them once, and
appends to the trainer's `_metrics["train"]` what TRL would have appended, micro-batch by micro-batch, from the
objective's formulas (`Ratio`: TRL's `a / b if b > 0 else 0.0` of two gathered sums; `Mean`: TRL's `gather(x).mean()`;
`Min` / `Max`: TRL's `nanmin(gather(x))` / `nanmax`): the logged values are TRL's (to float rounding: the sums are
float64 here).

A trainer that logs TRL's mean of micro-batch values would log numbers that depend on the split of a global batch
(1 process x 2 accumulation steps averages two micro-batch ratios, 2 processes x 1 takes one over both ranks); the
toolkit's SFT, DPO, SimPO, ORPO and KTO trainers log `weighted_means` instead: each metric the mean over the logging
window weighted by what it averages (a Ratio's denominator: tokens; a Mean's elements: pairs, rows), the same on any
number of processes. GRPO weighs its token means by its own counts (src/trainers/grpo.py: also without this window)."""

from __future__ import annotations

import contextlib
import math
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
class Min:
    """The smallest element of a gathered value over every process, NaNs left out (NaN if all are)."""
    value: str


@dataclass(frozen=True)
class Max:
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

    mean = nanmean = detach = clamp = all = __getitem__ = __invert__ = sum

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _NO_VALUE  # torch.isnan(x), torch.min(x) (TRL's nanmin / nanmax) answer the stand-in

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

    def reduce(self, value, reduction="sum"):
        """TRL's `reduce(torch.stack([sum, count]))` (GRPO's token means): each element a value of its own."""
        self.gathered.extend(value.detach().unbind(0) if value.dim() else [value.detach()])
        return _NO_VALUE


class MetricWindow:
    """The metrics of the micro-batches since the last flush, as device rows: for each gathered value (named by
    `gathered`, in the order TRL's loss code gathers them) its sum, then its element count. `metrics`: name → Ratio,
    Mean or RunningTokens of those names, in the order TRL appends them; `store`: the trainer → the dict TRL appends
    them to by mode (`_metrics`; the trl.experimental pair trainers' `_stored_metrics`); `weighted`: the trainer logs
    `weighted_means` (the weights are kept for it)."""

    def __init__(self, gathered: tuple[str, ...], metrics: dict, what: str, store, kept: tuple[str, ...] = (),
                 weighted: bool = False):
        self.gathered = gathered
        self.weighted = weighted
        self.metrics = metrics
        self.what = what
        self.store = store
        self.kept = kept  # what TRL appends during the loss code that is no gathered value (GRPO's entropy_coef)
        self.rows: list[torch.Tensor] = []
        # each flushed metric's weight per value appended to the store's train lists since the last `weighted_means`
        self.weights: dict[str, list[float]] = defaultdict(list)

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
            appended, trainer.accelerator, store["train"] = store["train"], accelerator, metrics
            for name in self.kept:
                metrics[name] += appended.get(name, [])
        if len(recorder.gathered) != len(self.gathered):
            raise RuntimeError(f"{self.what}'s loss code gathered {len(recorder.gathered)} metric values, the toolkit "
                               f"expects {len(self.gathered)} ({', '.join(self.gathered)}): has TRL's metric code "
                               "changed? (src/trainers/device_metrics.py)")
        self.add(recorder.gathered)

    def add(self, values: list[torch.Tensor]) -> None:
        """One micro-batch's values on this rank, in `gathered`'s order, kept on the device until the next flush (for a
        trainer whose own code computes its metrics: no stand-in needed)."""
        sums = torch.stack([value.detach().sum().double() for value in values])
        counts = torch.stack([sums.new_full((), value.numel()) for value in values])
        extremes = [_extremes(value.detach().double().flatten()) for value in values]
        self.rows.append(torch.cat([sums, counts, torch.stack([low for low, _ in extremes]),
                                    torch.stack([high for _, high in extremes])]))

    def flush(self, trainer) -> None:
        """The window's rows summed over the ranks (every rank calls this at the same point: a log or an evaluation)
        and appended to the trainer's `_metrics["train"]` (or `store`) as TRL appends them; with `weighted`, each
        appended value's weight (a Ratio's denominator, the elements a Mean averages) kept for `weighted_means`."""
        if not self.rows:
            return
        logged = self.store(trainer)["train"]
        width = len(self.gathered)
        everyone = trainer.accelerator.gather(torch.stack(self.rows)[None])  # (ranks, rows, 4 x width)
        self.rows = []
        table = torch.cat([everyone[..., :2 * width].sum(0), everyone[..., 2 * width:3 * width].amin(0),
                           everyone[..., 3 * width:].amax(0)], dim=-1)
        for row in table.tolist():  # the one read, at a log or an evaluation
            sums, counts, lows, highs = (dict(zip(self.gathered, row[start:start + width]))
                                         for start in range(0, 4 * width, width))
            for name, formula in self.metrics.items():
                if isinstance(formula, RunningTokens):
                    trainer._total_train_tokens += int(round(sums[formula.value])) // trainer._tp_size
                    logged[name] = [trainer._total_train_tokens]
                    continue
                if isinstance(formula, (Min, Max)):
                    extreme = (lows if isinstance(formula, Min) else highs)[formula.value]
                    logged[name].append(extreme if math.isfinite(extreme) else math.nan)
                    continue
                if isinstance(formula, Ratio):
                    denominator = sums[formula.denominator]
                    value = sums[formula.numerator] / denominator if denominator > 0 else 0.0
                else:
                    denominator = counts[formula.value]
                    value = sums[formula.value] / denominator
                logged[name].append(value)
                if self.weighted:
                    self.weights[name].append(denominator)

    def at_log(self, trainer) -> dict[str, float]:
        """What a trainer's `log` calls: at a training log, `weighted_means` (returned); at an evaluation's log the
        window is flushed only (eval's own metrics are per pair or row: its evaluation_loop), and the training window
        is logged at the next training log."""
        if trainer.model.training:
            return self.weighted_means(trainer)
        self.flush(trainer)
        return {}

    def weighted_means(self, trainer) -> dict[str, float]:
        """At a training log: the window flushed, then each train metric that has a weight per value replaced by its
        weighted mean (one value: TRL's log averages each list), the weights cleared; returns those means. A window of
        zero weight (no token to average) keeps TRL's values."""
        self.flush(trainer)
        logged = self.store(trainer)["train"]
        means = {}
        for name, weights in self.weights.items():
            values = logged.get(name, [])
            if len(values) == len(weights) and sum(weights) > 0:
                means[name] = sum(value * weight for value, weight in zip(values, weights)) / sum(weights)
                logged[name] = [means[name]]
        self.weights.clear()
        return means


def _extremes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest and largest of `values`, NaNs left out (+inf and -inf where none is left)."""
    if values.numel() == 0:
        return values.new_tensor(math.inf), values.new_tensor(-math.inf)
    missing = values.isnan()
    return values.masked_fill(missing, math.inf).amin(), values.masked_fill(missing, -math.inf).amax()
