"""One job per run directory: a second launch into a live run is refused in one line and changes nothing; a hold
whose holder died is taken over and the relaunch resumes; a hold from another machine counts while its heartbeat
beats."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files, seams
from src.run_safety.build_once import COMPLETE_MARKER
from src.run_safety.checkpoints import checkpoint_step, newest_complete_checkpoint
from src.run_safety.run_lock import STALE_AFTER_S, RunDirectoryHeld, acquire, hold_path, identity
from test_resilience import job_args, start_launcher, train_losses, wait_for, worker_pid


def complete_checkpoint_from(model_dir, step: int):
    """The newest complete checkpoint once there is one at `step` or later (a given one may be rotated out between
    two looks)."""
    newest = newest_complete_checkpoint(model_dir)
    return newest if newest and checkpoint_step(newest) >= step else None


def test_a_second_launch_into_a_live_run_is_refused_and_a_dead_holder_is_taken_over(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(120))
    results, run_dir = tmp_path / "results", tmp_path / "results" / "job"
    args = job_args(tiny_model, data, results, steps=5000, save_steps=5)  # far longer than the test: killed midway
    first = start_launcher(args, tmp_path / "first.txt")
    try:
        wait_for(lambda: complete_checkpoint_from(run_dir / "model", 10), what="a complete checkpoint")
        holder = json.loads(hold_path(run_dir).read_text())
        second = subprocess.run(["bash", "run_distributed.sh", "2", *args], cwd=PROJECT_ROOT,
                                env=os.environ | {"PYTHON": sys.executable}, capture_output=True, text=True,
                                timeout=300)
        assert first.poll() is None, "the first job must still be training for the refusal to mean anything"
        assert second.returncode == 2, second.stderr[-3000:]
        (line,) = [line for line in second.stderr.splitlines() if line.strip()]
        assert line.startswith(f"error: {run_dir} is in use by another job: host {socket.gethostname()}, pid "
                               f"{holder['pid']} (torchrun pid "), line
        assert f"since {holder['since']}" in line and "--run_name" in line
        # The job dies without a word (its hold file stays behind): every process of it, workers included
        # (torchrun gives each worker a process group of its own).
        workers = [worker_pid(rank, first) for rank in (0, 1)]
        os.killpg(first.pid, signal.SIGKILL)
        for pid in filter(None, workers):
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        os.killpg(first.pid, signal.SIGKILL) if first.poll() is None else None
    # The refused launch changed nothing: the live job logged every step once, in order, on its own.
    steps = [record["step"] for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
    assert steps == list(range(1, len(steps) + 1))
    assert run_files.read_json(run_dir / run_files.TRAINING_INFO)["resumes"] == []
    assert hold_path(run_dir).exists()
    newest = max(int(path.name.split("-")[1]) for path in (run_dir / "model").glob("checkpoint-*")
                 if (path / COMPLETE_MARKER).exists())

    # Stopped the clean way 3 steps after it resumed: SIGTERM to its process group from a seam (rank 0, that step's end).
    stopped = tmp_path / "stopped"
    relaunched = start_launcher(args, tmp_path / "relaunched.txt",
                                **seams.env({}, kill_starter=f"step:{newest + 3}:{stopped}:TERM"))
    try:
        relaunched.wait(timeout=600)
    finally:
        os.killpg(relaunched.pid, signal.SIGKILL) if relaunched.poll() is None else None
    assert stopped.exists(), (tmp_path / "relaunched.txt").read_text()[-3000:]
    assert "took over the hold of a job that is gone" in (tmp_path / "relaunched.txt").read_text()
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["status"] == "stopped" and info["resumes"][0]["from_step"] == newest
    steps = sorted(train_losses(run_dir))
    assert steps == list(range(1, len(steps) + 1)), "the curve continues from the checkpoint, each step once"
    assert not hold_path(run_dir).exists(), "a job that ends releases its hold"


def other_machine(path, age_s: float) -> dict:
    holder = {"host": "gpu-node-7", "boot_id": "another-boot", "pid": 4242, "job": "torchrun pid 4200 on gpu-node-7",
              "since": "2026-11-20T08:00:00+00:00"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(holder))
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return holder


def test_a_hold_from_another_machine_counts_while_its_heartbeat_beats(tmp_path):
    run_dir = tmp_path / "results" / "job"
    other_machine(hold_path(run_dir), age_s=5)
    with pytest.raises(RunDirectoryHeld, match=r"in use by another job: host gpu-node-7, pid 4242 .*since "
                                               r"2026-11-20T08:00:00\+00:00, last heartbeat \d s ago"):
        acquire(run_dir)
    assert not run_dir.exists(), "a refused launch touches nothing"

    other_machine(hold_path(run_dir), age_s=STALE_AFTER_S + 30)  # that machine was lost: its heartbeat stopped
    hold = acquire(run_dir)
    try:
        assert "gpu-node-7" in hold.took_over and "heartbeat stopped" in hold.took_over
        assert json.loads(hold_path(run_dir).read_text())["pid"] == os.getpid()
    finally:
        hold.release()
    assert not hold_path(run_dir).exists()


def test_a_torchrun_restart_is_the_same_job(tmp_path, monkeypatch):
    """A restarted rank 0 has a new pid but the same torchrun agent: it takes its own hold back. A hold of another
    agent on this machine that is still alive (this test's parent process stands in for it) is refused."""
    run_dir = tmp_path / "results" / "job"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    earlier = identity() | {"pid": 999999, "pid_start": "1", "since": "2026-11-23T10:00:00+00:00"}  # the dead rank 0
    hold_path(run_dir).parent.mkdir(parents=True)
    hold_path(run_dir).write_text(json.dumps(earlier))
    hold = acquire(run_dir)
    try:
        recorded = json.loads(hold_path(run_dir).read_text())
        assert recorded["pid"] == os.getpid() and recorded["since"] == earlier["since"] and hold.took_over is None
    finally:
        hold.release()

    other = earlier | {"job": "torchrun pid 1 on elsewhere", "agent_pid": os.getppid(),
                       "agent_start": identity()["agent_start"]}
    hold_path(run_dir).write_text(json.dumps(other))
    with pytest.raises(RunDirectoryHeld, match="in use by another job"):
        acquire(run_dir)


def test_a_holder_left_a_zombie_is_gone(tmp_path):
    """A killed job whose parent died too stays a zombie where nothing reaps orphans (a container without an init):
    its /proc entry remains, but it trains nothing, so its hold is taken over."""
    run_dir = tmp_path / "results" / "job"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        alive = identity() | {"job": "torchrun pid 1 on here", "pid": child.pid,
                              "pid_start": Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]}
        alive.pop("agent_pid", None)
        hold_path(run_dir).parent.mkdir(parents=True)
        hold_path(run_dir).write_text(json.dumps(alive))
        with pytest.raises(RunDirectoryHeld, match="in use by another job"):
            acquire(run_dir)
        child.kill()
        deadline = time.monotonic() + 10  # killed but not reaped (no wait() yet): a zombie
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child did not become a zombie"
            time.sleep(0.05)
        hold = acquire(run_dir)
        try:
            assert hold.took_over and f"its process {child.pid} is gone" in hold.took_over
        finally:
            hold.release()
    finally:
        child.kill()
        child.wait()


def test_a_job_whose_launcher_is_gone_is_waited_for_and_taken_over(tmp_path, capsys):
    """`kill -9` of the launcher: its torchrun agent is gone and its rank 0, still saving, stops within seconds
    (src/run_safety/parent_watch.py). The same command relaunched right away waits for it instead of refusing, then
    takes the hold over."""
    run_dir = tmp_path / "results" / "job"
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    agent.wait()  # gone
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        start = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        holder = identity() | {"job": f"torchrun pid {agent.pid} on here", "pid": worker.pid, "pid_start": start,
                               "agent_pid": agent.pid, "agent_start": "1"}
        hold_path(run_dir).parent.mkdir(parents=True)
        hold_path(run_dir).write_text(json.dumps(holder))
        started = time.monotonic()
        hold = acquire(run_dir)
        try:
            assert 0.5 < time.monotonic() - started < 10
            assert hold.took_over and f"its process {worker.pid} is gone" in hold.took_over
        finally:
            hold.release()
    finally:
        worker.kill()
        worker.wait()
    assert "lost its launcher; waiting up to" in capsys.readouterr().out
