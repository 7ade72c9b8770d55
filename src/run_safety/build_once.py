"""Build-once directories shared by processes that have no process group yet (and the `.complete` marker that
checkpoints use too).

Work done before training (building the embedded model, tokenizing the dataset) must happen once per machine, with
the other processes waiting for it. A collective barrier would put them on NCCL's 30-minute timeout; a file lock
(the `filelock` package the Hugging Face libraries use for their caches) has no timeout, and a crash of the builder
releases it (the kernel drops the locks of dead processes), so the next process takes over instead of hanging.

A builder writes into `.<name>.building-<pid>` and renames it into place when complete, so a reader never sees a
half-built directory. Whoever holds the lock next removes what killed builders left behind: while it is held, no
other `.building-*` sibling can belong to a live build.

The toolkit's own build-once directories (the embedded model and data, prepared datasets, preflight records) live
under `cache_root()`: $PREFKIT_CACHE, else ~/.cache/prefkit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from src.run_safety import hang_watch

COMPLETE_MARKER = ".complete"


def cache_root() -> Path:
    """Where the toolkit keeps what it builds once per machine: $PREFKIT_CACHE, else ~/.cache/prefkit."""
    return Path(os.environ.get("PREFKIT_CACHE", Path.home() / ".cache" / "prefkit"))


def is_complete(directory: Path) -> bool:
    """A build-once directory or a checkpoint (src/run_safety/checkpoints.py) that was finished."""
    return (Path(directory) / COMPLETE_MARKER).exists()


def remove_leftovers(directory: Path) -> list[Path]:
    """The half-built siblings of `directory` that killed builders left (call with the lock held)."""
    leftovers = sorted(directory.parent.glob(f".{directory.name}.building-*"))
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def build_once(directory: Path, build: Callable[[Path], None]) -> Path:
    """Return `directory`, calling `build(temporary_dir)` first if no process has completed it yet."""
    directory = Path(directory)
    if is_complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory.parent / f".{directory.name}.lock")
    with hang_watch.phase("data", f"waiting for another process building {directory.name}", hang_watch.WAITING):
        lock.acquire()  # waits, without a timeout, for the builder
    try:
        remove_leftovers(directory)
        if is_complete(directory):
            return directory
        temporary = directory.parent / f".{directory.name}.building-{os.getpid()}"
        temporary.mkdir()
        build(temporary)
        (temporary / COMPLETE_MARKER).write_text("")
        if directory.exists():  # an incomplete leftover of a crashed build
            shutil.rmtree(directory)
        os.replace(temporary, directory)
        return directory
    finally:
        lock.release()
