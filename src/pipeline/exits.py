"""How a run's process ends: every way out of the pipeline (a user's mistake, a divergence, a stop by signal, a
damaged model, a failed write, a peer's or the launcher's chosen stop) → one line, no traceback, and its own exit
status (src/run_safety/exit_status.py's table), carried past torchrun (src/run_safety/launcher_exit.py). `--debug`
lets the traceback through."""

from __future__ import annotations

import os
import sys
from typing import Callable

from src.config_error import ConfigError
from src.config_parse import HelpRequested, format_help
from src.data import DataError
from src.distributed import print0
from src.judges import JudgeError
from src.models import ModelError
from src.pipeline.stopping import StoppedBySignal
from src.plan import BatchSplitError, batch_split_command, launch_command
from src.run_safety import hang_watch, launcher_exit
from src.run_safety.checkpoint_manifest import Damaged
from src.run_safety.checkpoint_split import UnsplitResume
from src.run_safety.disk_space import WriteFailed, noticed_write_failure, stop_message
from src.run_safety.exit_status import ExitStatus
from src.run_safety.parent_watch import exit_without_teardown, launcher_gone
from src.run_safety.stops import TrainingDiverged
from src.world import World

USER_ERRORS = (ConfigError, DataError, ModelError, JudgeError)

Run = Callable[[list[str]], int]  # the pipeline: argv → its exit status (src/main_distributed.py's run)


def process_exit(run: Run, argv: list[str] | None = None) -> int:
    """The pipeline run as a process: its exit status (settled with the launcher's record of a chosen stop), a worker
    torchrun restarted after the job chose to stop exiting 0, and a worker under torchrun leaving without the
    interpreter's teardown."""
    if launcher_exit.recorded() is not None:  # torchrun restarted this worker after the job chose to stop
        return 0
    try:
        code = launcher_exit.settle(exit_status(run, argv))
    except BaseException as error:
        if not launcher_gone():
            if isinstance(error, Exception):  # one a restart would raise again ends the job here, once
                launcher_exit.stop_without_restart(error)
            raise
        code = launcher_gone_exit()
    # A worker under torchrun (or whose launcher is gone) exits once its exit handlers ran, without the interpreter's
    # teardown: its devices are freed at once, and no daemon thread still inside a C++ call (a store or gloo wait, a
    # library's own) is unwound mid-call by the teardown, which aborts the process ("terminate called without an
    # active exception", exit -6) after a job that finished: seen once in a GRPO 2-process test in CI.
    if launcher_gone() or "TORCHELASTIC_RUN_ID" in os.environ:
        exit_without_teardown(code)
    return code


def launcher_gone_exit() -> int:
    """A peer gone from a collective: its launcher is gone too, and its watch ended it (run_safety/parent_watch.py).
    Said in one line, unless the job's stop was recorded already (its own line said why)."""
    if launcher_exit.recorded() is None:
        print(f"error: rank {World.from_environment().rank}: stopped, its launcher is gone", file=sys.stderr)
    return ExitStatus.SIGTERM


def exit_status(run: Run, argv: list[str] | None = None) -> int:
    """`run(argv)`'s exit status, each stop said in one line by the rank that knows it (rank 0 for what every rank
    raises together); `--debug` in argv: a user's mistake, a damaged model or a failed write raises instead."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    arguments = [arg for arg in (argv if argv is not None else sys.argv[1:]) if arg != "--debug"]
    try:
        return run(arguments)
    except HelpRequested:
        print(format_help())
        return 0
    except USER_ERRORS as error:
        if debug:
            raise
        return user_error(error, arguments)
    except TrainingDiverged as error:
        if World.from_environment().is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.DIVERGED
    except StoppedBySignal as stop:
        print0(f"  {stop}")
        return stop.exit_code
    except Damaged as error:  # every rank raises it together (train_stage), or rank 0 alone after the run (make_copies)
        if debug:
            raise
        if World.from_environment().is_main:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.DAMAGED
    except WriteFailed as error:  # every rank raises it together (src/distributed.py barrier); rank 0 says it
        if debug:
            raise
        if error.alone or World.from_environment().is_main:  # alone: no other rank knows of it
            print(f"error: {error}", file=sys.stderr, flush=True)
        return ExitStatus.WRITE_FAILED
    except Exception:
        return echo_of_chosen_stop(debug)


def user_error(error: Exception, arguments: list[str]) -> int:
    """A user's mistake: one line on rank 0, exit 2."""
    world = World.from_environment()
    if world.is_main:
        # A batch the processes cannot share: the command that runs, with the nearest batch that splits; an
        # unfinished run's batch on the processes that split it.
        command = ""
        if isinstance(error, BatchSplitError):
            command = f"; run: {batch_split_command(error, arguments, world.local_world_size)}"
        elif isinstance(error, UnsplitResume):
            command = f"; run: {launch_command(arguments, error.per_node, error.nodes)}"
        print(f"error: {error}{command}", file=sys.stderr, flush=True)
    return ExitStatus.USER_ERROR


def echo_of_chosen_stop(debug: bool) -> int:
    """A stop already chosen (a write that failed here, or another rank's recorded exit status): the error being
    handled is its echo (a peer gone from a collective: gloo's "Connection closed by peer"), not news. One line, no
    traceback; any other error is raised as it is."""
    hang_watch.wait_if_stopping()  # a hang's stop: the watch ends this process (src/run_safety/hang_watch.py)
    chosen, failure = launcher_exit.recorded(), noticed_write_failure()
    if debug or (chosen is None and failure is None):
        raise
    if failure is not None:
        print(f"error: {stop_message([failure])}", file=sys.stderr, flush=True)
        return ExitStatus.WRITE_FAILED
    return chosen
