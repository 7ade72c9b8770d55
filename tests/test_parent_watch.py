"""No process outlives its job (src/run_safety/parent_watch.py): a helper whose parent is killed exits at once, with
the processes it started. The launches killed at a moment of training, a round's sampling, its reference pass and a
preparation are in test_resilience.py, test_rounds.py and test_data.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import PROJECT_ROOT
from src import seams
from test_resilience import kill_tagged, seconds_until_gone, tagged_processes

# A parent that starts a helper in a session of its own (as check_gpu starts its bandwidth worker), which starts a
# child of its own (as the worker starts its ranks) and watches its parent; the parent then waits to be killed.
PARENT = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
from src.run_safety.parent_watch import exit_with_parent
exit_with_parent()
child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(120)"],
                         stdout=subprocess.PIPE)
child.stdout.readline()  # running its own code: Popen returns mid-exec, before /proc shows the child's environment
print("ready", flush=True)
time.sleep(120)
'''], start_new_session=True, stdout=subprocess.PIPE, text=True)
helper.stdout.readline()
print(helper.pid, flush=True)
time.sleep(120)
"""


def test_a_helper_whose_parent_is_killed_exits_at_once_with_what_it_started(tmp_path):
    tag = f"{tmp_path}-helper"
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True,
                              env=seams.env(run_tag=tag))
    try:
        helper = int(parent.stdout.readline())
        assert len(tagged_processes(tag)) == 3  # the parent, the helper, its child
        assert os.getpgid(helper) == helper  # its own session: a kill of the parent's group would not reach it
        parent.kill()
        parent.wait()
        assert seconds_until_gone(tag, within=5) < 2
    finally:
        parent.kill()
        kill_tagged(tag)


def test_a_kill_9_of_the_launcher_script_alone_stops_its_torchrun(tmp_path):
    """`kill -9` of run_distributed.sh's own process (not its group): torchrun, which it started, gets SIGTERM (and
    stops its workers as on a scheduler's stop) instead of training on, orphaned. torchrun is played by a process that
    waits: the launcher's own lines run, through the real `python -m src.run_safety.parent_watch` it launches with.
    The killed launch's directory under TMPDIR is removed by the next launch; a live launch's is kept."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    live = temporary / "prefkit-launch.live"  # a launch still running: this test's own process stands for it
    live.mkdir()
    (live / "launcher").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    started = tmp_path / "torchrun.pid"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  "-m src.main_distributed --dry_run"*) exit 0 ;;  # the preflight: nothing to check here
  "-m torch.distributed.run"*) echo $$ > {started}; exec sleep 120 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    fake.chmod(0o755)
    environment = os.environ | {"PYTHON": str(fake), "TMPDIR": str(temporary)}
    launcher = subprocess.Popen([str(PROJECT_ROOT / "run_distributed.sh"), "2"], cwd=PROJECT_ROOT, env=environment,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    torchrun = None
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        torchrun = int(started.read_text())
        os.kill(launcher.pid, signal.SIGKILL)  # the script alone: its group (torchrun's too) is left
        launcher.wait()
        deadline = time.monotonic() + 5
        while _alive(torchrun) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(torchrun), "torchrun outlived the launcher that started it"
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if _alive(launcher.pid) else None
        if torchrun and _alive(torchrun):
            os.kill(torchrun, signal.SIGKILL)
    (killed,) = set(temporary.glob("prefkit-launch.*")) - {live}  # what a kill -9 leaves: no trap ran
    assert (killed / "launcher").read_text().split()[0] == str(launcher.pid)
    subprocess.run([str(PROJECT_ROOT / "run_distributed.sh"), "2", "--dry_run"], cwd=PROJECT_ROOT, env=environment,
                   check=True, capture_output=True, timeout=60)
    assert list(temporary.glob("prefkit-launch.*")) == [live], "the killed launch's directory is removed, the live kept"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) is gone for this purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_time(pid: int) -> str:
    """A process's start time as run_distributed.sh records it (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[19]
