"""Where a run stands, in one line: running / finished / stopped / diverged, step N of M, elapsed, ETA.

    **running** · step 170 of 1,000 (17%) · elapsed 12 min 3 s · ETA 58 min · updated 2026-11-23 17:40 UTC

The first line of report.md, the rows of results/index.md and the comparison page all say it this way. It is read from
the run directory: `training_info.json`'s `status` (src/run_safety/stops.py's Status) and the last step and time logged
in `metrics.jsonl`; the live report (src/reporting/live.py) passes what the training loop knows exactly instead (`Live`).
Elapsed and ETA are training-loop time (evaluations included) of the current launch: a resumed run counts from its
resume, at the rate since then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from numbers import Real

from src.progress import eta_seconds, format_duration

RUNNING, FINISHED, STOPPED, DIVERGED, UNFINISHED = "running", "finished", "stopped", "diverged", "did not finish"


@dataclass(frozen=True)
class Live:
    """What the training loop knows while it runs (rank 0): exact step, planned steps, time since training began."""

    step: int
    total: int
    elapsed_s: float
    eta_s: float | None
    stalled: str | None = None  # "no step for 4 min 10 s; rank 1 in the judge" (src/run_safety/hang_watch.py)


@dataclass(frozen=True)
class RunState:
    state: str                  # one of RUNNING, FINISHED, STOPPED, DIVERGED, UNFINISHED
    step: int | None            # last optimizer step (logged, or live)
    total: int | None           # planned optimizer steps
    elapsed_s: float | None     # training-loop time of this launch
    eta_s: float | None         # running only
    reason: str | None          # stopped / diverged: why, in a few words
    live: bool                  # from the training loop itself (False: rebuilt from the files)
    as_of: datetime             # when the line was written (live) or when the last record was written (files)
    stalled: str | None = None  # running, no step for a few step times: says so instead of an ETA


def _number(value) -> float | None:
    return float(value) if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) else None


def _last(metrics: list[dict], key: str) -> float | None:
    for record in reversed(metrics):
        value = _number(record.get(key))
        if value is not None:
            return value
    return None


def recorded_total_steps(info: dict) -> int | None:
    """The optimizer steps the run said it would take, as training_info.json records them (planned_steps in
    src/trainers/stage_plan.py computes them at the start; a run written before they were recorded has max_steps at
    most)."""
    total = info.get("planned_steps") or info.get("max_steps")
    return int(total) if isinstance(total, int) and total > 0 else None


def _reason(info: dict, state: str) -> str | None:
    """A few words from the job's stop_reason: "by SIGTERM", "loss nan (rank 0)"."""
    text = info.get("stop_reason") or ""
    if state == STOPPED and text.startswith("stopped "):
        return text[len("stopped "):].split(" at step")[0]
    if state == DIVERGED and "(" in text:  # "...: training diverged at step 7 (loss nan (rank 0)); nothing was..."
        return text.split("(", 1)[1].split("); ")[0]
    return None


def run_state(info: dict, metrics: list[dict], live: Live | None = None, last_written: datetime | None = None,
              now: datetime | None = None) -> RunState:
    """The run's state from training_info.json (`info`, {} when missing) and its metric history; `last_written` is
    when metrics.jsonl was last written (the files' answer to "as of when")."""
    now = now or datetime.now(timezone.utc)
    status = info.get("status")
    finished_training = _last(metrics, "train_runtime") is not None
    state = {"completed": FINISHED, "stopped": STOPPED, "diverged": DIVERGED, "running": RUNNING}.get(status)
    if state is None:  # a run directory written before statuses were recorded, or copied without training_info.json
        state = FINISHED if finished_training else UNFINISHED
    total = recorded_total_steps(info)
    if live is not None and state == RUNNING:
        return RunState(RUNNING, live.step, live.total or total, live.elapsed_s, live.eta_s, None, True, now,
                        live.stalled)

    steps = [int(record["step"]) for record in metrics if _number(record.get("step")) is not None]
    step = max(steps) if steps else None
    elapsed = _last(metrics, "time_s")
    eta = None
    if state == RUNNING and step is not None and elapsed is not None and not finished_training:
        resumed_from = ((info.get("resumes") or [{}])[-1] or {}).get("from_step") or 0
        eta = eta_seconds(step - resumed_from, (total or 0) - resumed_from, elapsed) if total else None
    training = _last(metrics, "train_runtime")
    return RunState(state, step, total, training if training is not None else elapsed, eta, _reason(info, state),
                    False, last_written or now)


def _steps(state: RunState) -> str:
    if state.step is None:
        return "no step logged yet"
    if not state.total:
        return f"step {state.step:,}"
    if state.state == FINISHED:
        return f"{state.step:,} of {state.total:,} steps"
    return f"step {state.step:,} of {state.total:,} ({100 * state.step / state.total:.0f}%)"


def _when(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def status_line(state: RunState) -> str:
    """The one line (markdown) that says where the run stands."""
    parts = [f"**{state.state}**"]
    if state.reason:
        parts[0] += f" ({state.reason})"
    if state.state in (STOPPED, DIVERGED) and state.step is not None:
        parts[0] += " at " + _steps(state)
    else:
        parts.append(_steps(state))
    if state.state == FINISHED:
        parts.append(f"training took {format_duration(state.elapsed_s)}")
        return " · ".join(parts)
    parts.append(f"elapsed {format_duration(state.elapsed_s)}")
    if state.state == RUNNING:
        done = state.step is not None and state.total and state.step >= state.total
        parts.append(state.stalled or ("training done; saving and judging" if done else
                                       f"ETA {format_duration(state.eta_s)}"))
        parts.append(f"updated {_when(state.as_of)}" if state.live else
                     f"last record {_when(state.as_of)} (no end recorded: if the job is gone, it was interrupted)")
    elif state.state == STOPPED:
        parts.append("the same command resumes it")
    return " · ".join(parts)
