"""A lost node: with several nodes, every process beats into torchrun's rendezvous store and watches the others'
beats, so the survivors of a dead node stop in `--node_timeout` seconds with one line instead of waiting on a
collective until the process-group timeout (60 minutes) or, after torchrun restarts them, on a rendezvous the dead
node never joins.

- Each process increments `prefkit/alive/<rank>` every BEAT_S seconds on its own connection to the store
  torchrun's agent on node 0 keeps (MASTER_ADDR:MASTER_PORT); the counters need no synchronised clocks.
- A rank whose counter has not moved for the timeout (by this process's own monotonic clock) has stopped answering:
  its node is named. A store that does not answer for the timeout means node 0 (which holds it) is gone.
- Once a node is found lost, the first process of each surviving node to see it prints the line and ends its torchrun
  agent (a static multi-node job cannot re-form without the lost node, so a restart would only wait again); every
  process exits with ExitStatus.NODE_LOST (6); the newest complete checkpoint stays for the relaunch.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta

from src.run_safety import launcher_exit
from src.world import World
from src.run_safety.exit_status import ExitStatus

BEAT_S = 5.0


def watch(world: World, timeout_s: float, newest_checkpoint, without_lost_node: str | None = None
          ) -> threading.Thread | None:
    """Start the watch for a multi-node torchrun job (a daemon thread); `newest_checkpoint()` names what a relaunch
    resumes from, `without_lost_node` how the nodes that remain go on without the lost one (the command). Returns None
    where there is nothing to watch."""
    if world.num_nodes < 2 or timeout_s <= 0 or "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's store only
        return None
    thread = threading.Thread(target=_watch, args=(world, timeout_s, newest_checkpoint, without_lost_node),
                              name="node-watch", daemon=True)
    thread.start()
    atexit.register(_done, world, thread)
    return thread


_finished = threading.Event()


def _done(world: World, thread: threading.Thread) -> None:
    """A process that exits by itself (finished, or an error torchrun handles) is not lost: the others stop watching
    it, so a node still doing rank 0's final work is not stopped because the others have finished. The watch thread
    ends first, with its store connection: a daemon thread still inside a TCPStore call when the interpreter tears
    down aborts the process ("terminate called without an active exception", exit -6), which torchrun restarts."""
    _finished.set()
    thread.join(timeout=BEAT_S * 3)
    try:
        store = _connect()
        store.set(f"prefkit/done/{world.rank}", "1")
        del store
    except Exception:
        pass


def _connect():
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=BEAT_S * 2))


def _watch(world: World, timeout_s: float, newest_checkpoint, without_lost_node: str | None) -> None:
    # One counter per rank for the whole job, restarts included: the agent's store outlives restarts, so a rank of a
    # lost node stays silent while the restarted survivors' counters move on. A rank that never beat (a node started
    # late, or still preparing its data) is not judged: the process group's own timeout covers a node never started.
    key = lambda rank: f"prefkit/alive/{rank}"  # noqa: E731
    store = None
    seen: dict[int, tuple[int, float]] = {}       # rank -> (counter, when it last moved by this process's clock)
    store_answered = time.monotonic()
    try:
        _connect().delete_key(f"prefkit/done/{world.rank}")  # a restarted rank is watched again
    except Exception:
        pass
    while not _finished.is_set():
        now = time.monotonic()
        try:
            store = store or _connect()
            store.add(key(world.rank), 1)
            for rank in range(world.world_size):
                done = store.check([f"prefkit/done/{rank}"])
                value = -1 if done else int(store.get(key(rank))) if store.check([key(rank)]) else 0
                if rank not in seen or seen[rank][0] != value:
                    seen[rank] = (value, now)
            store_answered = now
        except Exception:  # the store's host (node 0) does not answer: a fresh connection next time
            store = None
        if now - store_answered > timeout_s:
            _stop(world, lost_node_line(0, "the rendezvous store it holds", now - store_answered,
                                        newest_checkpoint(), without_lost_node))
        silent = [rank for rank, (value, moved) in seen.items()
                  if value > 0 and now - moved > timeout_s and rank != world.rank]
        if silent:
            node = silent[0] // world.local_world_size
            _stop(world, lost_node_line(node, f"rank(s) {', '.join(map(str, silent))}", now - seen[silent[0]][1],
                                        newest_checkpoint(), without_lost_node))
        _finished.wait(BEAT_S)
    store = None  # the connection closes in this thread, before the interpreter's teardown


def lost_node_line(node: int, what: str, silent_s: float, newest, without_lost_node: str | None) -> str:
    """The one line a surviving node says: the lost node, what a relaunch resumes from, on every node or (the
    global batch kept) on the nodes that remain."""
    if newest is None:
        resume = "no complete checkpoint was saved yet"
    else:
        resume = f"a relaunch of the same command on every node resumes from {newest}"
        if without_lost_node:
            resume += f"; or go on without node {node} from there, with the same numbers: {without_lost_node}"
    return (f"error: node {node} stopped answering ({what}: nothing for {silent_s:.0f} s, --node_timeout); "
            f"stopping this node; {resume}")


def _stop(world: World, line: str) -> None:
    if launcher_exit.says_why(world.local_rank):
        print(line, file=sys.stderr, flush=True)
    launcher_exit.end_job(ExitStatus.NODE_LOST)  # its torchrun agent too: a restart would wait
