"""The "Rounds" section of an iterative DPO run's report: one table row per round (pairs formed and skipped, the
judged held-out result after it, seconds per phase) and a plot of the judged result by round, from training_info.json's
"rounds" (written by src/rounds.py rounds_summary when the last round ends).
"""

from __future__ import annotations

from pathlib import Path

from src.progress import format_duration
from src.reporting.formatting import format_number, format_percent, metric_points, table_lines
from src.run_files import atomic_path

ROUNDS_PLOT = "rounds.png"


def from_prompts(rounds: list[dict]) -> bool:
    """Whether the rounds started from prompts alone (no offline DPO stage: the first entry is round 1)."""
    return bool(rounds) and rounds[0]["round"] == 1


def _label(entry: dict) -> str:
    return "DPO (offline pairs)" if entry["round"] == 0 else f"round {entry['round']}"


def _split(entry: dict) -> tuple[str | None, dict]:
    """The split the report's verdict reads: test where it was judged, else val."""
    judged = entry.get("judged") or {}
    split = "test" if "test" in judged else next(iter(judged), None)
    return split, judged.get(split) or {}


def rounds_section(rounds: list[dict], plot: Path | None, run_dir: Path) -> list[str]:
    """Markdown lines: the table of rounds and the plot."""
    split, first = _split(rounds[0]) if rounds else (None, {})
    metric = (first.get("metric") or "score").replace("_", " ")
    start = first.get("before")
    before = "the model the rounds started from (prompts alone: no offline pairs)" if from_prompts(rounds) else \
        "the model before the DPO stage"
    lines = [f"Each round the model answered the train prompts, the judge scored every answer, and DPO trained on each "
             f"prompt's best answer against its worst. Judged on the {first.get('n', '?')} held-out {split or ''} "
             f"prompts ({metric}); {before}: {format_percent(start)}.", ""]
    header = ["round", "pairs", "skipped (all equal)", "mean score", "best of K", f"{metric} after", "change",
              "correct", "sample + judge", "train + judge"]
    rows, previous = [], start
    for entry in rounds:
        _, judged = _split(entry)
        after, seconds = judged.get("after"), entry.get("seconds") or {}
        correct = (judged.get("details") or {}).get("correct")
        rows.append([_label(entry), format_number(entry.get("pairs"), 0) if entry.get("pairs") is not None else "—",
                     format_number(entry["skipped_all_equal"]) if entry.get("skipped_all_equal") is not None else "—",
                     format_number(entry.get("mean_score"), 3) if entry.get("mean_score") is not None else "—",
                     format_number(entry.get("best_of_k_score"), 3) if entry.get("best_of_k_score") is not None else "—",
                     format_percent(after), metric_points(previous, after),
                     format_percent(correct) if correct is not None else "—",
                     format_duration(seconds.get("sample_and_judge")) if seconds.get("sample_and_judge") else "—",
                     format_duration(seconds.get("train_and_judge"))])
        previous = after
    lines += table_lines(header, rows)
    if plot is not None:
        lines += ["", f"![judged result by round]({plot.relative_to(run_dir).as_posix()})"]
    return lines


def plot_rounds(rounds: list[dict], path: Path) -> bool:
    """The judged held-out result (and correctness, where the judge reports it) by round, every split; False and no
    file when no round was judged."""
    from matplotlib.figure import Figure  # drawn at the end of a run only (~1 s import)

    labels = ["start" if from_prompts(rounds) else "before DPO"] + [
        _label(entry).replace(" (offline pairs)", "") for entry in rounds]
    figure = Figure(figsize=(8.5, 4.2), dpi=110)
    figure.subplots_adjust(left=0.09, right=0.98, top=0.9, bottom=0.14)
    ax = figure.add_subplot()
    drew = False
    for split, color in (("val", "#1f77b4"), ("test", "#ff7f0e")):
        judged = [(entry.get("judged") or {}).get(split) for entry in rounds]
        if not rounds or not all(judged):
            continue
        values = [judged[0]["before"]] + [result["after"] for result in judged]
        metric = judged[0]["metric"].replace("_", " ")
        ax.plot(range(len(values)), [100 * value for value in values], "o-", color=color, label=f"{split}: {metric}")
        correct = [(judged[0].get("details_before") or {}).get("correct")] + [
            (result.get("details") or {}).get("correct") for result in judged]
        if all(value is not None for value in correct):
            ax.plot(range(len(values)), [100 * value for value in correct], "s--", color=color, alpha=0.5,
                    label=f"{split}: correct")
        drew = True
    if not drew:
        return False
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("% of held-out prompts")
    ax.set_ylim(bottom=0)
    ax.set_title("Judged held-out result by round")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        figure.savefig(temporary)
    return True
