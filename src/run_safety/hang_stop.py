"""How a process stops the job once a hang is decided (src/run_safety/hang_watch.py decides; every process stops).

The first process to decide prints one line (the stuck rank, its phase, what it was doing, where its stack stood, where
the stacks are, what a relaunch resumes from: `message`). Every process copies the stacks on the board to
`<run>/hang/rank<N>.txt` (a frozen peer cannot copy its own), the deciding one writes `hang/hang.json`; rank 0 records
the stop in training_info.json and the report (`on_stop`, with `stop_reason`) and releases the run directory's hold at
once; a process frozen with the interpreter's lock held, on this machine, is killed by its peers once its stack is
written; and every process exits with ExitStatus.HUNG (7), recorded for run_distributed.sh
(src/run_safety/launcher_exit.py), or ends plain torchrun's agent too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from src.progress import format_duration
from src.run_safety import launcher_exit
from src.run_safety.exit_status import ExitStatus
from src.run_safety.hang_board import write_json
from src.run_safety.run_lock import process_start_time, release_if_held_by


@dataclass
class HangStop:
    """What this process needs to stop the job: its run directory and board, its rank, the watch's poll, what a
    relaunch resumes from (`newest_checkpoint()`), rank 0's hold and how it records the stop (`on_stop(reason,
    verdict)`)."""

    run_dir: Path
    board: Path
    rank: int
    poll_s: float
    newest_checkpoint: Callable | None = None
    hold: object = None
    on_stop: Callable | None = None

    def message(self, verdict: dict) -> str:
        newest = self.newest_checkpoint() if self.newest_checkpoint else None
        resume = (f"the same command resumes from {newest}" if newest else "no complete checkpoint was saved yet; the "
                  "same command starts again")
        at = f" at {verdict['where']}" if verdict.get("where") else ""
        return (f"{verdict['description']} made no progress for {format_duration(verdict['silent_s'])} "
                f"(--hang_timeout: {format_duration(verdict['timeout_s'])}){at}; every rank's Python stack is in "
                f"{self.run_dir / 'hang'}; every process stopped; {resume}")

    def announce(self, verdict: dict) -> None:
        print(f"error: hang: {self.message(verdict)}", file=sys.stderr, flush=True)

    def stop_reason(self, verdict: dict) -> str:
        """training_info.json's stop_reason: "stopped by a hang: rank 1 in the judge (...) at step 10: ..."."""
        step = f" at step {verdict['step']}" if verdict.get("step") is not None else ""
        return f"stopped by a hang: {verdict['description']}{step}: {self.message(verdict)}"

    def stop(self, verdict: dict, stack_file) -> None:
        """The stacks copied, the stop recorded, the hold released, a frozen peer ended, and this process's exit."""
        folder = self.run_dir / "hang"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            stack_file.flush()
            time.sleep(0.5)  # a dump a peer's signal asked for is written by now
            # Every stack written here (a frozen peer cannot copy its own), each process copying the same files.
            for stack in sorted(self.board.glob("rank*.stack")):
                if stack.stat().st_size:
                    shutil.copyfile(stack, folder / stack.name.replace(".stack", ".txt"))
            if verdict.get("by") == self.rank:
                write_json(folder / "hang.json", verdict | {"message": self.message(verdict)})
        except OSError:
            pass
        self._record(verdict)
        self._end_frozen_peer(verdict)
        if launcher_exit.record(ExitStatus.HUNG):  # run_distributed.sh exits 7; torchrun sees clean ends, no restart
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        # Plain torchrun: its agent ends too (a restart would stick at the same place again)
        launcher_exit.end_job(ExitStatus.HUNG)

    def _record(self, verdict: dict) -> None:
        """Rank 0 records the stop and releases its hold; another rank releases a stuck rank 0's hold for it."""
        if self.rank == 0:
            if self.on_stop is not None:
                try:
                    self.on_stop(self.stop_reason(verdict), verdict)
                except Exception as error:  # noqa: BLE001  the stop goes on; the console line said it all
                    print(f"  warning: the hang was not recorded in the report ({type(error).__name__}: {error})",
                          file=sys.stderr, flush=True)
            if self.hold is not None:
                self.hold.release()  # at once: the same command relaunched is not refused for the hold's 2 minutes
        elif verdict.get("rank") == 0 and self.hold is None:
            release_if_held_by(self.run_dir, verdict.get("pid"), verdict.get("host"))

    def _end_frozen_peer(self, verdict: dict) -> None:
        """The stuck process, on this machine, once its stack is written: a frozen one cannot end itself."""
        if verdict.get("host") != socket.gethostname() or verdict.get("rank") == self.rank:
            return
        pid, started = verdict.get("pid"), verdict.get("pid_start")
        deadline = time.monotonic() + self.poll_s * 4 + 2  # its own watch ends it (exit 7) when it can run at all
        while started is not None and process_start_time(pid) == started and time.monotonic() < deadline:
            time.sleep(0.2)
        if started is not None and process_start_time(pid) == started:  # the same process, still there: frozen
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, TypeError, ValueError):
                pass
