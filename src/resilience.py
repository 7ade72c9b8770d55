"""Nothing lost: complete checkpoints only, resume where a run stopped, a clean stop on SIGTERM/SIGINT, and a stop
before a NaN/inf can be saved. (The trainer side of it, CompleteCheckpointsMixin and StopConditions, lives in
src/training.py with the other trainer pieces; this module stays light so errors are reported fast.)

- A checkpoint counts once every rank has written its part and rank 0 has added a `.complete` marker; older ones
  are rotated out only after that, so a crash at any moment leaves the previous checkpoint whole.
- On start, a run whose training_info.json says it did not finish resumes from its newest complete checkpoint (same
  data order, optimizer, scheduler and step: transformers' own resume), and its metric history is cut back to that
  step so the curve continues instead of restarting.
- SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C): every rank finishes the step it is in, the job saves
  a checkpoint and exits 143 / 130; relaunching the same command resumes.
- A non-finite loss or gradient norm stops the run at that step, without saving it, and says which step and value.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

from src.exit_status import ExitStatus
from src.locking import COMPLETE_MARKER

SIGNAL_EXIT_CODES = {"SIGTERM": ExitStatus.SIGTERM, "SIGINT": ExitStatus.SIGINT}
PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers' name for checkpoint-<step> directories
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class Status:
    """training_info.json's `status` for a stage."""

    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"      # by a signal, with a checkpoint to resume from
    DIVERGED = "diverged"    # a non-finite loss or gradient


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: reported in one line, exit code 4, no traceback."""


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N directories, oldest first (complete or not)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [path for path in output_dir.iterdir() if path.is_dir() and checkpoint_step(path) is not None]
    return sorted(found, key=checkpoint_step)


def is_complete(checkpoint: Path) -> bool:
    return (Path(checkpoint) / COMPLETE_MARKER).exists()


def newest_complete_checkpoint(output_dir: Path) -> Path | None:
    complete = [path for path in checkpoints(output_dir) if is_complete(path)]
    return complete[-1] if complete else None


def remove_incomplete_checkpoints(output_dir: Path) -> list[Path]:
    """Delete checkpoints that a crash left half-written (rank 0, before resuming); returns what was removed."""
    removed = [path for path in checkpoints(output_dir) if not is_complete(path)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def mark_complete(checkpoint: Path) -> None:
    marker = Path(checkpoint) / COMPLETE_MARKER
    with open(marker, "w") as handle:
        handle.flush()
        os.fsync(handle.fileno())


# --------------------------------------------------------------------------------------------------------------------
# Stopping: signals and non-finite values
# --------------------------------------------------------------------------------------------------------------------

_stop_signal: list[str] = []


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT ask for a clean stop at the end of the current step instead of killing the process."""

    def request_stop(signum, frame):
        name = signal.Signals(signum).name
        if not _stop_signal:
            _stop_signal.append(name)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def stop_signal() -> str | None:
    return _stop_signal[0] if _stop_signal else None


def trim_metrics(records: list[dict], last_step: int) -> list[dict]:
    """The history up to a checkpoint: what came after it is recomputed by the resumed run."""
    return [record for record in records if record.get("step", 0) <= last_step]
