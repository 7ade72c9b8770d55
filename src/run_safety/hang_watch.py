"""A stuck rank stops the job in minutes, saying which rank stuck, where, and what it was doing (--hang_timeout).

Without it, a rank that stops answering (a judge that never returns, a data worker that blocks, a generation that
never ends, a filesystem or a GPU that hangs) leaves the others waiting in a collective for the process group's
60-minute timeout, then a message that names the collective, not the cause.

- Every process says what it does: `doing(place, what)` sets its activity (a training step), `phase(place, what)`
  nests one for a while (a generation batch, a judged batch, a preparation chunk, the reference pass, a checkpoint
  save, an evaluation), `waiting(what)` marks a wait for the other ranks (the toolkit's collectives, a preparation
  another process builds); each of these is a beat, kept in memory (no I/O on the training path).
- A watch thread in every process publishes its record (place, what, step, beat count, pid, host) to the board, a
  folder next to the run directory (src/run_safety/hang_board.py: on the storage a multi-node job shares), every
  POLL_S, and reads the others'. A rank whose count has not moved for the timeout (by the reader's own clock: no
  synchronised clocks needed) has stopped. The job has hung when a rank that is not waiting has stopped, or every rank
  has (they all wait on one another).
- Then every process dumps its Python stack to the board (src/run_safety/hang_stacks.py: faulthandler, from C, also a
  process stuck in a C call holding the interpreter's lock, dumped by a signal its peers on the same machine send),
  and the stuck rank is the one that is not inside torch.distributed (src/run_safety/hang_blame.py: a rank waiting in
  a collective for a stuck peer is its victim, not its cause; ties go to a rank inside a nested phase, then to the one
  silent longest).
- The first process to decide writes the verdict and prints one line; every process stops the job
  (src/run_safety/hang_stop.py: the stacks in `<run>/hang/`, rank 0's record and hold, exit ExitStatus.HUNG (7)). A
  process frozen with the interpreter's lock held is killed by its peers on its machine once its stack is written, or
  ends itself from faulthandler's C thread (exit 1) STOP_GRACE_S after the timeout.
- The timeout: `--hang_timeout` seconds at least, and SCALE times the longest pause between two beats this job has
  measured on any rank (a first step's compile, a save to slow storage, a long evaluation batch): an honest pause
  the run has already lived through never reads as a hang. docs/reliability.md says it for users.
- While training, rank 0 says when no step has finished for longer than a few step times (`stalled_line`):
  "no step for 4 min 10 s; rank 1 in the judge", on the console and in the live report's status line
  (`on_stall` listeners), instead of an ETA that no longer means anything.

Test seams (src/seams.py): `stall` = "<place>:<rank or *>[:<nth>][:gil]" blocks that rank forever at its nth entry to
the place (`gil`: in a C call that holds the interpreter's lock); `slow` = ["<place>:<seconds>[:<rank>]", ...] makes
the first entry to a place that long (an honest long phase).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from src import seams
from src.run_safety.hang_blame import describe, effective_timeout, find_stuck, stalled_line
from src.run_safety.hang_board import DONE, UNWATCHED, WAITING, RecordFile, board_for, clear_earlier_boards, \
    read_json, remove_if_all_done
from src.run_safety.hang_stacks import DUMP_SIGNAL, ask_for_stacks, dump_worker_stacks_apart, innermost_toolkit_frame, \
    open_stack_file, read_stacks, stack_size
from src.run_safety.hang_stop import HangStop
from src.run_safety.run_lock import create_once, process_start_time

STOP_GRACE_S = 60.0    # a process frozen with the interpreter's lock held ends itself this long after the timeout
STALL_STEP_TIMES = 5   # "no step for ...": once no step has finished for this many typical step times


def _poll_s(timeout_s: float) -> float:
    return min(5.0, max(0.25, timeout_s / 20))


@dataclass
class _Process:
    """This process's own state: what it does, and the beats' timing."""

    rank: int = 0
    activities: list = field(default_factory=lambda: [["startup", "", ""]])  # [place, what, mode]
    beats: int = 0
    step: int | None = None
    last_beat: float = field(default_factory=time.monotonic)
    longest_pause: float = 0.0
    last_step: float | None = None
    step_times: list = field(default_factory=list)
    entries: dict = field(default_factory=dict)  # place -> times entered (the seams' nth)
    stopping: bool = False
    pid_start: str | None = None  # with the pid, names this process (a pid is reused)

    def beat(self) -> None:
        """Called before the activity changes: the pause that ends here was spent in the activity still on top. A
        wait for others is not a pause of this rank's own (its length is theirs)."""
        now = time.monotonic()
        if self.activities[-1][2] == "":
            self.longest_pause = max(self.longest_pause, now - self.last_beat)
        self.last_beat = now
        self.beats += 1

    def record(self, watch: "_Watch | None") -> dict:
        place, what, mode = self.activities[-1]
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "pid_start": self.pid_start,
                "beats": self.beats,
                "place": place, "what": what, "mode": mode, "depth": len(self.activities), "step": self.step,
                "timeout_s": watch.own_timeout() if watch else None}


_me = _Process()
_watch: list = []  # the running _Watch of this process (none in a dry run, a helper, or with --hang_timeout 0)
_lock = threading.Lock()


# ------------------------------------------------------------------------------------------------ what a rank does


def doing(place: str, what: str = "", step: int | None = None, mode: str = "") -> None:
    """This process's activity from now on (the base of the nested phases): a beat."""
    with _lock:
        _me.beat()
        _me.activities[0] = [place, what, mode]
        if step is not None:
            _me.step = step
        _changed()
    _planted(place)


@contextlib.contextmanager
def phase(place: str, what: str = "", mode: str = ""):
    """A phase nested in the current activity (a batch, a save): a beat on entering and on leaving. `mode`: WAITING
    (for the other ranks: this rank is not the one stuck), UNWATCHED (a download: its length is not a hang)."""
    with _lock:
        _me.beat()
        _me.activities.append([place, what, mode])
        _changed()
    try:
        _planted(place)
        yield
    finally:
        with _lock:
            _me.beat()
            _me.activities.pop()
            _changed()


def waiting(what: str):
    """A wait for the other ranks (a collective, another process's build): this rank is not the one stuck."""
    return phase("collective", what, WAITING)


def beat(what: str | None = None) -> None:
    """Progress inside the current phase (a chunk of rows, an evaluation batch)."""
    with _lock:
        _me.beat()
        if what is not None:
            _me.activities[-1][1] = what
        _changed()


def step_done(step: int) -> None:
    """A training step finished: a beat, and the step time the "no step for ..." line compares with."""
    now = time.monotonic()
    with _lock:
        _me.beat()
        if _me.last_step is not None:
            _me.step_times = (_me.step_times + [now - _me.last_step])[-20:]
        _me.last_step, _me.step = now, step
        _changed()


def training_started(step: int) -> None:
    """Steps are counted from here (a resumed run: from its checkpoint's step)."""
    with _lock:
        _me.last_step, _me.step, _me.step_times = time.monotonic(), step, []


def training_ended() -> None:
    with _lock:
        _me.last_step = None


def stop_watching() -> None:
    """This process has left the job's collectives (its process group is gone, or it is exiting): no peer can wait
    for it any more, and what it does alone from here (rank 0's Hub push) is not judged."""
    with _lock:
        _me.beat()
        _me.activities[:] = [["final", "", DONE]]
    if _watch:
        _watch[0].finished.set()
        faulthandler.cancel_dump_traceback_later()
        _watch[0].publish()
        _watch[0].tidy()


def _changed() -> None:
    """The record on the board, at once (with _lock held): a peer reads where this process is even if it freezes
    the next instant."""
    if _watch:
        _watch[0].write_record()


def wait_if_stopping() -> None:
    """Where the main thread would report an error (a peer gone from a collective): while a hang stops the job, wait
    for the watch to end this process instead of printing a traceback. A peer's stop is seen within a few polls."""
    if not _watch:
        return
    deadline = time.monotonic() + 4 * _watch[0].poll_s + 2
    while not _me.stopping and time.monotonic() < deadline:
        time.sleep(0.1)
    while _me.stopping:
        time.sleep(1)


# ------------------------------------------------------------------------------------------------ test seams


def _planted(place: str) -> None:
    """The test seams `stall` and `slow` at this place (src/seams.py); nothing in a user's run."""
    stall, slow = seams.get("stall"), seams.get("slow")
    if stall is None and slow is None:
        return
    _me.entries[place] = count = _me.entries.get(place, 0) + 1
    rank = int(os.environ.get("RANK", "0"))
    for planted in ([slow] if isinstance(slow, str) else slow or []):
        where, seconds, *ranks = planted.split(":")
        if where == place and count == 1 and (not ranks or int(ranks[0]) == rank):
            time.sleep(float(seconds))
    if stall:
        where, on_rank, *rest = stall.split(":")
        nth = int(rest[0]) if rest and rest[0].isdigit() else 1
        if where == place and on_rank in ("*", str(rank)) and count == nth:
            _stall_forever("gil" in rest)


def stall_if_planted(place: str) -> None:
    """The seam where a place runs outside the rank's own thread (a data preparation pool worker)."""
    _planted(place)


def _stall_forever(hold_the_interpreter: bool) -> None:
    print(f"test seam: stalled at {time.time():.3f}", file=sys.stderr, flush=True)
    if hold_the_interpreter:  # a C call that keeps the interpreter's lock (ctypes.PyDLL does not release it)
        import ctypes

        libc = ctypes.PyDLL(None)
        while True:
            libc.sleep(3600)  # a signal (the stack dump) interrupts it; it goes back to sleep
    while True:
        time.sleep(3600)



# ------------------------------------------------------------------------------------------------ the watch


class _Watch:
    """The thread that publishes this process's record, reads its peers', decides a hang and stops the job."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float, newest_checkpoint,
                 hold=None, on_stop=None):
        self.run_dir, self.rank, self.world_size, self.timeout_s = Path(run_dir), rank, world_size, timeout_s
        self.board = board_for(run_dir)
        self.board.mkdir(parents=True, exist_ok=True)
        self.poll_s = _poll_s(timeout_s)
        self.stopper = HangStop(self.run_dir, self.board, rank, self.poll_s, newest_checkpoint, hold, on_stop)
        self.stack_file = open_stack_file(self.board, rank)
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last moved by this clock)
        self.records: dict[int, dict] = {}
        self.on_stall: list = []
        self.stall_said: float | None = None
        self.dumped = False
        self.record_file = RecordFile(self.board, rank)
        self.finished = threading.Event()  # this process has left the job (stop_watching)
        self.thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)
        os.register_at_fork(after_in_child=_forked_child)

    def own_timeout(self) -> float:
        return effective_timeout(self.timeout_s, _me.longest_pause)

    def job_timeout(self) -> float:
        published = [record.get("timeout_s") or 0 for record in self.records.values()]
        return max([self.own_timeout()] + published)

    def write_record(self) -> dict:
        """This process's record into its board file's memory (with _lock held): a memory copy, no system call, so a
        beat costs microseconds, and its peers on this machine read it through the page cache even once it froze."""
        return self.record_file.write(_me.record(self))

    def publish(self) -> dict:
        """The record written back to the file (other machines read it from the shared storage)."""
        with _lock:
            record = self.write_record()
        self.record_file.flush()
        return record

    def tidy(self) -> None:
        """Any rank, leaving: once every record on the board is done, the board goes (src/run_safety/hang_board.py);
        not while a hang stops the job."""
        if _me.stopping:
            return
        remove_if_all_done(self.board)

    def _run(self) -> None:
        while not self.finished.wait(self.poll_s):
            # A frozen process (a C call that holds the interpreter's lock) cannot run this thread: faulthandler's
            # own thread then dumps its stack and ends it, after the others had their time to decide.
            faulthandler.dump_traceback_later(self.job_timeout() + STOP_GRACE_S + self.poll_s, exit=True,
                                              file=self.stack_file)
            try:
                self._look(self.publish())
            except OSError:
                pass  # a flaky filesystem must not end the job from here; the next poll looks again
        faulthandler.cancel_dump_traceback_later()  # armed by the last poll, if it ran as the process left the job

    def _look(self, own: dict) -> None:
        now = time.monotonic()
        for rank in range(self.world_size):
            record = own if rank == self.rank else read_json(self.board / f"rank{rank}.json")
            if record is None:  # not started yet (the process group's timeout covers one never started), or unread
                continue
            if record.get("mode") == DONE:  # gone from the job's collectives: nobody waits for it
                self.seen.pop(rank, None)
                self.records.pop(rank, None)
                continue
            self.records[rank] = record
            if rank not in self.seen or self.seen[rank][0] != record["beats"]:
                self.seen[rank] = (record["beats"], now)
        verdict = read_json(self.board / "verdict.json")
        if verdict is not None:
            self._stop(verdict)
        if (self.board / "dump").exists() and not self.dumped:  # a hang is being decided: this process will stop
            _me.stopping = True
            self._dump_self()
        timeout = self.job_timeout()
        if any(self.records[rank].get("mode") == UNWATCHED for rank in self.seen):
            return  # a download (the model) takes what it takes: nothing is judged meanwhile
        quiet = {rank: now - moved for rank, (_, moved) in self.seen.items()}
        silent = [rank for rank, quiet_s in quiet.items() if quiet_s >= timeout]
        working = [rank for rank in silent if self.records[rank].get("mode") != WAITING]
        if working or (silent and len(silent) == len(self.seen)):
            self._decide(quiet, timeout)
        if self.rank == 0:
            self._say_if_stalled(now)

    # -- the decision and the stop

    def _dump_self(self) -> None:
        """This process's stack, written by this thread (one dump per file: dumps from two threads at once would
        interleave). The file holds this launch's dumps only; the last one is read."""
        self.dumped = True
        faulthandler.dump_traceback(self.stack_file, all_threads=True)

    def _decide(self, quiet: dict[int, float], timeout: float) -> None:
        """`quiet`: every watched rank's seconds since its last beat; those at `timeout` or more are silent."""
        _me.stopping = True  # from here the watch ends this process: what the main thread meets meanwhile is its echo
        ranks = sorted(self.records)
        sizes = {rank: stack_size(self.board, rank) for rank in ranks}
        create_once(self.board / "dump", {"by": self.rank})  # every watch that runs dumps its own process
        self._dump_self()
        wait_s = max(5.0, 3 * self.poll_s)
        read_stacks(self.board, ranks, sizes, wait_s / 2)
        ask_for_stacks(self.board, self.records, sizes)
        stacks = read_stacks(self.board, ranks, sizes, wait_s / 2)
        stuck = find_stuck(self.records, quiet, stacks, timeout)
        record = self.records[stuck]
        where = innermost_toolkit_frame(stacks.get(stuck) or [])
        verdict = {"rank": stuck, "place": record.get("place"), "what": record.get("what"), "step": record.get("step"),
                   "silent_s": round(quiet[stuck], 1), "timeout_s": round(timeout, 1), "where": where,
                   "pid": record.get("pid"), "pid_start": record.get("pid_start"), "host": record.get("host"),
                   "by": self.rank,
                   "ranks": {str(rank): describe(self.records[rank]) for rank in sorted(self.records)},
                   "description": describe(record)}
        if create_once(self.board / "verdict.json", verdict):
            self.stopper.announce(verdict)
        self._stop(read_json(self.board / "verdict.json") or verdict)

    def _stop(self, verdict: dict) -> None:
        _me.stopping = True
        self.stopper.stop(verdict, self.stack_file)

    # -- "no step for ..."

    def _say_if_stalled(self, now: float) -> None:
        with _lock:
            last_step, step_times = _me.last_step, sorted(_me.step_times)
        if last_step is None:
            return
        typical = step_times[len(step_times) // 2] if step_times else 0.0
        # A few step times (at least a third of the timeout, at most a minute), and always well before the stop
        threshold = min(max(STALL_STEP_TIMES * typical, min(60.0, self.timeout_s / 3)), self.job_timeout() / 2)
        no_step = now - last_step
        if no_step < threshold:
            self.stall_said = None
            return
        if self.stall_said is not None and now - self.stall_said < max(60.0, threshold):
            return
        self.stall_said = now
        silent = {rank: now - moved for rank, (_, moved) in self.seen.items()}
        stuck = find_stuck(self.records, silent, {}) if silent else None
        line = stalled_line(no_step, describe(self.records[stuck]) if stuck is not None else None)
        print(f"  {line}", flush=True)
        for listener in self.on_stall:
            try:
                listener(line)
            except Exception:  # noqa: BLE001  a report that cannot be rewritten now is rewritten at the end
                pass


def _forked_child() -> None:
    """A process forked from a watched one: a preparation pool worker dumps its stack, on request, into a file of its
    own; any other (a live report's drawing, a data loader's worker) none (the inherited handler would write into its
    parent's file)."""
    watch = _watch[0] if _watch else None
    if watch is None:
        return
    _watch.clear()  # its parent's record is its parent's: this process never writes it
    if all(place != "data" for place, _, _ in _me.activities):
        faulthandler.unregister(DUMP_SIGNAL)
        return
    dump_worker_stacks_apart(watch.board, watch.rank)


def start(run_dir: Path, rank: int, world_size: int, timeout_s: float, newest_checkpoint=None, hold=None,
          on_stop=None) -> None:
    """Watch this process and its job (a daemon thread) for --hang_timeout; nothing with a timeout of 0.
    `newest_checkpoint()`: what a relaunch resumes from; `hold`: rank 0's run lock, released at once on a hang stop;
    `on_stop(reason, verdict)`: rank 0 records the stop (training_info.json, the report)."""
    if timeout_s <= 0 or _watch:
        return
    _me.rank, _me.last_beat = rank, time.monotonic()  # the pauses of this launch, from its start
    _me.pid_start = process_start_time(os.getpid())
    watch = _Watch(run_dir, rank, world_size, timeout_s, newest_checkpoint, hold, on_stop)
    _watch.append(watch)
    if rank == 0:  # earlier launches' boards: only this launch's is read
        clear_earlier_boards(run_dir)
    doing("startup")
    watch.publish()
    atexit.register(stop_watching)  # a process that ends by itself is not stuck
    watch.thread.start()


def on_stall(listener) -> None:
    """`listener(line)` on rank 0 when no step has finished for a few step times ("no step for 4 min 10 s; ...")."""
    if _watch:
        _watch[0].on_stall.append(listener)


def remove_on_stall(listener) -> None:
    if _watch and listener in _watch[0].on_stall:
        _watch[0].on_stall.remove(listener)
