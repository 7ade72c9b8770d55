"""Runs of `python -m src.main_distributed` (and of N processes as one job) as processes forked from this test
process, which has torch, transformers, TRL and the toolkit imported already.

Why: a fresh Python process spends ~5 CPU-s importing those before it does anything (a tiny run's whole work is ~4 s
more), and the suite starts ~150 of them on a 2-core machine. A fork starts with them imported: a tiny one-process
run costs ~4.5 CPU-s instead of ~9 (measured from a process with the libraries imported, 2 runs each, interleaved).

What a forked run is: a real process of its own (own pid, memory, exit status, files, process group), running the
toolkit's own `main()` with the command line, environment and working directory given, its output in files read back
as a `subprocess.CompletedProcess`. What it is not: a fresh interpreter. Tests about what a process imports, about the
shell launcher, torchrun's restarts or a kill from outside keep starting real commands (docs/development.md lists
them); the ones that use this module check what a run computes and writes. A variable a library reads when it is
imported (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT, WANDB_*, TRACKIO_DIR, ...) keeps, in a forked run, the value the test
process imported it with, whichever test imported it first: a test that sets one starts a fresh interpreter
(test_trackers, test_cli's no-Hub test).

The child is made to look like a fresh process where that shows: standard streams and logging handlers on its own
files, Python's default warning filters and display (pytest records warnings per test), no inherited exit handlers or
signal handlers. It runs torch on one thread (OMP_NUM_THREADS=1, as the launches of the tests have always had): see
`_as_fresh_process`.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent

# A fresh interpreter's warning filters (no -W options): what `python -c "import warnings; print(warnings.filters)"`
# prints on Python 3.11.
FRESH_WARNING_FILTERS = [
    ("default", None, DeprecationWarning, "__main__", 0),
    ("ignore", None, DeprecationWarning, None, 0),
    ("ignore", None, PendingDeprecationWarning, None, 0),
    ("ignore", None, ImportWarning, None, 0),
    ("ignore", None, ResourceWarning, None, 0),
]


def _show_warning(message) -> None:
    """warnings' own display (warnings._showwarnmsg_impl), which pytest replaces with a recorder during a test."""
    stream = message.file if message.file is not None else sys.stderr
    try:
        stream.write(warnings._formatwarnmsg(message))
    except OSError:
        pass


def _as_fresh_process(environment: dict[str, str], cwd: Path, stdout: Path, stderr: Path) -> None:
    """In the forked child, before it runs anything: what a newly started process would have."""
    os.setsid()  # its own process group, as subprocess.Popen(start_new_session=True): a timeout kills all it started
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                                   errors="backslashreplace")
    # Loggers: pytest's capture handlers off, every stream handler on the new standard streams.
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and not isinstance(
                    handler, (logging.FileHandler, logging._StderrHandler)):  # the latter reads sys.stderr itself
                handler.stream = sys.stdout if getattr(handler.stream, "name", None) in ("<stdout>", 1) else sys.stderr
    warnings.resetwarnings()
    warnings.filters[:] = list(FRESH_WARNING_FILTERS)
    warnings._filters_mutated()  # warnings shown once in the forking process show again here
    warnings.showwarning, warnings.formatwarning = warnings._showwarning_orig, warnings._formatwarning_orig
    warnings._showwarnmsg_impl = _show_warning
    atexit._clear()  # the forking process's exit handlers are not this process's
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # One thread: the forking process's OpenMP pool (GNU libgomp) is not carried over a fork, and a parallel region of
    # more than one thread in the child waits for the pool's threads forever (seen: a matmul in generate()). The
    # variable says so to the toolkit too, which sizes torch's pool itself only where a launcher did not.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    _toolkit_as_in_a_new_process()


# What the toolkit keeps per process from its modules' import (module, attribute, its value in a new process): a
# forked run would otherwise start with what the test process's own in-process tests left there, or, for the rank
# that decides who prints, with the test process's environment. A new per-process state goes here.
def _new_process_state():
    import threading

    from src.world import World

    return [("src.distributed", "_world", World.from_environment()),
            ("src.run_safety.disk_space", "_noticed", []), ("src.run_safety.disk_space", "_output_dirs", []),
            ("src.run_safety.disk_space", "_injected", {}),
            ("src.run_safety.stops", "_stop_signal", []), ("src.run_safety.stops", "_clean_stop_point", [False]),
            ("src.run_safety.parent_watch", "_watching", []), ("src.run_safety.parent_watch", "_fork_hook", []),
            ("src.run_safety.parent_watch", "_launcher", []),
            ("src.run_safety.node_watch", "_finished", threading.Event()),
            ("src.run_safety.hang_watch", "_watch", []), ("src.run_safety.hang_watch", "_me", _new_hang_state()),
            ("src.library_warnings", "_shown", {})]


def _new_hang_state():
    from src.run_safety.hang_watch import _Process

    return _Process()


def _toolkit_as_in_a_new_process() -> None:
    """The toolkit's per-process state (`_new_process_state`) as a new process has it, in the modules imported
    already; the others start that way when imported. Lists are emptied in place: other modules hold them. And
    accelerate's: an in-process test that built TrainingArguments left its PartialState (one process, no engine) in
    the test process, which a forked job's FSDP state was then built on (src/engines.py adopt_fsdp_on_cpu: the
    trainer saw a world of 1)."""
    if "accelerate.state" in sys.modules:
        sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
    for name, attribute, value in _new_process_state():
        module = sys.modules.get(name)
        if module is None:
            continue
        current = getattr(module, attribute)
        if isinstance(current, list):
            current[:] = value
        elif isinstance(current, dict):
            current.clear()
        else:
            setattr(module, attribute, value)


def _run_child(entry, argv: list[str]) -> int:
    """Runs `entry(argv)` as `python -m` would run a module's `sys.exit(main())`; the exit status."""
    sys.argv = [str(PROJECT_ROOT / "src" / "main_distributed.py"), *argv]
    code = 1
    try:
        code = entry(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001  what an uncaught exception does: its traceback on stderr, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)
    return code  # not reached


def _main_entry(argv: list[str]) -> int:
    from src.main_distributed import main

    return main(argv)


_warmed: list[bool] = []
WARM = True  # False in a process that forks only runs that train nothing (dry runs): it has nothing to share


def _warm() -> None:
    """Once per test process, before its first fork: what a run imports that collecting the tests did not (TRL's
    trainers and configs of every objective, and through them transformers' Trainer; datasets, pandas and pyarrow;
    the report's matplotlib), so that each forked run finds them imported instead of importing them again. The
    trackers TRL imports when installed (wandb: TRL's base trainer imports it) are then imported in the test process,
    as after any in-process test that builds a trainer; no forked run asks for one (test_trackers starts fresh
    interpreters)."""
    if _warmed or not WARM:
        return
    _warmed.append(True)
    import datasets  # noqa: F401
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401

    from src.objectives import OBJECTIVES, load

    for row in OBJECTIVES.values():
        load(row.training.trl_config)
        load(row.training.trainer)


def start(argv: list[str], stdout: Path, stderr: Path, env: dict[str, str] | None = None, cwd: Path = PROJECT_ROOT,
          entry=_main_entry) -> int:
    """Forks a process running `entry(argv)` (the toolkit's main by default) with `env` as its whole environment
    (this process's when None); its pid. Output goes to the two files."""
    _warm()
    environment = dict(os.environ if env is None else env)
    sys.stdout.flush()
    sys.stderr.flush()
    # The child never collects what it inherits (gc.freeze): a fresh process has no test process's heap to walk, and
    # the child's full collections walked it all (the training's own one at its end too, accelerate's free_memory),
    # writing to every page they touched. test_training + test_simpo + test_kto: 38.1 -> 30.0 CPU-s; test_finished_run +
    # test_reference_cache + test_packed_dpo: 65.5 -> 51.9 (two runs of each arm, interleaved, one process).
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
    if pid == 0:
        try:
            _as_fresh_process(environment, Path(cwd), Path(stdout), Path(stderr))
        except BaseException:  # noqa: BLE001  the harness's own failure, told where the test reads it
            import traceback

            Path(stderr).write_text(f"tests/forked.py could not set up the child:\n{traceback.format_exc()}")
            os._exit(70)
        _run_child(entry, argv)
    return pid


def wait(pids: list[int], timeout: float, stop_others_on_failure: bool = False) -> list[int]:
    """Each pid's exit status (negative: the signal that ended it), in order. Past `timeout` seconds every one still
    running is killed with its process group and subprocess.TimeoutExpired raised. With `stop_others_on_failure`, a
    process that exits non-zero gets the others SIGTERMed, then SIGKILLed 30 s later (torchrun's way)."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    terminated_at = None
    while len(statuses) < len(pids):
        for pid in pids:
            if pid in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        failed = any(code != 0 for code in statuses.values())
        if stop_others_on_failure and failed and len(statuses) < len(pids):
            if terminated_at is None:
                terminated_at = now
                _signal_groups([pid for pid in pids if pid not in statuses], signal.SIGTERM)
            elif now - terminated_at > 30:
                _signal_groups([pid for pid in pids if pid not in statuses], signal.SIGKILL)
        if now > deadline and len(statuses) < len(pids):
            running = [pid for pid in pids if pid not in statuses]
            _signal_groups(running, signal.SIGKILL)
            for pid in running:
                os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(f"forked run {pids}", timeout)
        if len(statuses) < len(pids):
            time.sleep(0.05)
    return [statuses[pid] for pid in pids]


def _signal_groups(pids: list[int], number: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, number)
        except ProcessLookupError:
            pass


class Running:
    """`python -m src.main_distributed ARGV` forked while the test goes on (as subprocess.Popen): one process, or with
    `nproc` that many as one job on this machine, each with the variables a distributed launch gives its workers
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): torch.distributed's env://
    rendezvous, as under any launcher. Not torchrun: no agent and no restarts, so none of the toolkit's torchrun-only
    parts (its node watch, its exit record); the tests of those start torchrun. A rank that fails has the others
    stopped, as torchrun does. `poll()`, `communicate(timeout)` -> (stdout, stderr) (each rank's in rank order),
    `returncode` (the first non-zero rank's, else 0), `pids` (each its own process group)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, nproc: int | None = None,
                 cwd: Path = PROJECT_ROOT, entry=_main_entry, node_env: list[dict[str, str]] | None = None):
        environment = dict(os.environ if env is None else env)
        ranks = [environment]
        if nproc is not None:
            # With `node_env` (one dict per node), the ranks are that many nodes' worth, each node's ranks with its own
            # variables on top (its caches, say): LOCAL_WORLD_SIZE and LOCAL_RANK as each node's launcher sets them.
            nodes = node_env or [{}]
            local = nproc // len(nodes)
            environment.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(local)})
            for variable in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
                environment.pop(variable, None)
            ranks = [environment | nodes[rank // local] | {"RANK": str(rank), "LOCAL_RANK": str(rank % local),
                                                           "GROUP_RANK": str(rank // local)} for rank in range(nproc)]
        self._folder = tempfile.TemporaryDirectory(prefix="forked-")
        self._outputs = [(Path(self._folder.name) / f"stdout{rank}", Path(self._folder.name) / f"stderr{rank}")
                         for rank in range(len(ranks))]
        self.pids = [start(argv, stdout, stderr, rank_env, cwd, entry)
                     for rank_env, (stdout, stderr) in zip(ranks, self._outputs)]
        self.pid = self.pids[0]
        self.returncode = None
        self._codes: dict[int, int] = {}
        self._stopping = False

    def poll(self) -> int | None:
        for pid in self.pids:
            if pid not in self._codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self._codes[pid] = os.waitstatus_to_exitcode(status)
        if any(self._codes.values()) and not self._stopping:  # a rank failed: the others are stopped, as torchrun does
            self._stopping = True
            _signal_groups([pid for pid in self.pids if pid not in self._codes], signal.SIGTERM)
        if len(self._codes) == len(self.pids):
            self.returncode = next((self._codes[pid] for pid in self.pids if self._codes[pid]), 0)
        return self.returncode

    def codes(self) -> list[int | None]:
        """Each rank's exit status so far (None: still running)."""
        self.poll()
        return [self._codes.get(pid) for pid in self.pids]

    def communicate(self, timeout: float = 600) -> tuple[str, str]:
        if self.returncode is None:
            running = [pid for pid in self.pids if pid not in self._codes]
            self._codes.update(zip(running, wait(running, timeout, stop_others_on_failure=True)))
            self.poll()
        output = ("".join(_read(stdout) for stdout, _ in self._outputs),
                  "".join(_read(stderr) for _, stderr in self._outputs))
        self._folder.cleanup()
        return output


def run_main(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600, cwd: Path = PROJECT_ROOT,
             entry=_main_entry) -> subprocess.CompletedProcess:
    """`python -m src.main_distributed ARGV`, forked: as `subprocess.run(..., capture_output=True, text=True)`."""
    return _completed(Running(argv, env, None, cwd, entry), argv, timeout)


def run_job(nproc: int, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600,
            cwd: Path = PROJECT_ROOT, entry=_main_entry,
            node_env: list[dict[str, str]] | None = None) -> subprocess.CompletedProcess:
    """`nproc` forked processes as one job (see Running), to the end: as `subprocess.run`."""
    return _completed(Running(argv, env, nproc, cwd, entry, node_env), argv, timeout)


def _completed(running: Running, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    stdout, stderr = running.communicate(timeout)
    return subprocess.CompletedProcess(["forked", *argv], running.returncode, stdout, stderr)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="backslashreplace") if path.exists() else ""
