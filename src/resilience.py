"""Nothing lost: complete checkpoints only, resume where a run stopped, a clean stop on SIGTERM/SIGINT, and a stop
before a NaN/inf can be saved.

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

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from src.locking import COMPLETE_MARKER

SIGNAL_EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}
DIVERGED_EXIT_CODE = 4
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


class CompleteCheckpointsMixin:
    """For transformers Trainers: a checkpoint is marked complete once every rank has saved, and older checkpoints
    are rotated only then (transformers rotates inside the save, so a crash mid-save could leave none whole)."""

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        self.accelerator.wait_for_everyone()  # every rank's RNG state and shards are on disk
        if self.args.should_save:
            mark_complete(Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()



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


class StopConditions(TrainerCallback):
    """After every optimizer step, all ranks agree (one tiny all-reduce) on whether to stop:
    - a stop signal reached any rank: save a checkpoint now and stop;
    - a loss or gradient norm was non-finite on any rank: stop without saving, before the step can be checkpointed.
    Gradients are checked just before the optimizer applies them, and zeroed when non-finite so the in-memory
    weights stay finite too."""

    def __init__(self):
        self.non_finite: str | None = None   # what went non-finite, e.g. "loss nan"
        self.diverged_at: int | None = None
        self.stopped_by: str | None = None
        self.stopped_at: int | None = None

    def observe_loss(self, loss) -> None:
        import torch

        if self.non_finite is None and not torch.isfinite(loss.detach()).all():
            self.non_finite = f"loss {float(loss.detach().float().mean())}"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch

        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if not gradients:
            return
        norm = torch.nn.utils.get_total_norm(gradients)
        if not torch.isfinite(norm):
            if self.non_finite is None:
                self.non_finite = f"gradient norm {float(norm)}"
            for gradient in gradients:
                gradient.zero_()

    def on_step_end(self, args, state, control, **kwargs):
        signalled, diverged = _any_rank(stop_signal() is not None, self.non_finite is not None)
        if diverged:
            from src.distributed import gather_objects

            self.diverged_at = state.global_step
            reasons = [(rank, reason) for rank, (reason,) in enumerate(gather_objects([self.non_finite])) if reason]
            # The rank where it started first: its loss, before the all-reduce spread NaN gradients to every rank.
            reasons.sort(key=lambda item: not item[1].startswith("loss"))
            self.non_finite = ", ".join(f"{reason} (rank {rank})" for rank, reason in reasons)
            control.should_save = False
            control.should_evaluate = False
            control.should_training_stop = True
        elif signalled:
            self.stopped_by = stop_signal() or "a signal to another rank"
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control


def _any_rank(*flags: bool) -> list[bool]:
    """Each flag OR-ed over all ranks."""
    import torch
    import torch.distributed as dist

    values = torch.tensor([float(flag) for flag in flags])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            values = values.cuda()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


def trim_metrics(records: list[dict], last_step: int) -> list[dict]:
    """The history up to a checkpoint: what came after it is recomputed by the resumed run."""
    return [record for record in records if record.get("step", 0) <= last_step]
