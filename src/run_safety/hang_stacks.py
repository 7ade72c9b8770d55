"""Every process's Python stack, for the hang watch (src/run_safety/hang_watch.py): written and read back.

Written by faulthandler, from C, into the process's stack file on the board (src/run_safety/hang_board.py): on
DUMP_SIGNAL (`kill -USR2 <pid>` at any time), which also reaches a process frozen in a C call that holds the
interpreter's lock, so its peers on the same machine ask such a process (and a preparing rank's pool workers, each into
a file of its own) for its stack. Read back as the main thread's frames, which say whether a rank waits in a collective
(a victim of the stuck rank, not its cause) and where in the toolkit it stands.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time
from pathlib import Path

DUMP_SIGNAL = signal.SIGUSR2  # `kill -USR2 <pid>` dumps a worker's stack into the board at any time


def open_stack_file(board: Path, rank: int):
    """This process's stack file on the board, faulthandler registered to write this process's stack into it on
    DUMP_SIGNAL. Kept open: faulthandler writes to it from C, any time."""
    handle = open(board / f"rank{rank}.stack", "w")  # noqa: SIM115  faulthandler writes to it from C, any time
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    return handle


def dump_worker_stacks_apart(board: Path, rank: int) -> None:
    """A preparation pool worker forked from a watched rank: its stack, on request, into a file of its own (the
    inherited handler would write into its parent's)."""
    try:
        handle = open(board / f"rank{rank}-worker-{os.getpid()}.stack", "w")  # noqa: SIM115
        faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    except OSError:
        pass


def stack_size(board: Path, rank: int) -> int:
    try:
        return (board / f"rank{rank}.stack").stat().st_size
    except OSError:
        return 0


def ask_for_stacks(board: Path, records: dict[int, dict], sizes: dict[int, int]) -> None:
    """The processes of this machine that did not dump their own stack when asked (`sizes`: their stack files' sizes
    before; frozen with the interpreter's lock held: faulthandler's signal handler, in C, still can), and a preparing
    rank's pool workers."""
    host = socket.gethostname()
    for rank, record in records.items():
        if record.get("host") != host:
            continue
        pids = [record["pid"]] if stack_size(board, rank) == sizes.get(rank) else []
        pids += children(record["pid"]) if record.get("place") == "data" else []
        for pid in pids:
            try:
                os.kill(pid, DUMP_SIGNAL)
            except OSError:
                pass


def read_stacks(board: Path, ranks: list[int], sizes: dict[int, int], wait_s: float) -> dict[int, list[str]]:
    """Each rank's main-thread frames from the dump it wrote since `sizes` were taken, waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        written = [rank for rank in ranks if stack_size(board, rank) > sizes.get(rank, 0)]
        if len(written) == len(ranks) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.2)  # a dump in progress finishes
    stacks = {}
    for rank in written:
        try:
            stacks[rank] = main_thread_frames((board / f"rank{rank}.stack").read_text(errors="replace"))
        except OSError:
            continue
    return stacks


def children(pid: int) -> list[int]:
    """The processes `pid` started (a preparation pool's workers), from /proc; none where it is not readable."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def main_thread_frames(dump: str) -> list[str]:
    """The main thread's frames (innermost first) in a faulthandler dump (the last one, where a file holds several):
    faulthandler lists the newest thread first, so the main thread (the only one not started through threading's
    `_bootstrap`) comes last."""
    blocks, current = [], None
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
            current = []
            blocks.append(current)
        elif current is not None and line.strip().startswith("File "):
            current.append(line.strip())
    main = [block for block in blocks if block and "in _bootstrap" not in block[-1]]
    return main[-1] if main else []


def in_collective(frames: list[str]) -> bool:
    """Waiting for the other ranks: the innermost frames are torch.distributed's, or the innermost is the toolkit's
    collective helpers (src/distributed.py: with NCCL a collective returns at once and the wait is at the read of its
    result, there)."""
    return any("torch/distributed/" in frame for frame in frames[:4]) or bool(frames) and "/src/distributed.py" in \
        frames[0]


def innermost_toolkit_frame(frames: list[str]) -> str | None:
    """Where in the toolkit (or the user's code it called) the stack stands: the innermost frame outside the standard
    library, torch and src/run_safety/hang_watch.py (the beats and the test seams a rank's main thread calls)."""
    for frame in frames:
        if "/src/run_safety/hang_watch.py" in frame or "/python3." in frame and "site-packages" not in frame:
            continue
        return frame.replace("File ", "", 1)
    return frames[0].replace("File ", "", 1) if frames else None
