"""Runs side by side: a comparison page (markdown + PNGs) for a sweep, LoRA vs full, 2 vs 8 GPUs, ...

    python -m src.reporting.compare results/beta_0.1 results/beta_0.3 results/beta_1.0
    python -m src.reporting.compare 'results/beta_*'             # a glob (the shell's, or quoted: expanded here)
    python -m src.reporting.compare results/                     # every run in the folder
    python -m src.reporting.compare RUN... --output DIR          # default: results/comparisons/<first>_vs_<...>/

The page overlays the training curves (loss, rewards, margins, accuracy) on one axis — optimizer steps when every run
has the same global batch, else pairs (or sequences) seen, so runs that take different steps through the same data
line up — tables only the settings that differ, puts the judged results side by side with their 95% intervals, and
compares throughput. Runs of different stages (an SFT and a DPO) get a section each. Reads only the run directories.
"""

from __future__ import annotations

import argparse
import glob
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from src.objectives import Metric, display_name, infer_stage, objective
from src.objectives.dpo import dpo_loss_config, dpo_loss_terms
from src.progress import format_duration
from src.reporting.formatting import ci95, format_number, format_percent, metric_points, table_lines
from src.reporting.index import is_run_dir, read_run, run_state_of
from src.reporting.plots import smooth, smoothing_span
from src.reporting.report import REPORT, judge_results
from src.reporting.status import status_line
from src.reporting.summary import series, summarize
from src.run_files import TRAINING_INFO, atomic_path, write_text

PAGE = "compare.md"
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
          "#bcbd22")
# Settings that differ between any two runs by nature: never "a setting that differs".
NOT_SETTINGS = {"run_name", "started_at", "git_commit", "results_dir", "output_dir", "final_model", "merged_model",
                "status", "stop_reason", "overwrite", "final_model_dir", "local_world_size", "distributed_type"}


class CompareError(Exception):
    """The runs cannot be compared (none given, not run directories, no metrics); the message says why."""


@dataclass
class Run:
    name: str
    path: Path
    info: dict
    metrics: list[dict]
    stage: str

    @property
    def global_batch(self) -> int | None:
        value = self.info.get("global_batch_size")
        return value if isinstance(value, int) and value > 0 else None


# ---------------------------------------------------------------------------------------------------------- input


def expand(arguments: list[str]) -> list[Path]:
    """Run directories from the command line: directories, globs, or a folder of runs (results/)."""
    paths: list[Path] = []
    for argument in arguments:
        matches = sorted(glob.glob(argument)) if glob.has_magic(argument) else [argument]
        if not matches:
            raise CompareError(f"{argument} matches nothing")
        for match in map(Path, matches):
            if not match.exists():
                raise CompareError(f"{match} does not exist")
            if is_run_dir(match):
                paths.append(match)
            elif match.is_dir() and any(is_run_dir(child) for child in match.iterdir()):
                paths += sorted(child for child in match.iterdir() if is_run_dir(child))
            elif not glob.has_magic(argument):  # a glob may match other files; a named path must be a run
                raise CompareError(f"{match} is not a run directory (no metrics.jsonl or training_info.json) "
                                   "and holds none")
    unique = list(dict.fromkeys(path.resolve() for path in paths))
    if not unique:
        raise CompareError("no run directories given")
    return unique


def load_runs(paths: list[Path]) -> list[Run]:
    runs, names = [], set()
    for path in paths:
        info, metrics = read_run(path)
        if not metrics:
            raise CompareError(f"{path} has no metrics (metrics.jsonl missing or empty): nothing to compare")
        name = info.get("run_name") or path.name
        while name in names:  # two runs of the same name copied from different places
            name = f"{name}'"
        names.add(name)
        stage = info.get("stage") or infer_stage(metrics)
        runs.append(Run(name, path, info, metrics, stage))
    return runs


# ------------------------------------------------------------------------------------------------------- settings


def _flatten(info: dict) -> dict:
    """Setting name → value: the recipe fields (`config`), overlaid by the resolved plan (top level)."""
    flat = {}
    for key, value in (info.get("config") or {}).items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            flat[key] = value
    for key, value in info.items():
        if key == "versions" and isinstance(value, dict):
            flat.update({f"version of {name}": version for name, version in value.items()})
        elif not isinstance(value, dict):
            flat[key] = value
    return {key: value for key, value in flat.items() if key not in NOT_SETTINGS}


def _value(value) -> str:
    if isinstance(value, list):
        return ", ".join(_value(item) for item in value) or "[]"
    return format_number(value, 4) if not isinstance(value, str) else value


def differing_settings(runs: list[Run]) -> list[list[str]]:
    flats = [_flatten(run.info) for run in runs]
    keys = sorted({key for flat in flats for key in flat})
    rows = []
    for key in keys:
        shown = [_value(flat.get(key, "—")) for flat in flats]
        if len(set(shown)) > 1:
            rows.append([f"`{key}`", *shown])
    return rows


# --------------------------------------------------------------------------------------------------------- curves


def axis(runs: list[Run]) -> tuple[str, dict[str, float]]:
    """The x axis and each run's scale: steps when every run has the same global batch, else examples seen."""
    batches = {run.global_batch for run in runs}
    if len(batches) == 1 or None in batches:
        return "optimizer step", {run.name: 1.0 for run in runs}
    unit = f"{objective(runs[0].stage).example_word} seen"
    return f"{unit} (step × global batch)", {run.name: float(run.global_batch) for run in runs}


def plot_metric(runs: list[Run], metric: Metric, x_label: str, scale: dict[str, float], path: Path) -> bool:
    """One panel: each run's train curve (smoothed, raw faint) and eval points in the run's colour."""
    figure = Figure(figsize=(8.5, 4.6), dpi=110)
    figure.subplots_adjust(left=0.1, right=0.975, top=0.9, bottom=0.13)
    ax = figure.subplots()
    drew = False
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        for key, style, suffix in ((metric.key, "-", metric.first_label),) + (
                ((metric.second[0], "--", metric.second[1]),) if metric.second else ()):
            steps, values = series(run.metrics, key)
            points = [(step * scale[run.name], value) for step, value in zip(steps, values) if math.isfinite(value)]
            label = run.name + (f" ({suffix})" if suffix and metric.second else "")
            if points:
                xs, ys = zip(*points)
                if len(ys) >= 10:
                    ax.plot(xs, ys, color=color, alpha=0.18, linewidth=0.8, linestyle=style)
                    ys = smooth(list(ys), smoothing_span(len(ys)))
                ax.plot(xs, ys, color=color, linewidth=2.0, linestyle=style, label=label,
                        marker="o" if len(ys) < 10 else None, markersize=4)
                drew = True
            eval_steps, eval_values = series(run.metrics, f"eval_{key}")
            eval_points = [(step * scale[run.name], value) for step, value in zip(eval_steps, eval_values)
                           if math.isfinite(value)]
            if eval_points:
                xs, ys = zip(*eval_points)
                ax.plot(xs, ys, color=color, linestyle="none", marker="D" if style == "-" else "v", markersize=6,
                        markeredgecolor="black", markeredgewidth=0.7, zorder=3)
                drew = True
    if not drew:
        return False
    # ln 2 is where sigmoid DPO starts; a run with another or a combined loss starts elsewhere.
    combined = [run for run in runs if objective(run.stage).report.combined_loss]
    plain = all(dpo_loss_terms(*dpo_loss_config(run.info)) == [("sigmoid", 1)] for run in combined)
    if metric.reference and (plain or metric.key != "loss" or not objective(runs[0].stage).report.combined_loss):
        ax.axhline(metric.reference[0], color="gray", linestyle=":", linewidth=1.2, label=metric.reference[1])
    ax.set_title(metric.title, fontsize=12, fontweight="bold", loc="left")
    ax.set_title("lines: train (smoothed, raw faint)   " + ("◆ ▼: eval" if metric.second else "◆: eval"),
                 fontsize=8.5, color="dimgray", loc="right")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric.ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8.5, framealpha=0.85, loc="best")
    with atomic_path(path) as temporary:
        figure.savefig(temporary)
    return True


def plot_throughput(runs: list[Run], path: Path) -> bool:
    """Training tokens/s (all ranks) over the run, against each run's own progress (fraction of its steps)."""
    figure = Figure(figsize=(8.5, 4.0), dpi=110)
    figure.subplots_adjust(left=0.1, right=0.975, top=0.88, bottom=0.14)
    ax = figure.subplots()
    drew = False
    for index, run in enumerate(runs):
        steps, values = series(run.metrics, "perf/tokens_per_second")
        points = [(step, value) for step, value in zip(steps, values) if math.isfinite(value)]
        if points:
            last = max(step for step, _ in points) or 1
            ax.plot([step / last for step, _ in points], [value for _, value in points], color=COLORS[index % 10],
                    linewidth=1.8, marker="o" if len(points) < 10 else None, markersize=4, label=run.name)
            drew = True
    if not drew:
        return False
    ax.set_title("Training throughput (evaluation and checkpoints left out)", fontsize=12, fontweight="bold",
                 loc="left")
    ax.set_xlabel("fraction of the run's steps")
    ax.set_ylabel("tokens / second (all ranks)")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8.5, framealpha=0.85, loc="lower right")
    with atomic_path(path) as temporary:
        figure.savefig(temporary)
    return True


# ----------------------------------------------------------------------------------------------------------- page


def _report_link(run: Run, page_dir: Path) -> str:
    report = run.path / REPORT
    if not report.is_file():
        return f"`{run.path}`"
    try:
        return f"[report]({Path(_relative(report, page_dir)).as_posix()})"
    except ValueError:
        return f"`{report}`"


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path, start)


def judged_rows(runs: list[Run]) -> list[list]:
    rows = []
    for run in runs:
        results = judge_results(run.info)
        if not results:
            rows.append([run.name, "—", "not judged", "", "", "", ""])
        for split, result in results.items():
            after = result.get("after")
            rows.append([run.name, split, str(result.get("metric", "")).replace("_", " "), result.get("n"),
                         format_percent(result.get("before")) + ci95(result.get("before"), result.get("n") or 0),
                         format_percent(after) + ci95(after, result.get("n") or 0), metric_points(result.get("before"), after)])
    return rows


def rounds_rows(runs: list[Run]) -> list[str]:
    """The judged result after the DPO stage and after every round, one row per DPO run: offline runs (no rounds)
    show their one result beside the rounds of iterative ones."""
    dpo_runs = [run for run in runs if objective(run.stage).on_policy_rounds]
    most = max(len(run.info.get("rounds") or []) + ((run.info.get("rounds") or [{}])[0].get("round") == 1)
               for run in dpo_runs)
    header = ["run", "split", "metric", "before DPO", "after DPO"] + [f"round {index}" for index in range(1, most)]
    rows = []
    for run in dpo_runs:
        rounds = run.info.get("rounds") or []
        results = judge_results(run.info)
        split = "test" if "test" in results else next(iter(results), None)
        if split is None:
            continue
        if rounds:
            judged = [(entry.get("judged") or {}).get(split) or {} for entry in rounds]
            values = [judged[0].get("before")] + ["—"] * (rounds[0]["round"] == 1) + [  # from prompts: no DPO stage
                result.get("after") for result in judged]
        else:
            values = [results[split].get("before"), results[split].get("after")]
        metric = str(results[split].get("metric", "")).replace("_", " ")
        rows.append([run.name, split, metric, *[value if value == "—" else format_percent(value) for value in values]]
                    + [""] * (len(header) - 3 - len(values)))
    return table_lines(header, rows)


def audit_rows(runs: list[Run]) -> list[list]:
    """The data audit's training split and the answers (test, else val) side by side: one row per run."""
    rows = []
    for run in runs:
        train = (run.info.get("data_audit") or {}).get("train") or {}
        answers = run.info.get("answers") or {}
        answered = answers.get("test") or next(iter(answers.values()), {})
        length = lambda side: (answered.get(f"length_{side}") or {}).get("mean")  # noqa: E731
        rows.append([run.name, format_number(train.get("pairs")), format_percent(train.get("duplicate_share")),
                     format_percent(train.get("chosen_longer_share")),
                     format_percent(train.get("truncated_share")),
                     format_percent(train.get("reference_agreement")), format_percent(train.get("judge_inverted_share")),
                     "n/a" if length("before") is None else f"{length('before'):.1f} → {length('after'):.1f}",
                     format_percent(answered.get("cut_share_after")),
                     format_percent(answered.get("repetition_share_after"))])
    return rows


def throughput_rows(runs: list[Run]) -> list[list]:
    rows = []
    for run in runs:
        summary = summarize(run.metrics, run.stage)
        measured = ((run.info.get("summary") or {}).get("throughput") or {})
        tokens = measured.get("tokens_per_second") or summary.get("tokens_per_second")
        samples = measured.get("samples_per_second") or summary.get("samples_per_second")
        world = run.info.get("world_size") or 1
        steps = [value for value in series(run.metrics, "perf/step_time_s")[1] if math.isfinite(value)]
        memory = measured.get("peak_memory_mb") or summary.get("peak_memory_mb")
        wall = (run.info.get("summary") or {}).get("wall_time_s") or summary.get("wall_time_s")
        rows.append([run.name, f"{world}× {run.info.get('device', '?')}", run.global_batch or "?",
                     "n/a" if tokens is None else f"{tokens:,.0f}",
                     "n/a" if tokens is None else f"{tokens / world:,.0f}",
                     format_number(samples, 3), "n/a" if not steps else f"{sorted(steps)[len(steps) // 2]:.3g} s",
                     "n/a" if memory is None else f"{memory:,.0f} MB",
                     "n/a" if measured.get("mfu") is None else f"{100 * measured['mfu']:.1f}%",
                     format_duration(wall)])
    return rows


def _section(runs: list[Run], page_dir: Path, prefix: str) -> list[str]:
    x_label, scale = axis(runs)
    lines = ["Curves on a common axis: "
             + ("**optimizer steps** (every run has the same global batch"
                + (f", {runs[0].global_batch}" if runs[0].global_batch else "") + ")." if scale[runs[0].name] == 1.0
                else f"**{x_label.split(' (')[0]}** (step × global batch), because the global batches differ ("
                + ", ".join(f"{run.name}: {run.global_batch}" for run in runs) + ")."), ""]
    for metric in objective(runs[0].stage).report.compare_metrics:
        filename = f"{prefix}{re.sub(r'[^a-z0-9]+', '_', metric.key.lower())}.png"
        if plot_metric(runs, metric, x_label, scale, page_dir / filename):
            lines += [f"![{metric.title}]({filename})", ""]
    return lines


def render_page(runs: list[Run], page_dir: Path) -> str:
    lines = [f"# {len(runs)} runs compared", ""]
    lines += table_lines(["run", "status", "stage", "model", "data", "global batch", "report"],
                    [[run.name, status_line(run_state_of(run.path, run.info, run.metrics)), display_name(run.stage),
                      f"`{run.info.get('model_name_or_path', 'n/a')}`", f"`{run.info.get('dataset_name', 'n/a')}`",
                      run.global_batch or "?", _report_link(run, page_dir)] for run in runs]) + [""]
    lines += ["## Settings that differ", ""]
    differing = differing_settings(runs)
    lines += (table_lines(["setting", *[run.name for run in runs]], differing) if differing
              else ["None: every recorded setting is the same (the runs differ only by chance: seed order, "
                    "machine)."]) + [""]
    lines += ["## Judged results (held-out prompts)", ""]
    lines += table_lines(["run", "split", "metric", "n", "before (starting model)", "after (trained)", "change"],
                    judged_rows(runs))
    lines += ["", "± is the 95% interval of each fraction (normal approximation). Where two runs' intervals overlap "
                  "much, the difference between them may be chance: judge more prompts (--num_samples) to tell.", ""]
    if any(run.info.get("rounds") for run in runs):
        lines += ["## Rounds (on-policy DPO)", "", *rounds_rows(runs), ""]
    if any(run.info.get("data_audit") or run.info.get("answers") for run in runs):
        lines += ["## Data and answers", ""]
        lines += table_lines(["run", "training pairs", "duplicate rows", "chosen longer", "cut by --max_length",
                              "reference agrees", "judge inverts", "answer tokens before → after", "answers cut",
                              "answers repetitive"], audit_rows(runs))
        lines += ["", "From each run's data audit (report.md's Data and Answers sections): the training split; the "
                      "answers of the test split (else val).", ""]
    stages = list(dict.fromkeys(run.stage for run in runs))
    for stage in stages:
        group = [run for run in runs if run.stage == stage]
        title = "## Curves" + (f": {display_name(stage)} runs" if len(stages) > 1 else "")
        lines += [title, "", *_section(group, page_dir, f"{stage}_" if len(stages) > 1 else "")]
    lines += ["## Throughput", ""]
    lines += table_lines(["run", "processes", "global batch", "tokens/s (all ranks)", "tokens/s per process",
                     "samples/s", "median step time", "peak memory per process", "MFU", "training time"],
                    throughput_rows(runs))
    lines += ["", "Throughput is training only: evaluation and checkpoint time are left out (training time has "
                  "them)."]
    if plot_throughput(runs, page_dir / "throughput.png"):
        lines += ["", "![Training throughput](throughput.png)"]
    return "\n".join(lines) + "\n"


def default_output(runs: list[Run]) -> Path:
    """results/comparisons/<a>_vs_<b>[_vs_<c>]... (or <a>_and_N_more), beside the first run's results folder."""
    names = [re.sub(r"[^A-Za-z0-9._-]+", "-", run.name) for run in runs]
    label = "_vs_".join(names) if len(names) <= 3 else f"{names[0]}_and_{len(names) - 1}_more"
    results = runs[0].path.parent
    while results.parent != results and (results / TRAINING_INFO).is_file():  # a pipeline's stage directory
        results = results.parent
    return results / "comparisons" / label[:120]


def compare(run_dirs: list[str], output: str | None = None) -> Path:
    """Write the comparison page and its PNGs; return the page's path. Raises CompareError on bad input."""
    runs = load_runs(expand(run_dirs))
    if len(runs) < 2:
        raise CompareError(f"only one run ({runs[0].path}): give two or more run directories, or a folder of runs")
    page_dir = Path(output) if output else default_output(runs)
    if page_dir.exists() and not page_dir.is_dir():
        raise CompareError(f"--output {page_dir} is a file: give a directory")
    page_dir.mkdir(parents=True, exist_ok=True)
    page = page_dir / PAGE
    write_text(page, render_page(runs, page_dir))
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.reporting.compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories, globs, or a folder of runs")
    parser.add_argument("--output", metavar="DIR", help="where the page goes (default: results/comparisons/...)")
    args = parser.parse_args(argv)
    try:
        page = compare(args.runs, args.output)
    except CompareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"comparison: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
