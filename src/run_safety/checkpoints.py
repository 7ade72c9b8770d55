"""Complete checkpoints only, and resume where a run stopped. (The trainer side of it, CompleteCheckpointsMixin,
lives in src/trainers/checkpointing.py; this module stays light so errors are reported fast.)

- A checkpoint counts once every rank has written its part and rank 0 has added a `.complete` marker; older ones
  are rotated out only after that, so a crash at any moment leaves the previous checkpoint whole.
- The marker holds the checkpoint's manifest: every file's size and checksums (src/run_safety/checkpoint_manifest.py).
- On start, a run whose training_info.json says it did not finish resumes from its newest intact checkpoint (same
  data order, optimizer, scheduler and step: transformers' own resume), and its metric history is cut back to that
  step so the curve continues instead of restarting. Intact: complete, and its files as the manifest says; newer
  complete ones that are not are set aside (`damaged-checkpoint-N`) with one line each; with none intact, nothing is
  touched and the run stops in one line (`Damaged`, ExitStatus.DAMAGED).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

from src import seams
from src.run_safety.build_once import is_complete
from src.run_safety.checkpoint_manifest import Damaged, read_manifest, verify, write_marker

# The test seam kill_at_checkpoint (src/seams.py): "<moment>:<step>:<rank>:<flag file>" SIGKILLs that rank once (the
# flag file says it happened) at that moment of checkpoint-<step>'s save: "before_complete" (its pieces written, its
# marker not yet: a save cut in half) or "after_complete" (every rank past the save). Rank "*" is every rank, each with
# its own flag file (<flag file>.rank<r>): at "after_complete", the whole job SIGKILLed at once, as a node's power or a
# `kill -9` of every worker. Several, separated by commas, kill one launch at each in turn (torchrun restarts it). A
# kill at a known moment, not a race with a polling test (tests/test_resilience.py, test_grpo.py).


def kill_if_injected(moment: str, step: int, rank: int) -> None:
    for wanted in filter(None, seams.get("kill_at_checkpoint", "").split(",")):
        at_moment, at_step, at_rank, flag = wanted.split(":", 3)
        if at_rank == "*":
            at_rank, flag = str(rank), f"{flag}.rank{rank}"
        if (at_moment, int(at_step), int(at_rank)) == (moment, step, rank) and not os.path.exists(flag):
            Path(flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)

PREFIX_CHECKPOINT_DIR = "checkpoint"  # transformers' name for checkpoint-<step> directories
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


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


def newest_complete_checkpoint(output_dir: Path) -> Path | None:
    complete = [path for path in checkpoints(output_dir) if is_complete(path)]
    return complete[-1] if complete else None


def remove_incomplete_checkpoints(output_dir: Path) -> list[Path]:
    """Delete checkpoints that a crash left half-written (rank 0, before resuming); returns what was removed."""
    removed = [path for path in checkpoints(output_dir) if not is_complete(path)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def mark_complete(checkpoint: Path, manifest: dict | None) -> None:
    write_marker(checkpoint, manifest)


DAMAGED_PREFIX = "damaged-"  # out of the checkpoint-N names: never resumed from, counted or rotated out by transformers


def newest_intact_checkpoint(output_dir: Path, threads: int) -> tuple[Path | None, list[str]]:
    """Rank 0, before a resume: the newest complete checkpoint whose files are as its manifest says (None when no
    checkpoint is complete), and the lines to print. Newer complete ones that are damaged are renamed
    `damaged-checkpoint-N` (kept to be looked at, and so every rank's newest complete checkpoint is the intact one).
    With complete checkpoints and none intact, nothing is touched: Damaged, naming each and what is wrong."""
    damaged = []
    for checkpoint in reversed([path for path in checkpoints(output_dir) if is_complete(path)]):
        problem = verify(checkpoint, threads)
        if problem is None:
            break
        damaged.append((checkpoint, problem))
    else:
        if damaged:
            raise Damaged(f"{output_dir} has no intact checkpoint to resume from: " + "; ".join(
                f"{path.name}: {problem}" for path, problem in damaged) + ". Nothing was changed: restore them from a "
                "copy and run the same command, or start afresh with --overwrite")
        return None, []
    lines = []
    for path, problem in damaged:
        aside = path.with_name(DAMAGED_PREFIX + path.name)
        shutil.rmtree(aside, ignore_errors=True)  # one set aside earlier at the same step
        os.replace(path, aside)
        lines.append(f"warning: {path} is damaged ({problem}): set aside as {aside.name}; resuming from "
                     f"{checkpoint.name}, the newest intact checkpoint")
    if read_manifest(checkpoint) is None:
        lines.append(f"note: {checkpoint.name} was saved before checkpoints recorded their checksums: resumed from "
                     "without verifying it")
    return checkpoint, lines


def trim_metrics(records: list[dict], last_step: int) -> list[dict]:
    """The history up to a checkpoint: what came after it is recomputed by the resumed run."""
    return [record for record in records if record.get("step", 0) <= last_step]
