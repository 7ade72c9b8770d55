"""The live report: plots and report.md refreshed on rank 0 while a run trains, so `results/<run>/` shows the run
as it goes rather than only at its end.

When: after every evaluation and every checkpoint, and every `every` seconds (5 minutes) in between — at the start
of the next optimizer step, so the refresh sees the evaluation's record and the checkpoint on disk.
Cost: a refresh takes one to a few seconds (matplotlib on the CPU; bench/bench_live_report.py). It is taken only while the time spent refreshing,
this refresh included (estimated as the last one, FIRST_ESTIMATE_S before any), stays within MAX_SHARE (1%) of the
time since training began. So refreshing costs at most 1% of training on any machine (a refresh slower than its
estimate can overshoot by its difference; the next one then waits longer): a long run refreshes at
every evaluation; a short one (the 4-minute CPU default) refreshes less often or only at its end, and evaluations
that come too fast fold into the next refresh. PREFKIT_LIVE_REPORT_SHARE overrides the 1%. The refresh time is
reported to the throughput meter as a pause (it is not training) and the totals go to training_info.json
(`live_report`).
Memory: each refresh is drawn in a child process forked for it (`build_report_apart`), so what drawing took (the
parsed history, matplotlib's renderer, the allocator's high-water mark) goes back to the system when the child exits;
drawn in rank 0 itself, a refresh left the heap at the largest history drawn so far, and rank 0 grew with the run
(issue 41: ~240 MB over 27,000 steps). The child starts warm: matplotlib is imported once, here in rank 0, before it.
Safety: every file is replaced atomically (src/run_files.py), so a reader, or a run that crashes mid-refresh, keeps
the previous complete report; a refresh that fails prints one warning and training goes on, unless a write failed
(a full disk, a quota, an I/O error): then the run stops on every rank in one line (src/run_safety/disk_space.py).
"""

from __future__ import annotations

import os
import pickle
import select
import time
from pathlib import Path
from typing import Callable

from transformers import TrainerCallback

from src import run_files, seams
from src.progress import eta_seconds
from src.run_safety import disk_space, hang_watch
from src.run_safety.disk_space import write_failure_errno
from src.reporting.report import ReportError, build_report
from src.reporting.status import Live, run_state, status_line

REFRESH_EVERY_S = 300.0
MAX_SHARE = 0.01  # of the training time, at most spent refreshing
# A refresh of a DPO run (six charts) costs about 0.9-1.3 s of CPU at 900 and at 9,000 logged steps alike
# (bench/bench_live_report.py), more wall time on a loaded machine. The first is budgeted at this until one is timed.
FIRST_ESTIMATE_S = 2.0
# A refresh's child that has not finished by then is stopped, and the report is built at the end: a stuck child must
# not keep rank 0 (and so every rank, at the next collective) waiting.
CHILD_TIMEOUT_S = 600.0


def build_report_apart(run_dir: Path, live: Live, timeout_s: float = CHILD_TIMEOUT_S) -> None:
    """`build_report(run_dir, live)` in a child process forked for it, raising here what it raised there. The child
    only reads the run directory and writes the report's files (no torch, no collective), as a data loader's forked
    workers only read data; it leaves by os._exit, so none of the trainer's exit handlers run in it. Where fork does
    not exist, the report is built in this process."""
    if not hasattr(os, "fork"):
        build_report(run_dir, live)
        return
    import matplotlib.backends.backend_agg  # noqa: F401  imported once in the parent: each child starts warm
    import matplotlib.figure  # noqa: F401

    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: build, say how it went, leave
        os.close(reader)
        status = 1
        try:
            try:
                build_report(run_dir, live)
                outcome = None
            except BaseException as error:  # noqa: BLE001  raised again in the parent
                outcome = error
            try:
                message = pickle.dumps((outcome, disk_space._injected))
            except Exception:  # an exception that does not pickle: its type and text
                message = pickle.dumps((RuntimeError(f"{type(outcome).__name__}: {outcome}"), disk_space._injected))
            with os.fdopen(writer, "wb") as pipe:
                pipe.write(message)
            status = 0
        finally:
            os._exit(status)
    os.close(writer)
    received, deadline = [], time.monotonic() + timeout_s
    with os.fdopen(reader, "rb") as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(child, 9)
                os.waitpid(child, 0)
                raise TimeoutError(f"the report's process did not finish in {timeout_s:.0f} s")
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break
            received.append(chunk)
    os.waitpid(child, 0)
    if not received:
        raise RuntimeError("the report's process ended without a word")
    outcome, injected = pickle.loads(b"".join(received))
    disk_space._injected.update(injected)  # the test seam counts writes across refreshes, as in one process
    if outcome is not None:
        raise outcome


def _note_refresh(run_dir: Path) -> None:
    """The test seam live_report_log (src/seams.py): each refresh's report.md first line appended to the file it names,
    so a test reads every state the report went through instead of polling the file while the run goes on
    (tests/test_live_report.py)."""
    log = seams.get("live_report_log")
    report = run_dir / "report.md"
    if log and report.exists():
        with open(log, "a", encoding="utf-8") as out:
            out.write(report.read_text(encoding="utf-8").split("\n", 1)[0] + "\n")


class LiveReport(TrainerCallback):
    """Refreshes `run_dir`'s report while training runs (rank 0 only; the other ranks never refresh)."""

    def __init__(self, run_dir: str | Path, on_pause: Callable[[float], None] | None = None,
                 every: float = REFRESH_EVERY_S, max_share: float | None = None, clock=time.monotonic,
                 build: Callable[[Path, Live], None] = build_report_apart):
        self.run_dir = Path(run_dir)
        self.build = build
        self.report_pause = on_pause  # not named on_pause: the trainer calls every callback's on_pause
        self.every, self.clock = every, clock
        self.max_share = max_share if max_share is not None else float(
            os.environ.get("PREFKIT_LIVE_REPORT_SHARE", MAX_SHARE))
        self.started = clock()
        self.ended: float | None = None
        self.start_step = 0
        self.due = False
        self.last_end: float | None = None
        self.last_duration = 0.0
        self.refreshes = 0
        self.seconds = 0.0
        self.failed = False
        self.state = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = self.last_end = self.clock()
        self.start_step = state.global_step  # a resumed run's ETA goes at the rate since the resume
        self.state = state
        if state.is_world_process_zero:
            hang_watch.on_stall(self.stalled)

    def on_evaluate(self, args, state, control, **kwargs):
        self.due = True

    def on_save(self, args, state, control, **kwargs):
        self.due = True

    def on_step_begin(self, args, state, control, **kwargs):
        self._maybe_refresh(state)

    def on_train_end(self, args, state, control, **kwargs):
        hang_watch.remove_on_stall(self.stalled)
        self._maybe_refresh(state)  # the last evaluation's record, while the model is saved and judged
        self.ended = self.clock()

    def stalled(self, line: str) -> None:
        """The hang watch, on rank 0: no step has finished for a few step times. Only report.md's status line is
        rewritten ("no step for 4 min 10 s; rank 1 in the judge" instead of an ETA): this runs beside a main thread
        that is stuck or waiting, and draws nothing."""
        report = self.run_dir / "report.md"
        if self.state is None:
            return
        live = Live(step=self.state.global_step, total=self.state.max_steps, elapsed_s=self.clock() - self.started,
                    eta_s=None, stalled=line)
        if report.exists():
            info = run_files.read_json(self.run_dir / run_files.TRAINING_INFO)
            rest = report.read_text(encoding="utf-8").split("\n", 1)
            run_files.write_text(report, "\n".join([status_line(run_state(info, [], live))] + rest[1:]))
        else:  # none refreshed yet (a short run): the whole report, once, in this thread
            try:
                build_report(self.run_dir, live)
            except ReportError:  # nothing logged yet: the console line says it
                return
        _note_refresh(self.run_dir)

    def _maybe_refresh(self, state) -> None:
        if not state.is_world_process_zero or self.failed:
            return
        now = self.clock()
        expected = self.last_duration or FIRST_ESTIMATE_S
        within_budget = self.seconds + expected <= self.max_share * (now - self.started)
        if (self.due or now - self.last_end >= self.every) and within_budget:
            self.refresh(state)

    def refresh(self, state) -> None:
        started = self.clock()
        elapsed = started - self.started
        live = Live(step=state.global_step, total=state.max_steps, elapsed_s=elapsed,
                    eta_s=eta_seconds(state.global_step - self.start_step, state.max_steps - self.start_step, elapsed))
        try:
            self.build(self.run_dir, live)
        except ReportError:
            pass  # nothing logged yet: the next evaluation or interval tries again
        except Exception as error:  # a report must never stop a run: say it once and carry on without
            if write_failure_errno(error, self.run_dir) is not None:
                raise  # but a full disk does: every rank stops at the next step's check (src/trainers/base.py)
            self.failed = True
            print(f"  warning: the live report could not be refreshed ({type(error).__name__}: {error}); training "
                  f"goes on, and the report is built at the end", flush=True)
        self.last_end = self.clock()
        self.last_duration = self.last_end - started
        self.due = False
        _note_refresh(self.run_dir)
        self.refreshes += 1
        self.seconds += self.last_duration
        if self.report_pause is not None:
            self.report_pause(self.last_duration)

    def summary(self) -> dict:
        """For training_info.json: how often the report was refreshed during training and what it cost."""
        training = (self.ended if self.ended is not None else self.clock()) - self.started
        return {"refreshes": self.refreshes, "seconds": round(self.seconds, 2),
                "share_of_training": round(self.seconds / max(training, 1e-9), 5)}
