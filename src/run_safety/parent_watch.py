"""No process outlives its job: a process the toolkit starts stops within seconds once the process that started it is
gone (a `kill -9` of the launcher or of its process group, an OOM kill of torchrun's agent), the way it stops on
SIGTERM.

Why it is needed: torchrun starts each worker in a session of its own (torch elastic's `start_new_session=True`), so a
kill of the launcher's process group never reaches the workers, and `datasets.map(num_proc=N)`'s pool workers (the
`multiprocess` package) outlive a killed parent: both were seen running for minutes, holding the run directory and
the devices.

How: a daemon thread compares `os.getppid()` with the parent the process had when it started, every POLL_S. (Not
PR_SET_PDEATHSIG: it fires when the parent *thread* that started the process ends, not the process; Linux only.)
- A training worker (`watch_launcher`): in training, where a clean stop is possible (src/run_safety/stops.py), it asks
  for one as SIGTERM does (every rank stops at the end of the step, a complete checkpoint is saved, the run is marked
  stopped) and is killed if that takes longer than GRACE_S (torchrun's own wait between SIGTERM and SIGKILL); anywhere
  else (loading, a round's sampling, the reference pass, the end steps) there is nothing half-done to save (every file
  is written whole or not at all, and the next launch redoes that work), so it exits at once.
- A helper (a preparation pool worker: `forked_children_exit_with_this_process`; check_gpu's bandwidth processes:
  `exit_with_parent`) exits at once.
The run directory's hold (run_lock.py) names the worker's pid and start time: once they are gone, the same command
relaunched takes the hold over.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path

from src import seams
from src.run_safety import stops

POLL_S = 0.5
GRACE_S = float(os.environ.get("PREFKIT_ORPHAN_GRACE_S", "30"))  # a clean stop's time (a checkpoint save)
LAUNCHER_GONE = "the loss of its launcher"  # the stop's name: "stopped by the loss of its launcher at step 12"

_watching: list[int] = []  # the pid that started a watch (a forked child inherits the list, not the thread)


def _start(on_orphaned, parent: int | None) -> None:
    if os.getpid() in _watching:
        return
    _watching.append(os.getpid())
    parent = os.getppid() if parent is None else parent
    if os.getppid() != parent:  # gone before the watch started
        on_orphaned()
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        on_orphaned()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _exit_now() -> None:
    """SIGKILL this process, and its process group when it leads one (check_gpu's bandwidth worker and its ranks)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_with_parent(parent: int | None = None) -> None:
    """This helper process exits at once when `parent` (default: its parent now) is gone. Idempotent per process."""
    if parent == os.getpid():  # the work runs in the starting process itself (no pool)
        return
    _start(_exit_now, parent)


def forked_children_exit_with_this_process() -> None:
    """Every process this one forks from now on (datasets.map's pool workers) exits at once when this one is gone,
    the idle ones too (they wait on a queue that this process's death never closes). Registered once per process."""
    if _fork_hook:
        return
    _fork_hook.append(os.getpid())
    os.register_at_fork(after_in_child=exit_with_parent)


_fork_hook: list[int] = []


def _launcher_gone() -> None:
    if stops.clean_stop_possible():
        stops.request_stop(LAUNCHER_GONE)
        time.sleep(GRACE_S)  # the clean stop normally ends the process well before this
    _exit_now()


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once the exit handlers have run, skipping the interpreter's teardown: after a clean stop
    whose launcher is gone, that teardown (the collection of every object the job built) kept the tiny test job
    alive 6-8 s longer on a loaded machine, and a real job would hold its devices that long. Every worker torchrun
    started ends this way (src/pipeline/exits.py process_exit). Files are written with `with` blocks (run_files), so no
    buffer is left unflushed; atexit handlers (logging, trackers, temporary directories) run first."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def watch_launcher() -> None:
    """A worker started by a launcher (torchrun's agent, run_distributed.sh's preflight): stop when it is gone."""
    _launcher.append(os.getppid())
    _start(_launcher_gone, None)


_launcher: list[int] = []


def launcher_gone() -> bool:
    """This worker's launcher is gone (whichever rank's watch noticed it first)."""
    return bool(_launcher) and os.getppid() != _launcher[0]


# The test seam kill_starter (src/seams.py): "<moment>:<flag file>" SIGKILLs, once (the flag file says it happened), the
# process that started this one at that moment: "preparation" (a preparation pool worker kills the preparing process),
# "step:<N>" (the end of optimizer step N), "sampling" (a round's first sampled batch), "reference" (the reference
# pass's first batch): rank 0 kills its launcher's whole process group (its torchrun agent's group), as a terminal's
# `kill -9` of the job does; in a job forked from a test (tests/forked.py), rank 0's own session (`_launch_group`). A
# kill at a known moment, not a race with a polling test (tests/test_resilience.py, test_rounds.py, test_data.py,
# test_tools.py). "<moment>:<flag file>:TERM" sends SIGTERM instead, as a scheduler does before it preempts the job.


def kill_starter_if_injected(moment: str, rank: int = 0, starter: int | None = None) -> None:
    wanted = seams.get("kill_starter")
    if not wanted or rank != 0:
        return
    number = signal.SIGKILL
    if wanted.endswith(":TERM"):
        wanted, number = wanted[: -len(":TERM")], signal.SIGTERM
    at_moment, flag = wanted.rsplit(":", 1)
    if at_moment != moment or os.path.exists(flag):
        return
    Path(flag).touch()
    if starter is not None:
        os.kill(starter, number)
    else:
        os.killpg(_launch_group(), number)
    if number == signal.SIGTERM:  # the job stops as a preempted one does: at the step's end, with a checkpoint
        return
    if not stops.clean_stop_possible():  # the work stops here, at the moment named, not POLL_S later: the watch ends it
        time.sleep(GRACE_S + 60)


def _launch_group() -> int:
    """The process group of the launch this rank 0 belongs to, for the kill_starter seam: its launcher's (torchrun's
    agent, run_distributed.sh), or this process's own where it leads a session of its own under a parent that does not
    (a job forked from the test process, tests/forked.py: there the test runner's group is never the one killed)."""
    group = os.getpgid(os.getppid())
    if os.getsid(os.getppid()) == group:
        return group
    if os.getsid(0) == os.getpid():
        return os.getpid()
    raise RuntimeError("the kill_starter seam: the launcher was not started in a session of its own")


def exec_bound_to_parent(command: list[str]) -> None:
    """Become `command` (os.execvp), which gets SIGTERM once this process's parent is gone: run_distributed.sh starts
    torchrun (or accelerate launch) through it, so a `kill -9` of the script alone (a terminal's, an OOM kill) stops
    the launch as a scheduler's SIGTERM does (torchrun passes SIGTERM to its workers: a complete checkpoint, the run
    marked stopped), where torchrun would otherwise train on, orphaned, holding the run directory and the devices.
    PR_SET_PDEATHSIG survives exec; its caveat above (the parent *thread*) does not apply to bash, which has one
    thread. Elsewhere than Linux the command just runs."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent went before the signal was armed
            sys.exit(128 + signal.SIGTERM)
    os.execvp(command[0], command)


if __name__ == "__main__":  # python -m src.run_safety.parent_watch COMMAND...: run_distributed.sh's launch
    exec_bound_to_parent(sys.argv[1:])
