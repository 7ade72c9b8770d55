"""One job per run directory: a hold file next to it, kept alive by a heartbeat.

A second launch into a run directory that a live job trains into (a double-submitted Slurm job, a requeue while the
old job still runs, two terminals) would take the live run for an interrupted one: delete its newest checkpoint as
"incomplete", cut back its metrics, and train into the same files. It is refused instead, before it touches anything,
in one line that names the holder.

- The hold is `<results_dir>/.<run_name>.job` (next to the run directory, so `--overwrite` cannot delete it): a small
  JSON record (job, host, pid, since) created with `link()`, which is atomic on NFS too, unlike `O_EXCL` on old NFS
  clients and unlike `flock`, which many NFS setups do not honour across machines.
- The holder touches it every HEARTBEAT_S seconds (rank 0, a daemon thread). A hold is stale, and taken over, when its
  holder is gone: where its processes are visible (same host name, boot id and PID namespace) when neither the
  recorded process nor its torchrun agent is alive; from anywhere else when its heartbeat is older than STALE_AFTER_S
  by the storage's own clock (a file written now gives it, so machines with skewed clocks agree). Anywhere else
  includes another container of the same machine: pods with host networking share the host name, every container
  shares the boot id, but a PID namespace of its own (Docker's default, a Kubernetes pod, `unshare --pid`) hides the
  holder's pid, so "its process is gone" would be a guess.
- A job whose launcher was killed (its agent gone, its workers stopping: src/run_safety/parent_watch.py) is waited
  for, up to the workers' grace, so the same command relaunched right away resumes instead of being refused.
- A torchrun restart of the job is the same job: the job is torchrun's agent (host, boot, agent pid; or an explicit
  `--rdzv_id` with its master address), not the worker's pid, so the restarted rank 0 takes its own hold back.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from src.config_error import ConfigError
from src.run_safety.parent_watch import GRACE_S

HEARTBEAT_S = float(os.environ.get("PREFKIT_HEARTBEAT_S", "15"))
STALE_AFTER_S = 8 * HEARTBEAT_S  # a heartbeat missed this long: the holder's machine is gone (or frozen)


class RunDirectoryHeld(ConfigError):
    """Another live job holds the run directory: one line, exit 2, nothing touched."""


def hold_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f".{run_dir.name}.job"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's PID namespace (the inode of /proc/self/ns/pid): the pids it records mean something only there."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _process_tag() -> str:
    """Names this process's temporary files apart from those of every other process sharing the directory: two
    containers of one host name may run the same pid (a fresh PID namespace hands out the same small numbers)."""
    return f"{socket.gethostname()}-{_pid_namespace()}-{os.getpid()}"


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process (pids are reused).
    None for a process that is gone, a zombie included: a killed process whose parent died too stays a zombie
    where nothing reaps orphans (a container whose first process is not an init), and it trains nothing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # zombie, dead
        return None
    return fields[19]


def identity(environ=None) -> dict:
    """Who this process is, as the hold records it."""
    environ = os.environ if environ is None else environ
    pid, host, namespace = os.getpid(), socket.gethostname(), _pid_namespace()
    me = {"host": host, "boot_id": _boot_id(), "pid_ns": namespace, "pid": pid, "pid_start": process_start_time(pid),
          "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    where = f"{host} ({me['boot_id'][:8]}, pid namespace {namespace})"  # its pids: those of this PID namespace
    if "TORCHELASTIC_RUN_ID" in environ:  # a torchrun worker: the job is its agent, which outlives restarts
        agent = os.getppid()
        me.update(agent_pid=agent, agent_start=process_start_time(agent))
        run_id = environ["TORCHELASTIC_RUN_ID"]
        me["job"] = (f"torchrun {run_id} at {environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
                     if run_id not in ("", "none") else f"torchrun pid {agent} on {where}")
    else:
        me["job"] = f"pid {pid} on {where}"
    return me


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None, start: str | None) -> bool:
    return bool(pid) and process_start_time(pid) is not None and process_start_time(pid) == start


def storage_now(directory: Path) -> float:
    """The current time by the clock of the filesystem holding `directory` (the NFS server's, on NFS)."""
    probe = directory / f".clock-{_process_tag()}"
    try:
        probe.write_text("")
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        probe.unlink(missing_ok=True)


def heartbeat_age(path: Path) -> float | None:
    try:
        return max(0.0, storage_now(path.parent) - path.stat().st_mtime)
    except OSError:
        return None


def _same_machine(holder: dict) -> bool:
    return holder.get("host") == socket.gethostname() and holder.get("boot_id") == _boot_id()


def _processes_visible(holder: dict) -> bool:
    """Whether the holder's pids are this process's to look up: the same machine, and the same PID namespace on it.
    A hold written without a namespace (an older toolkit) is judged by its heartbeat."""
    return _same_machine(holder) and holder.get("pid_ns") == _pid_namespace()


def why_stale(holder: dict, path: Path) -> str | None:
    """Why `holder` no longer holds the run directory, or None while it may still be training."""
    if _processes_visible(holder):
        if _alive(holder.get("pid"), holder.get("pid_start")) or _alive(holder.get("agent_pid"),
                                                                       holder.get("agent_start")):
            return None
        return f"its process {holder.get('pid')} is gone"
    age = heartbeat_age(path)
    if age is not None and age > STALE_AFTER_S:
        return f"its heartbeat stopped {age:.0f} s ago"
    return None


def _launcher_gone(holder: dict) -> bool:
    """A torchrun job on this machine whose agent is gone while its rank 0 still runs: its workers are stopping
    (src/run_safety/parent_watch.py: at once, or after a clean stop within its grace)."""
    return (_processes_visible(holder) and bool(holder.get("agent_pid"))
            and not _alive(holder.get("agent_pid"), holder.get("agent_start"))
            and _alive(holder.get("pid"), holder.get("pid_start")))


def wait_for_stopping_holder(holder: dict | None) -> None:
    """The same command relaunched right after a kill of the launcher: wait for the old workers' own stop (a few
    seconds) instead of refusing; what is left after the grace is judged as usual."""
    if not holder or not _launcher_gone(holder):
        return
    print(f"  the job holding this run directory lost its launcher; waiting up to {GRACE_S + 10:.0f} s for its "
          f"workers (pid {holder.get('pid')}) to stop", flush=True)
    deadline = time.monotonic() + GRACE_S + 10
    while _alive(holder.get("pid"), holder.get("pid_start")) and time.monotonic() < deadline:
        time.sleep(0.2)


def describe(holder: dict, path: Path) -> str:
    age = heartbeat_age(path)
    beat = f", last heartbeat {age:.0f} s ago" if age is not None else ""
    hidden = _same_machine(holder) and not _processes_visible(holder)
    where = " in another PID namespace of this machine (another container)" if hidden else ""
    return (f"host {holder.get('host')}, pid {holder.get('pid')}{where} ({holder.get('job')}), since "
            f"{holder.get('since')}{beat}")


def _refusal(run_dir: Path, holder: dict, path: Path) -> RunDirectoryHeld:
    return RunDirectoryHeld(
        f"{run_dir} is in use by another job: {describe(holder, path)}. Wait for it to end or stop it (then the same "
        f"command resumes), or pass another --run_name. A hold whose heartbeat stops for {STALE_AFTER_S:.0f} s is "
        f"taken over (its file: {path})")


def check_free(run_dir: Path) -> None:
    """Refuse if another live job holds `run_dir` (read only: for the preflight that precedes the workers)."""
    path = hold_path(run_dir)
    wait_for_stopping_holder(_read(path))
    holder = _read(path)
    if holder and why_stale(holder, path) is None and holder.get("job") != identity()["job"]:
        raise _refusal(run_dir, holder, path)


class Hold:
    """This job's hold on a run directory, its heartbeat, and its release at exit."""

    def __init__(self, path: Path, me: dict, took_over: str | None):
        self.path, self.me, self.took_over = path, me, took_over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-dir-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def ours(self) -> bool:
        holder = _read(self.path)
        return bool(holder) and holder.get("job") == self.me["job"] and holder.get("pid") == self.me["pid"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.ours():
                    os.utime(self.path)  # a NULL utime: the NFS server stamps its own time
            except OSError:
                pass  # a full or flaky disk must not kill the job from here; a missed beat or two is harmless

    def release(self) -> None:
        self._stop.set()
        try:
            if self.ours():
                self.path.unlink()
        except OSError:
            pass


def release_if_held_by(run_dir: Path, pid, host) -> bool:
    """Remove the hold of a job whose rank 0 (`pid` on `host`) cannot release it itself (frozen, and being stopped by
    the hang watch: src/run_safety/hang_watch.py), so the same command relaunched is not refused until its heartbeat
    goes stale. True when removed."""
    path = hold_path(run_dir)
    holder = _read(path)
    if not holder or holder.get("pid") != pid or holder.get("host") != host:
        return False
    path.unlink(missing_ok=True)
    return True


def create_once(path: Path, me: dict) -> bool:
    """Create `path` holding `me` (JSON) atomically, a link of a complete temporary file, so a reader never sees it
    half-written: True when this process created it, False if it exists (the hold; the hang watch's verdict)."""
    temporary = path.with_name(f"{path.name}.{_process_tag()}.tmp")
    temporary.write_text(json.dumps(me))
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)


def acquire(run_dir: Path) -> Hold:
    """Hold `run_dir` for this job (rank 0, before anything is written), or raise RunDirectoryHeld."""
    path, me = hold_path(run_dir), identity()
    path.parent.mkdir(parents=True, exist_ok=True)
    took_over = None
    for _ in range(5):
        if create_once(path, me):
            return Hold(path, me, took_over)
        holder = _read(path)
        if holder is None:  # removed between our link and our read (its job just ended): try again
            time.sleep(0.1)
            continue
        if holder.get("job") == me["job"]:  # a torchrun restart of this job: the hold is already ours
            temporary = path.with_name(f"{path.name}.{_process_tag()}.tmp")
            temporary.write_text(json.dumps(me | {"since": holder.get("since", me["since"])}))
            os.replace(temporary, path)
            return Hold(path, me, None)
        wait_for_stopping_holder(holder)
        reason = why_stale(holder, path)
        if reason is None:
            raise _refusal(run_dir, holder, path)
        # Take the stale hold over: move it aside (one relaunch wins the rename), and put it back if what was moved
        # is not the hold judged stale (another relaunch replaced it meanwhile).
        aside = path.with_name(f"{path.name}.stale-{_process_tag()}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != holder:
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
        else:
            took_over = f"{describe(holder, aside)}: {reason}"
        aside.unlink(missing_ok=True)
    holder = _read(path) or {}
    raise _refusal(run_dir, holder, path)
