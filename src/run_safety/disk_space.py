"""Disk space: what a run will write, checked against the filesystem before training, and the one-line stop when a
write fails anyway (full disk, quota, I/O error).

- `estimate_writes`: one checkpoint (the saved weights: the adapter under LoRA, else the whole model; AdamW's two
  fp32 moments per trainable parameter; tokenizer, scheduler, RNG states and the logged history in trainer state)
  × the checkpoints on disk at once (--save_total_limit, plus the one being written before the oldest is rotated
  out; all of them without a limit) + the final model + the merged copy. A resumed run's existing checkpoints
  count as space it will reuse.
- `check_space`: more than the filesystem can hold is refused (ConfigError, exit 2) with --save_total_limit /
  --results_dir advice; more than WARN_FRACTION of it is a warning.
- `is_write_failure` / `WriteFailed`: ENOSPC, EDQUOT or EIO, as an OSError or as the text safetensors and torch wrap
  them in, becomes one line naming the directory, its free space and the newest complete checkpoint a relaunch
  resumes from: exit status ExitStatus.WRITE_FAILED (5), no traceback (--debug shows it).
- `note_write_failure` / `write_failures_noted`: a failed write is never raised on one rank alone; it is noted (and
  the launcher's exit status recorded) until the next point every rank meets (src/distributed.py `barrier`, the
  per-step StopConditions, a checkpoint's agreement), where every rank stops together (docs/reliability.md).
- `fail_write_if_injected`: the test seam fail_write (src/seams.py) that fails a chosen write as a full disk does.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from src import seams
from src.engines import whole_numel
from src.run_safety import launcher_exit
from src.run_safety.checkpoints import checkpoint_step, newest_complete_checkpoint
from src.run_safety.exit_status import ExitStatus

WARN_FRACTION = 0.8  # beyond this share of the free space, logs, reports and tracker files may not fit
_FAILED_WRITES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EIO: "input/output error"}
# How safetensors (Rust: "IoError(Os { code: 28, ...StorageFull") and torch's zip writer report the same errors.
_FAILED_WRITE_TEXT = {"no space left on device": errno.ENOSPC, "storagefull": errno.ENOSPC, "os error 28": errno.ENOSPC,
                      "code: 28": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT, "code: 122": errno.EDQUOT,
                      "input/output error": errno.EIO, "code: 5,": errno.EIO}


class WriteFailed(RuntimeError):
    """A write to the results failed on some rank: every rank stops with this one line. `alone`: raised by the rank
    whose write failed, without the others' agreement (a process without peers, or a write outside the points they
    meet): that rank says the line, not rank 0."""

    def __init__(self, message: str, alone: bool = False):
        super().__init__(message)
        self.alone = alone


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1024 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"


def existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file()) if Path(path).exists() else 0


@dataclass
class Estimate:
    checkpoint: int        # bytes of one checkpoint
    kept: int              # checkpoints on disk at once
    final: int             # the final model
    merged: int            # the merged copy (0 without one)
    reusable: int          # bytes of checkpoints already there (a resumed run rotates them out)

    @property
    def total(self) -> int:
        return self.checkpoint * self.kept + self.final + self.merged

    def breakdown(self) -> str:
        merged = f" + merged copy {format_bytes(self.merged)}" if self.merged else ""
        return (f"checkpoint {format_bytes(self.checkpoint)} × {self.kept} kept + final model "
                f"{format_bytes(self.final)}{merged}")


def planned_checkpoints(args, total_steps: int) -> int:
    """How many checkpoints the schedule saves (transformers' TrainingArguments), the stop's own one included."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        return 0
    if strategy == "epoch":
        return max(1, int(args.num_train_epochs))
    return max(1, total_steps // max(1, int(args.save_steps)) + (total_steps % max(1, int(args.save_steps)) > 0))


def estimate_writes(model, args, total_steps: int, merge: bool, output_dir: Path) -> Estimate:
    """What the run will write, from the model the trainer holds (PEFT adapters already applied; under ZeRO-3 its
    weights counted whole, not this rank's share)."""
    parameters = list(model.parameters())
    whole = sum(whole_numel(p) * p.element_size() for p in parameters)
    trainable = [p for p in parameters if p.requires_grad]
    trainable_weights = sum(whole_numel(p) * p.element_size() for p in trainable)
    adapter = hasattr(model, "peft_config")
    saved = trainable_weights if adapter else whole
    optimizer = 2 * 4 * sum(whole_numel(p) for p in trainable)  # AdamW: exp_avg and exp_avg_sq, fp32
    # Besides: config, tokenizer and scheduler (~64 KB), one RNG state per rank (~15 KB), and trainer_state.json,
    # which holds every logged record so far (~700 bytes each; measured ~630 on the tiny test model, DPO metrics).
    logs = total_steps // max(1, int(args.logging_steps or 1))
    checkpoint = saved + optimizer + 64 * 1024 + 16 * 1024 * args.world_size + 700 * logs
    planned = planned_checkpoints(args, total_steps)
    limit = args.save_total_limit
    kept = min(planned, limit + 1) if limit else planned
    output_dir = Path(output_dir)
    reusable = sum(directory_bytes(path) for path in output_dir.glob("checkpoint-*")) if output_dir.exists() else 0
    return Estimate(checkpoint, kept, saved, whole if merge and adapter else 0, reusable)


def check_space(estimate: Estimate, output_dir: Path, save_total_limit: int | None) -> tuple[str | None, str | None]:
    """(error, warning) for the estimate against the free space where the checkpoints go."""
    available = free_bytes(output_dir) + estimate.reusable
    what = (f"this run will write about {format_bytes(estimate.total)} to {output_dir} ({estimate.breakdown()}) "
            f"and its filesystem has {format_bytes(available)} free")
    limit = ("--save_total_limit 1" if save_total_limit != 1 else "--save_strategy no or fewer saves") \
        if estimate.kept > 1 else "a smaller model or LoRA"
    if estimate.total > available:
        return (f"--results_dir: {what}: keep fewer checkpoints ({limit}), or put --results_dir (or --output_dir) "
                "on a larger filesystem", None)
    if estimate.total > WARN_FRACTION * available:
        return None, f"{what}: little room is left for logs and reports; consider {limit}"
    return None, None


def is_write_failure(error: BaseException) -> int | None:
    """The errno of a failed write (ENOSPC, EDQUOT, EIO) behind `error` or what it was raised from, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FAILED_WRITES:
            return error.errno
        text = str(error).lower()
        for needle, number in _FAILED_WRITE_TEXT.items():
            if needle in text:
                return number
        error = error.__cause__ or error.__context__
    return None


_TORCH_WRITER = ("inline_container.cc", "pytorchstreamwriter failed")  # torch.save's zip writer: no errno kept
NEARLY_FULL = 1024 * 1024


def write_failure_errno(error: BaseException, directory: Path) -> int | None:
    """is_write_failure, and torch.save's zip-writer error ("unexpected pos 64 vs 0") on a filesystem that is full
    (under NEARLY_FULL free): torch drops the errno, the free space tells."""
    number = is_write_failure(error)
    if number is None and any(needle in str(error).lower() for needle in _TORCH_WRITER):
        try:
            number = errno.ENOSPC if free_bytes(Path(directory)) < NEARLY_FULL else None
        except OSError:
            number = None
    return number


def write_failed_message(number: int, directory: Path, output_dir: Path, free: int | None = None) -> str:
    """The one line: what failed, where, the free space there (`free` as it was then; now when not given), and the
    newest complete checkpoint a relaunch resumes from."""
    newest = newest_complete_checkpoint(output_dir)
    resume = (f"a relaunch of the same command resumes from {newest} (step {checkpoint_step(newest)})" if newest
              else "no complete checkpoint was saved yet, so a relaunch starts afresh")
    advice = ("free space, lower --save_total_limit or move --results_dir, then relaunch"
              if number != errno.EIO else "check the storage, then relaunch")
    free = free_bytes(directory) if free is None else free
    return (f"writing to {directory} failed: {_FAILED_WRITES[number]} ({format_bytes(free)} free "
            f"there); {resume}: {advice}")


@dataclass
class Failure:
    """A failed write this rank noticed: what failed, where, the free space there at that moment, and where the
    stage's checkpoints go (what a relaunch resumes from)."""

    number: int
    directory: Path
    free: int
    output_dir: Path

    def message(self) -> str:
        return write_failed_message(self.number, self.directory, self.output_dir, self.free)


_noticed: list[Failure] = []  # this rank's first failed write, until every rank agrees to stop on it
_output_dirs: list[Path] = []  # where the checkpoints of the stage being run go (write_failures_reported)


def note_write_failure(error: BaseException, directory: Path) -> None:
    """Remember a failed write instead of raising it on this rank alone, so this rank still reaches the next point
    every rank meets (the per-step stop check, a checkpoint's agreement, a barrier: src/distributed.py), where all
    stop together with WriteFailed. The launcher's exit status is recorded at once, so even a peer that dies anyway
    cannot make torchrun restart the job (src/run_safety/launcher_exit.py). Anything else is raised."""
    if isinstance(error, WriteFailed):
        raise error
    filename = getattr(error, "filename", None)
    directory = Path(filename).parent if filename else Path(directory)
    number = write_failure_errno(error, directory)
    if number is None:
        raise error
    if not _noticed:
        try:
            free = free_bytes(directory)
        except OSError:
            free = 0
        _noticed.append(Failure(number, directory, free, _output_dirs[-1] if _output_dirs else directory))
        launcher_exit.record(ExitStatus.WRITE_FAILED)


def noticed_write_failure() -> Failure | None:
    return _noticed[0] if _noticed else None


@contextmanager
def write_failures_noted(directory: Path):
    """A block of writes on some ranks only (rank 0's files): a failed write inside ends the block and is noted
    (note_write_failure) for the next point every rank meets, instead of raising on this rank alone."""
    try:
        yield
    except Exception as error:
        note_write_failure(error, directory)


def stop_message(failures: list[Failure | None]) -> str:
    """The one line for every rank's noticed failures (in rank order): the first rank's that failed."""
    return next(failure for failure in failures if failure).message()


@contextmanager
def write_failures_reported(output_dir: Path):
    """A failed write anywhere inside becomes WriteFailed's one line (the original stays its cause, for --debug).
    `output_dir`: where the stage's checkpoints go, named in the line as what a relaunch resumes from."""
    _output_dirs.append(Path(output_dir))
    try:
        yield
    except WriteFailed:
        raise
    except Exception as error:
        filename = getattr(error, "filename", None)
        directory = Path(filename).parent if filename else Path(output_dir)
        number = write_failure_errno(error, directory)
        if number is None:
            raise
        raise WriteFailed(write_failed_message(number, directory, output_dir), alone=True) from error
    finally:
        _output_dirs.pop()


# The test seam fail_write (src/seams.py; tests/test_disk_space.py): "<glob>[@<rank>][#<n>]" makes the n-th write (the
# first by default) of this process to a file whose name matches <glob>, on that rank (any by default), fail as a full
# disk does (ENOSPC), at each write site the one-line stop covers. Not planted (always, outside tests), it costs one
# lookup.
_injected: dict[str, int] = {}


def fail_write_if_injected(path: Path) -> None:
    wanted = seams.get("fail_write")
    if not wanted:
        return
    pattern, _, occurrence = wanted.partition("#")
    pattern, _, rank = pattern.partition("@")
    if rank and rank != os.environ.get("RANK", "0") or not fnmatch.fnmatch(Path(path).name, pattern):
        return
    _injected[pattern] = _injected.get(pattern, 0) + 1
    if _injected[pattern] == int(occurrence or 1):
        raise OSError(errno.ENOSPC, "No space left on device (the fail_write test seam)", str(path))
