"""A checkpoint made loadable on this launch's number of processes, where its engine needs it.

- DDP saves whole states, and FSDP2 its sharded ones through torch.distributed.checkpoint, which reshards them as it
  loads (each rank reads the pieces of its new shard; a FULL_STATE_DICT checkpoint is read by rank 0 and sent):
  nothing to do.
- DeepSpeed ZeRO-1/2/3 saves one file of optimizer states (ZeRO-3: and weights) per rank, each a flat partition for
  the world that saved it, and refuses another world size (`ZeRORuntimeException: The checkpoint being loaded used a
  DP world size of 2 but the current world size is 1`). Its own answer is the universal checkpoint: every parameter's
  fp32 weights and Adam moments on their own (`deepspeed.checkpoint.ds_to_universal`), which an engine configured
  with `"checkpoint": {"load_universal": true}` loads at any world size. `for_resume` runs DeepSpeed's converter once
  per checkpoint, as a command of its own started by rank 0 (a fresh process: no CUDA context, no process group; its
  pool reads one saved rank's file per worker, so no process holds the whole state: its peak is about one rank's
  file, and `workers` of them at once), writes the result inside the checkpoint (`global_step<N>_universal/`, its
  `latest_universal` file, the converter's log), extends the checkpoint's manifest to cover them, and sets the flag.
  A later resume of the same checkpoint on any number of processes reuses it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from src.config_error import ConfigError
from src.distributed import barrier, gather_objects, manifest_across_ranks
from src.engines import DEEPSPEED
from src.resource_limits import memory_limit_bytes, usable_cores
from src.run_safety import hang_watch
from src.run_safety.checkpoint_manifest import read_manifest, write_marker
from src.run_safety.disk_space import WriteFailed, format_bytes
from src.world import World

LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name: the tag a load_universal engine reads
LOG = "ds_to_universal.log"
PARTIAL = ".universal-partial"  # where the converter writes, renamed into place once it succeeded
UNIVERSAL_ROOM = 2.2  # the converter's temporary fragments and its output: about twice the optimizer files


def needs_universal(saved: dict, world_size: int) -> bool:
    """Whether a DeepSpeed checkpoint saved by `saved` (checkpoint_split.saved_split) needs its universal form here."""
    return saved.get("engine") == DEEPSPEED and saved.get("world_size") != world_size


def _tag(checkpoint: Path) -> str:
    """The DeepSpeed tag the checkpoint's `latest` file names (global_step<N>)."""
    return (checkpoint / "latest").read_text().strip()


def universal_ready(checkpoint: Path) -> bool:
    """A universal checkpoint converted earlier and recorded in the checkpoint's manifest (a conversion cut short
    never is: its files are recorded last)."""
    latest = checkpoint / LATEST_UNIVERSAL
    if not latest.is_file() or not (checkpoint / latest.read_text().strip()).is_dir():
        return False
    try:
        record = read_manifest(checkpoint)
    except (OSError, ValueError):
        return False
    return record is None or LATEST_UNIVERSAL in record["files"]


def for_resume(trainer, checkpoint: Path, saved: dict, world: World) -> dict | None:
    """Every rank, before training resumes from `checkpoint`: DeepSpeed's universal checkpoint made where the engine
    needs it (converted by rank 0, the others waiting), and the trainer's engine set to load it. Returns what the
    conversion did (rank 0: seconds, bytes, workers) or None where nothing was needed or it was there already."""
    checkpoint = Path(checkpoint)
    if not needs_universal(saved, world.world_size):
        return None
    done = None
    if not universal_ready(checkpoint):
        outcome = None
        if world.is_main:
            try:
                outcome = _convert(checkpoint, saved)
            except Exception as error:  # noqa: BLE001  raised below by every rank, not by rank 0 alone
                outcome = error
        # said by every rank together: a conversion that failed (exit 2), found no room (a write, exit 5) or crashed
        problem = gather_objects([outcome if isinstance(outcome, Exception) else None])[0][0]
        if problem is not None:
            raise problem
        _record_in_manifest(checkpoint, world)
        done = outcome
    plugin = trainer.accelerator.state.deepspeed_plugin
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return done


def _convert(checkpoint: Path, saved: dict) -> dict | Exception:
    """Rank 0: DeepSpeed's converter run on the checkpoint; what it did, or the stop saying why it could not."""
    tag, resume_there = _tag(checkpoint), f"resume it on {saved['world_size']} processes (the split that saved it)"
    optimizer_files = sorted((checkpoint / tag).glob("*optim_states.pt"))
    needed = int(UNIVERSAL_ROOM * sum(path.stat().st_size for path in optimizer_files))
    free = shutil.disk_usage(checkpoint).free
    if free < needed:
        return WriteFailed(f"converting {checkpoint} for another number of processes needs about "
                           f"{format_bytes(needed)} free beside it (DeepSpeed's universal checkpoint) and there is "
                           f"{format_bytes(free)}: free space and relaunch, or {resume_there}")
    for leftover in (checkpoint / PARTIAL, checkpoint / f"{tag}_universal", checkpoint / LATEST_UNIVERSAL):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    workers = _workers(optimizer_files)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint / tag),
               "--output_folder", str(checkpoint / PARTIAL / f"{tag}_universal"), "--num_extract_workers",
               str(workers), "--num_merge_workers", str(workers), "--inject_missing_state"]
    started = time.monotonic()
    with hang_watch.phase("checkpoint", f"converting {checkpoint.name} to DeepSpeed's universal checkpoint"), \
            open(checkpoint / LOG, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while process.poll() is None:  # a long conversion is progress, not a hang
            hang_watch.beat()
            time.sleep(0.5)
    if process.returncode != 0:
        shutil.rmtree(checkpoint / PARTIAL, ignore_errors=True)
        last = [line for line in (checkpoint / LOG).read_text(errors="replace").splitlines() if line.strip()]
        return ConfigError(f"{checkpoint} could not be converted for another number of processes by DeepSpeed's "
                           f"ds_to_universal (exit {process.returncode}: {last[-1] if last else 'no output'}; its log: "
                           f"{checkpoint / LOG}): {resume_there}, or start afresh with --overwrite")
    _slim_common_state(checkpoint / PARTIAL / f"{tag}_universal")
    os.replace(checkpoint / PARTIAL / f"{tag}_universal", checkpoint / f"{tag}_universal")
    os.replace(checkpoint / PARTIAL / LATEST_UNIVERSAL, checkpoint / LATEST_UNIVERSAL)  # the tag, last
    shutil.rmtree(checkpoint / PARTIAL, ignore_errors=True)
    written = sum(path.stat().st_size for path in (checkpoint / f"{tag}_universal").rglob("*") if path.is_file())
    return {"seconds": round(time.monotonic() - started, 2), "bytes": written, "workers": workers,
            "from_world_size": saved["world_size"], "universal": f"{tag}_universal"}


def _slim_common_state(universal: Path) -> None:
    """Under ZeRO-3 the converter keeps rank 0's whole optimizer file as the universal checkpoint's common state
    (`zero/optimizer_state.pt`: ds_to_universal's `_save_optimizer_state_stage3`), which every rank of the resumed job
    loads whole, though DeepSpeed's loader reads only its step, parameter groups and loss scale from it (stage3.py
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`; each parameter's weights and moments come from its own
    files). Rank 0's partition of the weights and moments (1/N of the whole state) is left out of it: measured on a
    151M-parameter model saved by 2 processes, 906 MB less written and loaded by each rank. Memory-mapped: the
    partition is never read."""
    import torch  # the trainer's process: torch is loaded

    path = universal / "zero" / "optimizer_state.pt"
    common = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if common.get("zero_stage") != 3:  # ZeRO-1/2: the converter keeps only the common part already
        return
    inner = common["optimizer_state_dict"]
    inner["state"] = {index: {"step": state["step"]} for index, state in inner["state"].items() if "step" in state}
    common.pop("fp32_flat_groups", None)
    slim = path.with_name(f".{path.name}.slim")
    torch.save(common, slim)
    del common, inner
    os.replace(slim, path)


def _workers(optimizer_files: list[Path]) -> int:
    """The converter's workers: one saved rank's file each, as many as the cores and the memory allow (each holds
    one file, about twice its size at its peak)."""
    largest = max((path.stat().st_size for path in optimizer_files), default=1)
    available = memory_limit_bytes() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(1, min(usable_cores(), len(optimizer_files), available // (2 * largest)))


def _record_in_manifest(checkpoint: Path, world: World) -> None:
    """Every rank: the converter's files hashed (each rank its share) into the checkpoint's manifest, so a resume
    verifies them as it verifies what the save wrote; recorded last, so a conversion cut short is redone."""
    record = read_manifest(checkpoint)
    if record is not None:
        saved = {name.split("/", 1)[0] for name in record["files"]}
        added, problem = manifest_across_ranks(checkpoint, world, leave_out=tuple(saved))
        if problem:
            raise WriteFailed(f"reading back {checkpoint}'s universal checkpoint to record its checksums failed "
                              f"({problem}): check the storage, then relaunch the same command")
        if world.is_main:  # in name order, as the manifest lists its files (a verify reads its blocks so)
            files = record["files"] | added["files"]
            write_marker(checkpoint, record | {"files": {name: files[name] for name in sorted(files)}})
    barrier()


def loads_universal(trainer) -> bool:
    """Whether the trainer's DeepSpeed engine is set to load a universal checkpoint (`for_resume`)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(plugin and plugin.deepspeed_config.get("checkpoint", {}).get("load_universal"))


def own_step_counters(optimizer) -> int:
    """After DeepSpeed 0.19.8 loaded a universal checkpoint into ZeRO-3 (stage3.py
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`), every parameter group's state holds the same `step`
    tensor, and torch's AdamW adds 1 to it in place once per group: with two groups (weights with and without
    decay) the second took its first step after the resume with the count of the step after it, and the losses
    drifted from the run never interrupted (measured: the logged loss 1.3e-4 off, relative, two steps after
    a 2 -> 1 resume). Each group's state gets its own copy; returns how many were shared."""
    while hasattr(optimizer, "optimizer"):  # accelerate's and DeepSpeed's wrappers around the torch optimizer
        optimizer = optimizer.optimizer
    seen, shared = set(), 0
    for state in optimizer.state.values():
        step = state.get("step")
        if step is None or not hasattr(step, "clone"):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
            shared += 1
        seen.add(id(step))
    return shared
