"""`results/index.md`: every run in the results folder on one page — status, stage, model, data, key settings,
judged before → after, training time — each linking to its report.

    python -m src.reporting.index [RESULTS_DIR]      # rebuild it (default: results/)

The training job rewrites it on rank 0 whenever a run ends (finished, stopped or diverged). Like report.md it reads
only the run directories (`training_info.json`, `metrics.jsonl`), so it is right for runs copied in from elsewhere.
A run is a directory holding `metrics.jsonl` or `training_info.json`; a pipeline's earlier stage (`<run>/sft/`) is
shown in its run's row, not as a row of its own.
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

from src.objectives import OBJECTIVES, display_name, objective
from src.progress import format_duration
from src.reporting.formatting import ci95, format_judged, format_number, table_lines
from src.reporting.report import REPORT, stage_label
from src.reporting.status import run_state
from src.run_files import METRICS, TRAINING_INFO, read_json, read_jsonl, write_text

INDEX = "index.md"


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / METRICS).is_file() or (path / TRAINING_INFO).is_file())


def find_runs(results_dir: Path) -> list[Path]:
    """The run directories directly inside `results_dir`, by name."""
    return sorted(path for path in results_dir.iterdir() if is_run_dir(path)) if results_dir.is_dir() else []


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """(training_info.json or {}, metrics.jsonl records or []): a half-copied run reads as what it has."""
    try:
        info = read_json(run_dir / TRAINING_INFO) if (run_dir / TRAINING_INFO).is_file() else {}
    except ValueError:
        info = {}
    try:
        metrics = read_jsonl(run_dir / METRICS)
    except ValueError:
        metrics = []
    return info, metrics


def run_state_of(run_dir: Path, info: dict, metrics: list[dict]):
    path = run_dir / METRICS
    written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc) if path.is_file() else None
    return run_state(info, metrics, last_written=written)


def key_settings(info: dict) -> str:
    """The handful of settings that tell runs apart at a glance."""
    config = info.get("config") or {}
    parts = []
    if info.get("global_batch_size"):
        parts.append(f"batch {info['global_batch_size']}")
    if info.get("learning_rate") is not None:
        parts.append(f"lr {format_number(info['learning_rate'], 3)}")
    if info.get("stage") in OBJECTIVES and objective(info["stage"]).report.loss_rows:  # an objective with a beta and a loss
        loss = info.get("loss_type") or config.get("loss_type")
        parts.append(f"β {format_number(info.get('beta', config.get('beta')), 3)}"
                     + (f" {'+'.join(loss) if isinstance(loss, list) else loss}" if loss else ""))
    if info.get("use_lora"):
        parts.append(f"{'QLoRA' if info.get('load_in_4bit') else 'LoRA'} r{config.get('lora_r', '?')}")
    if info.get("world_size"):
        parts.append(f"{info['world_size']}× {info.get('device', '?')}")
    return " · ".join(parts) or "n/a"


def judged_cell(info: dict) -> str:
    """`metric: before → after ±CI` on the headline split; a pipeline's untrained → after earlier stage → after."""
    judge = info.get("judge")
    if not judge:
        return "not judged"
    metric = str(judge.get("metric", ""))
    after = format_judged(metric, judge.get("after")) + ("" if metric.startswith("mean_") else
                                                         ci95(judge.get("after"), judge.get("n") or 0))
    earlier = (info.get("previous_stage") or {}).get("judge")
    chain = ([format_judged(metric, earlier.get("before")), format_judged(metric, earlier.get("after"))]
             if earlier and earlier.get("metric", metric) == metric else [format_judged(metric, judge.get("before"))])
    metric = metric.replace("_", " ")
    return f"{metric}: {' → '.join(chain + [after])} (n={judge.get('n')})"


def _link(results_dir: Path, run_dir: Path) -> str:
    name = run_dir.relative_to(results_dir).as_posix()
    return f"[{name}]({name}/{REPORT})" if (run_dir / REPORT).is_file() else name


def _pipeline(info: dict, run_dir: Path) -> list[dict]:
    """training_info.json of every stage of the run, the first stage's first: a pipeline's earlier stages are found
    through each one's `previous_stage` (sft_then_dpo_then_grpo: SFT, DPO, GRPO); a stage not on disk ends the walk."""
    stages = [info]
    while (previous := (stages[0].get("previous_stage") or {}).get("run_dir")) and len(stages) < 10:
        run_dir = run_dir / previous
        if not (run_dir / TRAINING_INFO).is_file():
            break
        stages.insert(0, read_run(run_dir)[0])
    return stages


def _stage(info: dict, run_dir: Path) -> str:
    """The run's stages: DPO, SFT → DPO, SFT → DPO → GRPO, SFT → DPO → ROUND 1."""
    stages = [stage_label(f"round{stage['round']['round']}" if stage.get("round") else stage.get("stage") or "?")
              for stage in _pipeline(info, run_dir)]
    previous = (info.get("previous_stage") or {}).get("stage")
    if len(stages) == 1 and previous:  # the earlier stage's directory is gone: its name from this stage's record
        stages.insert(0, display_name(previous))
    return " → ".join(stages)


def _wall(info: dict, metrics: list[dict], run_dir: Path) -> str:
    """The run's training time: every stage's, for a pipeline."""
    total, stages = 0.0, _pipeline(info, run_dir)
    for stage in stages:
        seconds = (stage.get("summary") or {}).get("wall_time_s")
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            return "n/a"
        total += seconds
    return format_duration(total)


def render_index(results_dir: Path) -> str:
    runs = find_runs(results_dir)
    lines = ["# Runs", "",
             f"Every run in `{results_dir}`, rewritten whenever a run ends (or `python -m src.reporting.index "
             f"{results_dir}`). Put runs side by side with `python -m src.reporting.compare RUN_DIR RUN_DIR...`.", ""]
    if not runs:
        return "\n".join(lines + ["No runs yet."]) + "\n"
    rows = []
    for run_dir in runs:
        info, metrics = read_run(run_dir)
        state = run_state_of(run_dir, info, metrics)
        step = f" {state.step:,}/{state.total:,}" if state.step is not None and state.total else ""
        status = state.state + (step if state.state != "finished" else "")
        rows.append([_link(results_dir, run_dir), status, _stage(info, run_dir),
                     f"`{info.get('model_name_or_path', 'n/a')}`", f"`{info.get('dataset_name', 'n/a')}`",
                     key_settings(info), judged_cell(info), _wall(info, metrics, run_dir),
                     (info.get("started_at") or "n/a")[:16].replace("T", " ")])
    lines += table_lines(["run", "status", "stage", "model", "data", "key settings", "judged before → after",
                     "training time", "started (UTC)"], rows)
    lines += ["", "± is the 95% interval of the trained model's fraction. A pipeline's judged column reads untrained → "
                  "after the first stage → after the last."]
    return "\n".join(lines) + "\n"


def write_index(results_dir: str | Path) -> Path:
    """Rewrite `results_dir`/index.md (atomically) and return its path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / INDEX
    write_text(path, render_index(results_dir))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.reporting.index", description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default="results", metavar="RESULTS_DIR")
    args = parser.parse_args(argv)
    if not Path(args.results_dir).is_dir():
        print(f"error: {args.results_dir} is not a directory (the results folder: results/ by default)",
              file=sys.stderr)
        return 2
    print(f"index: {write_index(args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
