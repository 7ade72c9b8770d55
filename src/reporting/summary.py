"""The final numbers of a run, computed from its metric history (`metrics.jsonl`) alone.

`series` is the one way the reporting modules (summary, alerts, plots) read a metric out of the history.
The training job stores `summarize(...)` under `summary` in `training_info.json`; `python -m src.reporting RUN_DIR`
recomputes it, so a crashed run gets the same numbers from what it managed to log.
"""

from __future__ import annotations

import math
from numbers import Real

from src.objectives import objective


def series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of every record that logged `key` as a number, in log order (NaN/inf kept)."""
    steps, values = [], []
    for record in metrics:
        value = record.get(key)
        if isinstance(value, Real) and not isinstance(value, bool):
            steps.append(int(record.get("step", len(steps))))
            values.append(float(value))
    return steps, values


def finite(values: list[float]) -> list[float]:
    return [value for value in values if math.isfinite(value)]


def _last(metrics: list[dict], key: str) -> float | None:
    _, values = series(metrics, key)
    return values[-1] if values else None


def _best_eval_loss(metrics: list[dict]) -> tuple[float | None, int | None]:
    steps, values = series(metrics, "eval_loss")
    finite_points = [(value, step) for step, value in zip(steps, values) if math.isfinite(value)]
    if not finite_points:
        return None, None
    value, step = min(finite_points)
    return value, step


def _tokens_per_second(metrics: list[dict]) -> float | None:
    """Prefer the job's own throughput measurements; otherwise TRL's cumulative `num_tokens` over elapsed time."""
    logged = finite(series(metrics, "perf/tokens_per_second")[1])
    if logged:
        return sum(logged) / len(logged)
    # num_tokens is TRL's running total over all ranks, so the slope between two records is global throughput.
    points = [(record["time_s"], record["num_tokens"]) for record in metrics
              if isinstance(record.get("num_tokens"), Real) and isinstance(record.get("time_s"), Real)
              and math.isfinite(record["num_tokens"]) and math.isfinite(record["time_s"])]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def summarize(metrics: list[dict], stage: str) -> dict:
    """Final numbers of a run: what the report's table shows and `training_info.json["summary"]` stores.

    Keys are always present (None when the history cannot say), so a reader can rely on the schema:
    `finished` (TRL's end-of-training record was logged), `last_step`, `last_epoch`, `final_train_loss` (last
    logged value, NaN if it diverged), `train_loss` (TRL's mean over the run), `best_eval_loss`/`best_eval_step`,
    `final_eval_loss`, `tokens_per_second`, `samples_per_second`, `wall_time_s`, `peak_memory_mb`; then the
    objective's own (`final_<name>_train` / `_eval` for each of its row's summary_numbers: DPO and reward the reward
    accuracy and margin, KTO the margin and KL, SFT the token accuracy).
    """
    steps = [int(record["step"]) for record in metrics if isinstance(record.get("step"), Real)]
    epochs = finite(series(metrics, "epoch")[1])
    times = finite(series(metrics, "time_s")[1])
    best_eval_loss, best_eval_step = _best_eval_loss(metrics)
    peak_memory = finite(series(metrics, "perf/peak_memory_mb")[1])
    samples_per_second = _last(metrics, "train_samples_per_second")
    if samples_per_second is None:
        logged = finite(series(metrics, "perf/samples_per_second")[1])
        samples_per_second = sum(logged) / len(logged) if logged else None
    wall_time = _last(metrics, "train_runtime")
    summary = {
        "stage": stage,
        "finished": _last(metrics, "train_runtime") is not None,
        "last_step": max(steps) if steps else None,
        "last_epoch": epochs[-1] if epochs else None,
        "final_train_loss": _last(metrics, "loss"),
        "train_loss": _last(metrics, "train_loss"),
        "best_eval_loss": best_eval_loss,
        "best_eval_step": best_eval_step,
        "final_eval_loss": _last(metrics, "eval_loss"),
        "tokens_per_second": _tokens_per_second(metrics),
        "samples_per_second": samples_per_second,
        "wall_time_s": wall_time if wall_time is not None else (times[-1] if times else None),
        "peak_memory_mb": max(peak_memory) if peak_memory else None,
    }
    for number in objective(stage).report.summary_numbers:  # the objective's own final numbers (its row's summary_numbers)
        summary[f"final_{number.name}_train"] = _last(metrics, number.metric)
        summary[f"final_{number.name}_eval"] = _last(metrics, f"eval_{number.metric}")
    return summary
