"""The toolkit's exit statuses, one table: what `python -m src.main_distributed` and `./run_distributed.sh` exit with.
docs/reliability.md's table follows it (tests/test_launcher_exit.py checks every status has its row)."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    DONE = 0             # finished; also the same command relaunched on a finished run (src/run_safety/finished_run.py)
    FAILED = 1           # an error a restart would raise again (a code or library error: its traceback, shown once),
                         # not restarted (src/run_safety/launcher_exit.py restart_can_cure); also torchrun's own failure
    USER_ERROR = 2       # one `error:` line: a flag, file, row, model, a held run directory, no room on the disk
    DIVERGED = 4         # NaN/inf loss or gradient (src/run_safety/stops.py)
    WRITE_FAILED = 5     # no space left, quota, I/O error while writing (src/run_safety/disk_space.py); resumable
    NODE_LOST = 6        # a node of a multi-node job stopped answering (src/run_safety/node_watch.py); resumable
    HUNG = 7             # a rank made no progress for --hang_timeout (src/run_safety/hang_watch.py); resumable
    DAMAGED = 8          # a saved checkpoint or final model is not what was saved, nothing intact stands in for it
                         # (src/run_safety/checkpoint_manifest.py)
    SIGINT = 130         # stopped by a signal after saving a checkpoint (src/run_safety/stops.py); resumable
    SIGTERM = 143


# Stops a restart cannot mend: under run_distributed.sh the launcher exits with them, not torchrun (launcher_exit.py)
FINAL = (ExitStatus.FAILED, ExitStatus.USER_ERROR, ExitStatus.DIVERGED, ExitStatus.WRITE_FAILED, ExitStatus.NODE_LOST, ExitStatus.HUNG,
         ExitStatus.DAMAGED)
