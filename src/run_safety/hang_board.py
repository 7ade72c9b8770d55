"""The hang watch's board: where a launch's processes meet (src/run_safety/hang_watch.py).

A folder next to the run directory (`<results_dir>/.<run>.hang/<launch>/`: on the storage a multi-node job shares; the
run directory itself is deleted by --overwrite), one per launch. On it: each process's record `rank<N>.json` (what it
does and how many beats it made: a fixed-size JSON file mapped in memory, so a beat is a memory copy and a peer on the
same machine reads it through the page cache even once the process froze), its stack file
(src/run_safety/hang_stacks.py), the `dump` request and `verdict.json`, each written once, by the first process to
decide. A record's `mode` says how its silence is judged. The boards earlier launches left are cleared by the next
launch's rank 0; a launch whose processes all left removes its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path

WAITING, UNWATCHED, DONE = "waiting", "unwatched", "done"  # an activity's mode ("": judged as any work)
RECORD_BYTES = 1024   # a rank's record on the board: JSON, padded with spaces


def board_for(run_dir: Path, environ=None) -> Path:
    """This launch's board: next to the run directory (which --overwrite deletes), one folder per launch."""
    environ = os.environ if environ is None else environ
    run_dir = Path(run_dir)
    launch = "|".join(environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                                          "TORCHELASTIC_RESTART_COUNT"))
    if not environ.get("MASTER_PORT"):
        launch = f"pid-{os.getpid()}"  # one process: its own launch
    return run_dir.parent / f".{run_dir.name}.hang" / hashlib.sha1(launch.encode()).hexdigest()[:12]


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


class RecordFile:
    """This process's record on the board, `rank<N>.json`: RECORD_BYTES mapped in memory."""

    def __init__(self, board: Path, rank: int):
        path = board / f"rank{rank}.json"
        path.write_bytes(b" " * RECORD_BYTES)
        with open(path, "r+b") as handle:
            self.memory = mmap.mmap(handle.fileno(), RECORD_BYTES)

    def write(self, record: dict) -> dict:
        """The record into the file's memory: a memory copy, no system call, so a beat costs microseconds. A very long
        `what` is shortened to fit."""
        encoded = json.dumps(record).encode()
        if len(encoded) > RECORD_BYTES:
            record["what"] = record["what"][:max(0, len(record["what"]) - (len(encoded) - RECORD_BYTES) - 8)] + "..."
            encoded = json.dumps(record).encode()
        self.memory[:] = encoded.ljust(RECORD_BYTES)
        return record

    def flush(self) -> None:
        """The memory written back to the file (other machines read it from the shared storage)."""
        self.memory.flush()


def remove_if_all_done(board: Path) -> None:
    """Once every record on the board is done, the board goes (otherwise the next launch's rank 0 removes it). Every
    record it holds, not every rank's: on a node whose storage the others cannot see (a job refused for it:
    src/distributed.py check_shared_storage), the board holds that node's ranks alone, and goes with the last of
    them."""
    try:
        records = [read_json(path) for path in board.glob("rank*.json")]
    except OSError:  # another rank, done at the same moment, has removed the board already
        return
    if records and all(record and record.get("mode") == DONE for record in records):
        shutil.rmtree(board, ignore_errors=True)
        with contextlib.suppress(OSError):
            board.parent.rmdir()  # the run's board folder, when no other launch's is left in it


def clear_earlier_boards(run_dir: Path) -> None:
    """Rank 0 of a job that holds the run directory: the boards earlier launches left (a killed job cannot remove its
    own) go, also when this launch trains nothing (a finished run relaunched). This launch's own board stays: another
    rank may have put its record there already."""
    own = board_for(run_dir)
    if not own.parent.is_dir():
        return
    for old in own.parent.iterdir():
        if old != own and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        own.parent.rmdir()  # when nothing is left in it
