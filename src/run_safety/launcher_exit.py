"""A deliberate stop under run_distributed.sh: one line and the toolkit's exit status, not torchrun's restarts and
failure report.

torchrun restarts a job whose worker exits non-zero (MAX_RESTARTS) and, once out of restarts, prints a ChildFailedError
report after the worker's own line and exits 1. That is right for a crash a restart can mend; it is wrong for a stop
the toolkit chose because a restart cannot mend it: a user error (2), a diverged run (4), a failed write on a full
disk (5), a lost node (6), a hang (7: a restart would stick at the same place again), no intact checkpoint to resume
from (8). For those, each worker under the launcher records its status in the launcher's directory (PREFKIT_EXIT_DIR,
one per launch) and exits 0, so torchrun ends quietly; the launcher then exits with the recorded status. A worker that
torchrun restarts anyway (another rank crashed on the way out) finds the recorded status and exits 0 at once. Outside
the launcher (plain torchrun, python -m src.main_distributed), exit statuses are unchanged.

The launcher's preflight (one process, before torchrun) also finds a run that is already finished, relaunched by the
same command (src/run_safety/finished_run.py): it finishes the run's end itself and records FINISHED, and the launcher
exits 0 without starting torchrun.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback
from pathlib import Path

from src import seams
from src.run_safety.exit_status import FINAL, ExitStatus

FINISHED = "finished"  # the preflight's record: the run is finished, no worker needs to start
ENVIRONMENT = "environment"  # the preflight's record: variables the launcher exports for the launch


def _directory() -> Path | None:
    directory = os.environ.get("PREFKIT_EXIT_DIR")
    return Path(directory) if directory and "TORCHELASTIC_RUN_ID" in os.environ else None


def record(code: int) -> bool:
    """Record a final exit status for the launcher; True when it did (the worker then exits 0)."""
    directory = _directory()
    if code not in FINAL or directory is None or not directory.is_dir():
        return False
    temporary = directory / f".rank-{os.environ.get('RANK', '0')}-{os.getpid()}"
    try:
        temporary.write_text(f"{int(code)}\n")
        os.replace(temporary, directory / f"rank-{os.environ.get('RANK', '0')}")
    except OSError:  # the launcher is already gone (another rank's record ended it): the status is this worker's own
        return False
    return True


def end_job(code: int) -> None:
    """End this worker now with `code`, from a watch thread (a lost node, a hang), recorded for the launcher, and its
    torchrun agent with it, whichever local rank noticed first: a restart would wait for a lost node again (a static
    multi-node job cannot re-form without it) or stick where the job stuck, and a restarted worker that finds the
    status recorded exits 0, which leaves its agent waiting at its exit barrier for the lost node (5 minutes). Under
    run_distributed.sh (the status recorded) the agent is killed without its SIGTERM traceback; under plain torchrun,
    SIGTERM lets it stop its workers."""
    under_launcher = record(code)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            os.kill(os.getppid(), signal.SIGKILL if under_launcher else signal.SIGTERM)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def says_why(local_rank: int) -> bool:
    """True for the one worker of this node that prints why the job stops: under run_distributed.sh the first to
    claim it in the launch's directory (any local rank: the one that noticed first ends the node at once), else local
    rank 0."""
    directory = _directory()
    if directory is None or not directory.is_dir():
        return local_rank == 0
    try:
        os.close(os.open(directory / "says-why", os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # a local directory: atomic
    except FileExistsError:
        return False
    except OSError:  # the launcher already gone: the node is ending anyway
        return local_rank == 0
    return True


def settle(code: int) -> int:
    """The status this worker exits with: 0 when the launcher will report `code` itself."""
    return 0 if record(code) else code


def recorded() -> int | None:
    """The status an earlier worker of this launch recorded, if any (a restarted worker then has nothing to do)."""
    directory = _directory()
    if directory is None or not directory.is_dir():
        return None
    for path in sorted(directory.glob("rank-*")):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def record_finished() -> bool:
    """The launcher's preflight: the run is already finished (and its end finished too), so the launcher starts no
    worker and exits 0. True when recorded (only under run_distributed.sh)."""
    directory = os.environ.get("PREFKIT_EXIT_DIR")
    if not directory or "TORCHELASTIC_RUN_ID" in os.environ or not Path(directory).is_dir():
        return False
    (Path(directory) / FINISHED).write_text("0\n")
    return True


def record_environment(variables: dict[str, str]) -> bool:
    """The launcher's preflight: variables run_distributed.sh exports before it starts torchrun or accelerate launch
    (`NAME=value` lines in its directory's `environment`). True when recorded (only under run_distributed.sh)."""
    directory = os.environ.get("PREFKIT_EXIT_DIR")
    if not variables or not directory or "TORCHELASTIC_RUN_ID" in os.environ or not Path(directory).is_dir():
        return False
    (Path(directory) / ENVIRONMENT).write_text("".join(f"{name}={value}\n" for name, value in variables.items()))
    return True


# What a restart can cure, read from an error and the errors it was raised from: the echo of a peer's or a node's loss
# in the process group (torch.distributed's Dist*Error; gloo's and NCCL's RuntimeErrors: "Connection closed by peer"),
# a device's fault ("CUDA error: ..."), a filesystem's (OSError). A lost worker's peers raise these, and torchrun's
# restart resumes the job from its newest checkpoint. Anything else (a TypeError, a library's ValueError, an assertion,
# a tensor's "Can't call numpy() on Tensor that requires grad") is raised the same way again by every restart.
TRANSPORT_WORDS = ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe", "Socket", "Timed out",
                   "timed out", "CUDA error", "ECC")


def restart_can_cure(error: BaseException) -> bool:
    """Whether torchrun's restart of the job could end otherwise than `error` did (see TRANSPORT_WORDS)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) or any(kind.__name__ == "DistError" for kind in type(error).__mro__):
            return True
        if isinstance(error, RuntimeError) and any(word in str(error) for word in TRANSPORT_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def stop_without_restart(error: BaseException) -> None:
    """Under run_distributed.sh, an error no restart cures ends the job now, once: its traceback printed by the first
    worker to raise it (any other raises the same, or joins a collective that cannot finish), exit 1 recorded for the
    launcher and the torchrun agent ended, so it starts no restart (four loads of a large model for one error). Does
    nothing elsewhere: plain torchrun keeps its own behaviour."""
    directory = _directory()
    if directory is None or not directory.is_dir() or restart_can_cure(error):
        return
    if _claimed(directory / "traceback"):
        traceback.print_exception(error)
        print(f"error: rank {os.environ.get('RANK', '0')} raised {type(error).__name__}: the job is not restarted, "
              "a restart would raise it again (torchrun's restarts are for lost workers and nodes)", file=sys.stderr,
              flush=True)
    atexit._run_exitfuncs()  # a tracker's last flush, temporary directories: as a worker's normal end runs them
    end_job(ExitStatus.FAILED)


def _claimed(path: Path) -> bool:
    """The first process of the launch to create `path` (a local directory: atomic)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return False
    return True


def raise_if_injected(place: str, rank: int) -> None:
    """The test seam raise_in ("<place>:<rank or *>"): that rank raises an error no restart cures at `place`."""
    wanted = seams.get("raise_in")
    if wanted and wanted.rsplit(":", 1)[0] == place and wanted.rsplit(":", 1)[1] in ("*", str(rank)):
        raise ValueError(f"raised by the test seam raise_in at {place} on rank {rank}")
