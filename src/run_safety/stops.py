"""How a run stops on purpose: a clean stop on SIGTERM/SIGINT, and a stop before a NaN/inf can be saved. (The
trainer side of it, StopConditions, lives in src/trainers/callbacks.py; this module stays light.)

- SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C): every rank finishes the step it is in, the job saves
  a checkpoint and exits 143 / 130; relaunching the same command resumes.
- A non-finite loss or gradient norm stops the run at that step, without saving it, and says which step and value.
- The launcher gone (src/run_safety/parent_watch.py): the same clean stop where one is possible (in training).
- `Status`: what training_info.json says of a stage (running, completed, stopped, diverged).
"""

from __future__ import annotations

import signal

from src.run_safety.exit_status import ExitStatus

SIGNAL_EXIT_CODES = {"SIGTERM": ExitStatus.SIGTERM, "SIGINT": ExitStatus.SIGINT}


class Status:
    """training_info.json's `status` for a stage."""

    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"      # by a signal, with a checkpoint to resume from
    DIVERGED = "diverged"    # a non-finite loss or gradient


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: reported in one line, exit code 4, no traceback."""


_stop_signal: list[str] = []
_clean_stop_point: list[bool] = [False]  # True while training: a stop requested now is taken at the step's end


def request_stop(name: str) -> None:
    """Ask for a clean stop at the end of the current step; `name` says why ("SIGTERM")."""
    if not _stop_signal:
        _stop_signal.append(name)


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT ask for a clean stop at the end of the current step instead of killing the process."""

    def on_signal(signum, frame):
        request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def set_clean_stop_point(active: bool) -> None:
    """StopConditions says when a requested stop will be taken (training) and when not (everything else)."""
    _clean_stop_point[0] = active


def clean_stop_possible() -> bool:
    return _clean_stop_point[0]


def stop_signal() -> str | None:
    return _stop_signal[0] if _stop_signal else None
