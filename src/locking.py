"""Build-once directories shared by processes that have no process group yet.

Work done before training (building the embedded model, tokenizing the dataset) must happen once per machine, with
the other processes waiting for it. A collective barrier would put them on NCCL's 30-minute timeout; a file lock has
no timeout, and a crash of the builder releases it (the kernel drops flock locks of dead processes), so the next
process takes over instead of hanging.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

COMPLETE_MARKER = ".complete"


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).exists()


def build_once(directory: Path, build: Callable[[Path], None]) -> Path:
    """Return `directory`, calling `build(temporary_dir)` first if no process has completed it yet.

    The build writes into a temporary sibling that is renamed into place only when complete, so a reader never sees
    a half-built directory and a killed builder leaves nothing that looks finished.
    """
    directory = Path(directory)
    if is_complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock_path = directory.parent / f".{directory.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits, without a timeout, for the process building it
        try:
            if is_complete(directory):
                return directory
            temporary = directory.parent / f".{directory.name}.building-{os.getpid()}"
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir()
            build(temporary)
            (temporary / COMPLETE_MARKER).write_text("")
            if directory.exists():  # an incomplete leftover of a crashed build
                shutil.rmtree(directory)
            os.replace(temporary, directory)
            return directory
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
