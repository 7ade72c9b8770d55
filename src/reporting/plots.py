"""Training curves as PNG files, drawn from the metric history alone (headless: matplotlib's Agg canvas, no pyplot).

    plot_history(read_jsonl(run_dir / "metrics.jsonl"), stage="dpo", out_dir=run_dir / "plots")

One file per concern. Train curves are smoothed (a centred window: no lag) with the raw values faint behind them;
eval points are markers; NaN/inf values are marked with red crosses along the top edge at the step they were logged.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from pathlib import Path

from src.objectives import OBJECTIVES, objective
from src.objectives.dpo import describe_dpo_loss, dpo_loss_terms
from src.objectives.spec import TRAIN_COLOR, Chart, Curve, Panel
from src.reporting.summary import series
from src.run_files import atomic_path

X_LABEL = "optimizer step"
EVAL_COLOR = "#ff7f0e"
# Below this many finite points smoothing would hide the data: draw the raw points with markers instead.
SMOOTH_MIN_POINTS = 10
# A train curve is drawn with at most about this many points: a chart is 935 pixels wide (8.5 in at 110 dpi), so more
# points are not seen, only paid for (drawing time, and the renderer's memory, which the allocator keeps afterwards).
MAX_DRAWN_POINTS = 1000


_LR_GRAD = Chart("lr_grad_norm.png", "Learning rate and gradient norm", (
    Panel("Learning rate schedule", "learning rate", (Curve("learning_rate", "learning rate", smooth=False),)),
    Panel("Gradient norm (before clipping)", "grad norm (L2)", (Curve("grad_norm", "grad norm"),), log_when_wide=True),
))
_THROUGHPUT = Chart("throughput.png", "Throughput and memory", (
    Panel("Training throughput", "tokens / second (all ranks)", (Curve("perf/tokens_per_second", "tokens/s"),),
          y_from_zero=True),
    Panel("Peak memory per process", "MB (GPU: max allocated; CPU: resident set)",
          (Curve("perf/peak_memory_mb", "peak memory", smooth=False),),
          y_from_zero=True),
))

# Each objective's charts (its row: src/objectives/), then the learning-rate and throughput charts every stage has.
CHARTS = {name: row.report.charts + (_LR_GRAD, _THROUGHPUT) for name, row in OBJECTIVES.items()}


def smooth(values: list[float], span: int) -> list[float]:
    """Zero-lag smoothing for a finished curve: the mean of a window centred on each point, `span` points wide,
    narrowed symmetrically near the ends (the first and last points are the raw ones). A forward EMA trails a steep
    fall by about `span` points, so an early loss drop looks slower than it was; a centred window does not, and a
    straight stretch keeps its values exactly. Non-finite values stay NaN and are left out of their neighbours'.
    Running sums make it one pass whatever the span (the span grows with the curve: a window per point would cost
    points x span, quadratic in the run's length)."""
    half = span // 2
    sums, counts = [0.0], [0]
    for value in values:
        finite_value = math.isfinite(value)
        sums.append(sums[-1] + (value if finite_value else 0.0))
        counts.append(counts[-1] + finite_value)
    smoothed = []
    for index, value in enumerate(values):
        if not math.isfinite(value):
            smoothed.append(math.nan)
            continue
        reach = min(half, index, len(values) - 1 - index)
        if reach == 0:
            smoothed.append(value)  # the ends stay exactly raw
            continue
        low, high = index - reach, index + reach + 1
        smoothed.append((sums[high] - sums[low]) / (counts[high] - counts[low]))
    return smoothed


def thinned(steps: list[int], values: list[float], limit: int | None = None) -> tuple[list[int], list[float]]:
    """At most about `limit` points of a curve, as it looks at the chart's width: the curve cut into `limit` // 2
    consecutive buckets, each kept as its lowest and highest point in step order (the faint raw line keeps its
    spread), and its first non-finite value (a NaN still breaks the line there). A long run draws as many points as a
    short one, so what a refresh draws, its time and the memory the drawing takes stay flat as the run grows."""
    limit = limit or MAX_DRAWN_POINTS
    if len(values) <= limit:
        return steps, values
    buckets = limit // 2
    kept: list[int] = []
    for bucket in range(buckets):
        start, stop = bucket * len(values) // buckets, (bucket + 1) * len(values) // buckets
        finite_indices = [index for index in range(start, stop) if math.isfinite(values[index])]
        chosen = {min(finite_indices, key=values.__getitem__),
                  max(finite_indices, key=values.__getitem__)} if finite_indices else set()
        first_non_finite = next((index for index in range(start, stop) if not math.isfinite(values[index])), None)
        kept += sorted(chosen | ({first_non_finite} - {None}))
    return [steps[index] for index in kept], [values[index] for index in kept]


def _nan_for_non_finite(values: list[float]) -> list[float]:
    return [value if math.isfinite(value) else math.nan for value in values]


def _mark_non_finite(ax, steps: list[int], values: list[float], label: str, spans: bool) -> bool:
    """Show where NaN/inf was logged: shaded bands over runs of train records, crosses on the top edge for eval."""
    bad = [index for index, value in enumerate(values) if not math.isfinite(value)]
    if not bad:
        return False
    legend = f"{label}: NaN/inf ({len(bad)}×, first at step {steps[bad[0]]})"
    if spans:
        runs, start = [], bad[0]
        for previous, index in zip(bad, bad[1:] + [None]):
            if index != previous + 1:
                runs.append((steps[start], steps[previous]))
                start = index
        for number, (first, last) in enumerate(runs):
            artist_label = legend if number == 0 else None
            if first == last:
                ax.axvline(first, color="red", alpha=0.5, linewidth=1.5, label=artist_label)
            else:
                ax.axvspan(first, last, color="red", alpha=0.12, linewidth=0, label=artist_label)
    else:
        # x in data coordinates, y in axes coordinates: the crosses sit on the top edge whatever the y range.
        ax.plot([steps[index] for index in bad], [1.0] * len(bad), "x", color="red", markersize=8, mew=2,
                transform=ax.get_xaxis_transform(), clip_on=False, label=legend)
    return True


def smoothing_span(count: int) -> int:
    """Smoothing window for `count` points: about a twelfth of the curve, which irons out per-batch noise but keeps
    trends that last longer than ~10% of training."""
    return max(3, round(count / 12))


def _draw_curve(ax, metrics: list[dict], curve: Curve, single_curve: bool) -> tuple[bool, int | None]:
    """Draw the train and eval series of `curve`; returns (anything drawn, smoothing window used or None)."""
    drew, span = False, None
    steps, values = series(metrics, curve.key)
    finite_count = sum(math.isfinite(value) for value in values)
    train_name = "train" if single_curve else f"{curve.label} (train)"
    if finite_count >= SMOOTH_MIN_POINTS and curve.smooth:
        span = smoothing_span(finite_count)
        ax.plot(*thinned(steps, _nan_for_non_finite(values)), color=curve.color, alpha=0.25, linewidth=0.9)
        ax.plot(*thinned(steps, smooth(values, span)), color=curve.color, linewidth=2.0, label=train_name)
        drew = True
    elif finite_count:
        few = finite_count < SMOOTH_MIN_POINTS
        ax.plot(*thinned(steps, _nan_for_non_finite(values)), color=curve.color, linewidth=1.8,
                marker="o" if few else None, markersize=5, label=train_name)
        drew = True
    drew |= _mark_non_finite(ax, steps, values, train_name, spans=True)

    eval_steps, eval_values = series(metrics, "eval_" + curve.key)
    eval_name = "eval" if single_curve else f"{curve.label} (eval)"
    if any(math.isfinite(value) for value in eval_values):
        color = EVAL_COLOR if single_curve else curve.color
        ax.plot(eval_steps, _nan_for_non_finite(eval_values), color=color, linestyle="--", linewidth=1.3,
                marker="o", markersize=6, markeredgecolor="black", markeredgewidth=0.8, label=eval_name, zorder=3)
        drew = True
    drew |= _mark_non_finite(ax, eval_steps, eval_values, eval_name, spans=False)
    return drew, span


def panel_curves(metrics: list[dict], panel: Panel) -> tuple[Curve, ...]:
    """The panel's curves, and one per logged key its `per_logged_key` pattern matches (GRPO: one per judge),
    labelled by what the pattern's "*" stands for, in order of first appearance, colours from matplotlib's cycle."""
    if panel.per_logged_key is None:
        return panel.curves
    pattern, label = panel.per_logged_key
    keys = list(dict.fromkeys(key for record in metrics for key in record if fnmatch.fnmatchcase(key, pattern)))
    prefix, _, suffix = pattern.partition("*")
    found = tuple(Curve(key, f"{key[len(prefix):len(key) - len(suffix)]} {label}".strip(), f"C{index}")
                  for index, key in enumerate(keys))
    return panel.curves + found


def resume_marks(info: dict) -> list[tuple[int, str]]:
    """(step, label) of each resume of the run (training_info.json's `resumes`), the processes named where they
    changed: "resumed at step 43 on 1 process (saved by 2)"."""
    marks = []
    for resume in info.get("resumes") or []:
        step = resume.get("from_step") or 0
        if step <= 0:
            continue
        before, now = (resume.get("saved_by") or {}).get("world_size"), resume.get("world_size")
        label = f"resumed at step {step}"
        if before and now and before != now:
            label += f" on {now} process{'es' if now != 1 else ''} (saved by {before})"
        marks.append((step, label))
    return marks


def _mark_resumes(ax, resumes: list[tuple[int, str]]) -> None:
    """A vertical line where the run resumed from a checkpoint (the curve after it comes from another launch)."""
    for step, label in resumes:
        ax.axvline(step, color="dimgray", linestyle="-.", linewidth=1.0, alpha=0.8, label=label)


def _draw_panel(ax, metrics: list[dict], panel: Panel, bottom: bool,
                resumes: list[tuple[int, str]] = ()) -> tuple[bool, set]:
    """Draw the panel (and the run's resumes); returns (anything drawn, the smoothing windows its curves used)."""
    from matplotlib.ticker import MaxNLocator

    drew, spans = False, set()
    curves = panel_curves(metrics, panel)
    named = panel.per_logged_key is not None  # a curve per logged key: its legend names it, even alone
    for curve in curves:
        drew_curve, span = _draw_curve(ax, metrics, curve, single_curve=len(curves) == 1 and not named)
        drew |= drew_curve
        spans |= {span} - {None}
    ax.set_title(panel.title, fontsize=12, fontweight="bold", loc="left")
    if bottom:
        ax.set_xlabel(X_LABEL)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drew:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray", fontsize=12)
        return False, spans
    for y, label in panel.reference_lines:
        ax.axhline(y, color="gray", linestyle=":", linewidth=1.2, label=label)
    _mark_resumes(ax, resumes)
    if panel.ylim:
        ax.set_ylim(*panel.ylim)
    elif panel.y_from_zero:
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
    elif panel.min_y_span:
        low, high = ax.get_ylim()
        if high - low < panel.min_y_span:
            middle = (low + high) / 2
            ax.set_ylim(middle - panel.min_y_span / 2, middle + panel.min_y_span / 2)
    if panel.log_when_wide:
        positive = [value for curve in curves for value in series(metrics, curve.key)[1]
                    if math.isfinite(value) and value > 0]
        if positive and max(positive) > 100 * min(positive):
            ax.set_yscale("log")
    if ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    ax.set_xlim(left=0)
    if len(ax.get_legend_handles_labels()[1]) > (0 if named else 1):
        ax.legend(fontsize=8.5, framealpha=0.85, loc="best")
    return True, spans


def with_info_lines(chart: Chart, info: dict) -> Chart:
    """The chart with each panel's `info_lines` drawn at the run's own values (training_info.json), where it has them."""
    panels = []
    for panel in chart.panels:
        lines = tuple((float(info[key]), f"{label} = {info[key]:g}") for key, label in panel.info_lines
                      if isinstance(info.get(key), (int, float)))
        panels.append(dataclasses.replace(panel, reference_lines=panel.reference_lines + lines) if lines else panel)
    return dataclasses.replace(chart, panels=tuple(panels))


def _shown(metrics: list[dict], panel: Panel) -> bool:
    """Whether the panel adds a curve of its own (Panel.shown_when)."""
    if panel.shown_when is None:
        return True
    pattern, count = panel.shown_when
    return len({key for record in metrics for key in record if fnmatch.fnmatchcase(key, pattern)}) >= count


def plot_chart(metrics: list[dict], chart: Chart, path: Path, resumes: list[tuple[int, str]] = ()) -> bool:
    """Draw one chart into `path` (each resume marked: `resume_marks`); False (and no file) when none of its metrics
    was logged."""
    from matplotlib.figure import Figure  # here, not at import: the preflight reads CHARTS and never draws (1 s)

    panels = [panel for panel in chart.panels if _shown(metrics, panel)]
    if not panels:
        return False
    height = 0.75 + 3.75 * len(panels)
    figure = Figure(figsize=(8.5, height), dpi=110)
    # Fixed margins instead of a layout engine: the panels are alike, and a layout engine renders every figure twice.
    figure.subplots_adjust(left=0.095, right=0.975, top=1 - 0.4 / height, bottom=0.55 / height, hspace=0.22)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    drawn = [_draw_panel(ax, metrics, panel, bottom=index == len(axes) - 1, resumes=resumes)
             for index, (ax, panel) in enumerate(zip(axes, panels))]
    if not any(drew for drew, _ in drawn):
        return False
    spans = set().union(*(panel_spans for _, panel_spans in drawn))
    if spans:  # once, beside the x label: above a panel it ran into the panel's title
        figure.text(0.975, 0.12 / height, f"bold: centred mean of ~{max(spans)} points; faint: raw", fontsize=8.5,
                    color="dimgray", ha="right", va="bottom")
    figure.align_ylabels(axes)
    with atomic_path(path) as temporary:  # the live report redraws these while someone may be looking
        figure.savefig(temporary)
    return True


def dpo_loss_chart(loss_type, loss_weights=None, plain: Chart | None = None) -> Chart:
    """The DPO loss chart for the loss that ran. ln 2 is where TRL's sigmoid loss starts (policy = reference); a
    combined loss (e.g. sigmoid + 0.4 x sft, RPO) or another loss type starts elsewhere, so the line would read as a
    problem that is not there: the title names the terms instead."""
    if dpo_loss_terms(loss_type, loss_weights) == [("sigmoid", 1)]:
        return plain or next(row.report.charts[0] for row in OBJECTIVES.values() if row.report.combined_loss)
    terms = describe_dpo_loss(loss_type, loss_weights)
    return Chart("loss.png", f"DPO loss ({terms})", (
        Panel(f"DPO loss: {terms}", "loss", (Curve("loss", "loss"),), min_y_span=0.2),))


def plot_history(metrics: list[dict], stage: str, out_dir: str | Path, loss_type=None,
                 loss_weights=None, info: dict | None = None) -> list[tuple[str, Path]]:
    """Write every chart of `stage` that has data into `out_dir`; returns (caption, path) per written file.
    `loss_type` / `loss_weights` (DPO, as configured) choose how the loss chart is labelled."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    charts = CHARTS[stage]
    if objective(stage).report.combined_loss and loss_type is not None:
        charts = (dpo_loss_chart(loss_type, loss_weights, charts[0]),) + charts[1:]
    charts = tuple(with_info_lines(chart, info or {}) for chart in charts)
    resumes = resume_marks(info or {})
    for chart in charts:
        path = out_dir / chart.filename
        if plot_chart(metrics, chart, path, resumes):
            written.append((chart.caption, path))
    return written
