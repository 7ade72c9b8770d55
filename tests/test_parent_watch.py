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
from test_resilience import TAG, kill_tagged, seconds_until_gone, tagged_processes

# A parent that starts a helper in a session of its own (as check_gpu starts its bandwidth worker), which starts a
# child of its own (as the worker starts its ranks) and watches its parent; the parent then waits to be killed.
PARENT = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
from src.run_safety.parent_watch import exit_with_parent
exit_with_parent()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
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
                              env=os.environ | {TAG: tag})
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
