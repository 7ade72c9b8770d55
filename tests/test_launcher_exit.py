"""A stop the job chose is recorded for run_distributed.sh and the worker exits 0 (no torchrun restart, no failure
report); outside the launcher, or for a crash, the status is the worker's own."""

import re
from pathlib import Path

import pytest

from src.run_safety import launcher_exit
from src.run_safety.exit_status import FINAL, ExitStatus


@pytest.fixture
def under_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFKIT_EXIT_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "3")
    return tmp_path


@pytest.mark.parametrize("code", FINAL)
def test_a_chosen_stop_is_recorded_and_the_worker_exits_0(under_launcher, code):
    assert launcher_exit.recorded() is None
    assert launcher_exit.settle(code) == 0
    assert (under_launcher / "rank-3").read_text() == f"{int(code)}\n"
    assert launcher_exit.recorded() == code, "a restarted worker finds it"
    assert [path.name for path in under_launcher.iterdir()] == ["rank-3"], "no temporary file left"


@pytest.mark.parametrize("code", [0, 130, 143])
def test_success_and_signals_keep_their_status(under_launcher, code):
    assert launcher_exit.settle(code) == code and launcher_exit.recorded() is None


def test_outside_the_launcher_the_status_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.delenv("PREFKIT_EXIT_DIR", raising=False)
    assert launcher_exit.settle(5) == 5
    monkeypatch.setenv("PREFKIT_EXIT_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # python -m src.main_distributed with the variable left in the shell
    assert launcher_exit.settle(5) == 5 and list(tmp_path.iterdir()) == []


def test_docs_reliability_has_a_row_for_every_exit_status():
    """docs/reliability.md's table follows src/run_safety/exit_status.py: each status has its row, and no row names
    another."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    table = doc[doc.index("### Exit statuses"):]
    rows = {int(number) for row in re.findall(r"^\| ([0-9 /]+) \|", table, re.M) for number in row.split("/")}
    assert rows == {int(status) for status in ExitStatus}


def test_a_record_into_a_removed_launch_directory_leaves_the_status_to_the_worker(under_launcher, monkeypatch):
    """Two ranks of a node stop at once (a lost node): one's record ends the launch and the launcher removes its
    directory while the other writes. That worker exits with its own status instead of a traceback."""
    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(launcher_exit.os, "replace", gone)
    assert launcher_exit.settle(ExitStatus.NODE_LOST) == ExitStatus.NODE_LOST


def test_the_launcher_exits_with_the_recorded_status_when_removing_its_directory_fails(tmp_path):
    """run_distributed.sh runs under `set -e`, where a failing command in the EXIT trap becomes the script's status:
    a lost node's 6 came out as 1 when another worker wrote its record while `rm -rf` removed the launch directory
    ("Directory not empty"). Fakes at the process boundary: `python` (the preflight passes; the launch records 6, as
    a stopped worker does) and an `rm` that fails once, as that race makes it fail."""
    import stat
    import subprocess

    root = Path(__file__).resolve().parents[1]
    fakes = tmp_path / "bin"
    fakes.mkdir()
    (fakes / "python").write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        '  *src.run_safety.parent_watch*) echo 6 >"$PREFKIT_EXIT_DIR/rank-0" ;;\n'
        "  *socket*) echo 29999 ;;\n"
        "  *src.resource_limits*) echo 1 ;;\n"
        "esac\n")
    (fakes / "rm").write_text(
        "#!/usr/bin/env bash\n"
        f'[[ -e {tmp_path}/rm-failed ]] && exec /bin/rm "$@"\n'
        f"touch {tmp_path}/rm-failed\n"
        "echo \"rm: cannot remove '${@: -1}': Directory not empty\" >&2\n"
        "exit 1\n")
    for fake in fakes.iterdir():
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    launches = tmp_path / "tmp"
    launches.mkdir()
    env = {"PATH": f"{fakes}:/usr/bin:/bin", "PYTHON": str(fakes / "python"), "TMPDIR": str(launches)}
    done = subprocess.run(["bash", str(root / "run_distributed.sh"), "2"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == ExitStatus.NODE_LOST, done.stderr
    assert (tmp_path / "rm-failed").exists(), "the fake rm was used"
    assert list(launches.iterdir()) == [], "removed on the second try"


def test_a_watch_stop_from_any_local_rank_ends_its_agent(tmp_path):
    """A lost node seen first by local rank 1: it must end its torchrun agent itself. Left to local rank 0 (as it was),
    the agent restarted the workers, which found the recorded status and exited 0, and the agent then waited at its
    exit barrier for the lost node for 5 minutes (a two-host test in CI). Here the "agent" is a process whose child
    calls end_job; the agent is killed, not left to wait."""
    import signal
    import subprocess
    import sys

    worker = "from src.run_safety import launcher_exit; launcher_exit.end_job(6)"
    agent = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {worker!r}]); time.sleep(60)"
    env = {**__import__("os").environ, "PREFKIT_EXIT_DIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "job", "RANK": "1",
           "LOCAL_RANK": "1"}
    process = subprocess.run([sys.executable, "-c", agent], env=env, cwd=Path(__file__).resolve().parents[1],
                             timeout=30)
    assert process.returncode == -signal.SIGKILL, "killed by its worker, without torchrun's SIGTERM traceback"
    assert (tmp_path / "rank-1").read_text() == "6\n"


def test_one_worker_of_a_node_says_why(under_launcher, tmp_path, monkeypatch):
    assert launcher_exit.says_why(local_rank=1) and not launcher_exit.says_why(local_rank=0), "the first to claim it"
    assert launcher_exit.recorded() is None, "the claim is no exit status"
    monkeypatch.delenv("PREFKIT_EXIT_DIR")  # plain torchrun: local rank 0 says it
    assert launcher_exit.says_why(local_rank=0) and not launcher_exit.says_why(local_rank=1)


def test_what_a_restart_can_cure():
    """A lost worker's peers (gloo's and NCCL's errors, torch.distributed's), a device's or a filesystem's fault: a
    restart may end otherwise. A code or library error, or one raised while handling nothing of the kind: it will not."""
    class DistError(RuntimeError):  # torch.distributed.DistError's name is what is read (this module imports no torch)
        pass

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4503")
    for cured in (gloo, DistError("NCCL communicator was aborted"), OSError(116, "Stale file handle"),
                  RuntimeError("CUDA error: uncorrectable ECC error encountered")):
        assert launcher_exit.restart_can_cure(cured), cured
    try:
        try:
            raise gloo
        except RuntimeError as raised:
            raise ValueError("the batch a dead peer never sent") from raised
    except ValueError as echo:
        assert launcher_exit.restart_can_cure(echo), "raised from a peer's loss: its echo"
    for uncured in (ValueError("Unknown loss type: dapo"), RuntimeError("Can't call numpy() on Tensor that requires grad"),
                    TypeError("forward() got an unexpected keyword argument"), AssertionError()):
        assert not launcher_exit.restart_can_cure(uncured), uncured


@pytest.mark.parametrize("ranks", ["*", "1"])
def test_an_error_a_restart_would_raise_again_stops_the_job_once(ranks, tiny_model, preference_file, tmp_path):
    """`./run_distributed.sh 2` (MAX_RESTARTS 3) whose workers raise a ValueError right before the first step (the
    test seam raise_in): on every rank (`*`), as a library's error about the configuration is, or on rank 1 alone,
    its peer waiting in a collective. The job ends once, with exit 1, the traceback once and one line naming the rank:
    no restart (the plan, printed at each start, printed once), no torchrun failure report."""
    import os
    import subprocess
    import sys

    from src import seams
    from test_training import common_args

    args = common_args(tiny_model, preference_file, tmp_path / "results", "crash", "dpo") + ["--max_steps", "2"]
    result = subprocess.run(["bash", "run_distributed.sh", "2", *args], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=300,
                            env=seams.env(os.environ | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                                                        "MAX_RESTARTS": "3"}, raise_in=f"training:{ranks}"))
    output = result.stdout + result.stderr
    assert result.returncode == ExitStatus.FAILED, output[-4000:]
    assert output.count("Traceback (most recent call last)") == 1, output[-6000:]
    assert output.count("ValueError: raised by the test seam raise_in at training") == 1, output[-6000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "raised ValueError: the job is not restarted" in lines[0], output[-4000:]
    assert ranks == "*" or lines[0].startswith("error: rank 1 "), lines
    assert output.count("\n== DPO") == 1, "started once: not restarted"
    assert "ChildFailedError" not in output and "Killed" not in output, output[-4000:]
    assert result.stderr.rstrip().splitlines()[-1] == lines[0], "the line is the end"
