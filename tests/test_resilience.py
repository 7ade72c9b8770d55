"""Nothing lost: real 2-process jobs that lose a worker, are killed mid-save, are preempted with SIGTERM, or
diverge; and secrets that never reach the disk."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forked
import rank_probe
from conftest import PROJECT_ROOT
from src import run_files, seams
from src.config_error import ConfigError
from src.config_parse import parse_config
from src.redaction import redact_secrets
from src.run_safety.build_once import COMPLETE_MARKER
from src.run_safety.checkpoint_manifest import read_manifest, verify
from src.run_safety.checkpoints import checkpoint_step, checkpoints
from src.run_safety.exit_status import ExitStatus


STEPS = 40  # kills land at steps 10-22 (seams: the moment named, on every run): the job is still training


def job_args(model: Path, data: Path, results: Path, steps: int = STEPS, save_steps: int = 10) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", "job", "--batch_size", "8", "--max_steps", str(steps), "--save_steps",
            str(save_steps), "--save_total_limit", "2", "--eval_strategy", "no", "--logging_steps", "1",
            "--num_samples", "2", "--max_new_tokens", "4", "--judge", "none", "--learning_rate", "1e-3",
            "--max_length", "64", "--val_size", "2", "--test_size", "2", "--seed", "5"]


def start_launcher(args: list[str], log: Path, **env) -> subprocess.Popen:
    """./run_distributed.sh 2 ARGS, in its own process group, output to `log`."""
    environ = os.environ | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"} | env
    return subprocess.Popen(["bash", "run_distributed.sh", "2", *args], cwd=PROJECT_ROOT, env=environ,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def one_process_against_two_killed_and_resumed(args_for, results: Path, log: Path,
                                               resumed_on: int = 2) -> tuple[dict, dict, str]:
    """One uninterrupted process against a real 2-process job (forked, tests/forked.py) whose rank 1 is killed right
    after checkpoint-2 (the seam in src/run_safety/checkpoints.py), which stops the job, then the same command
    launched again on `resumed_on` processes (1: the job goes on without the lost one, issue 58): each run's logged
    metrics (without the timings) by the process count it started on, the 2-process run's training_info.json and the
    one-process run's console (its run directory, results/1-process, serves a test's other assertions); both
    2-process launches' output goes to `log`. The launcher's own restart of a killed worker is
    test_lost_worker_restarts_...'s. `args_for(run_name)`: the arguments of each run, writing under `results`."""
    from test_training import run_single

    metrics, info, console = {}, {}, ""
    for nproc in (1, 2):
        name = f"{nproc}-process"
        if nproc == 1:
            result = run_single(args_for(name))
            assert result.returncode == 0, result.stderr[-4000:]
            console = result.stdout
        else:
            killed = log.with_name("killed")
            environment = os.environ | {"OMP_NUM_THREADS": "1"}
            first = forked.run_job(2, args_for(name), timeout=600,
                                   env=seams.env(environment, kill_at_checkpoint=f"after_complete:2:1:{killed}"))
            again = forked.run_job(resumed_on, args_for(name), env=environment, timeout=600)
            log.write_text("".join((first.stdout, first.stderr, again.stdout, again.stderr)))
            assert killed.exists() and first.returncode != 0, "the seam never fired: the test proves nothing"
            assert again.returncode == 0, log.read_text()[-3000:]
            info = run_files.read_json(results / name / run_files.TRAINING_INFO)
            assert [resume["from_step"] for resume in info["resumes"]] == [2] and info["world_size"] == resumed_on
            assert info["resumes"][0]["saved_by"]["world_size"] == 2
        metrics[nproc] = [{key: value for key, value in record.items()
                           if not key.startswith(("perf/", "time", "train_", "eval_runtime", "eval_samples", "epoch",
                                                  "eval_steps", "total_flos"))
}
                          for record in run_files.read_jsonl(results / name / run_files.METRICS)]
    return metrics, info, console


def worker_pid(rank: int, launcher: subprocess.Popen) -> int | None:
    """The pid of this launch's training worker with this RANK: a child of its torchrun, itself a child of
    run_distributed.sh (the launcher's pid). Only those count: a stray process elsewhere on the machine with the same
    command line and RANK (another job, a forked helper) must never be the one a test kills."""
    def parent_of(entry: Path) -> int:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])

    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = parent_of(entry)
            grandparent = parent_of(Path("/proc") / str(parent))
        except (OSError, ValueError, IndexError):
            continue
        if (grandparent == launcher.pid and b"src.main_distributed" in command and b"--dry_run" not in command
                and f"RANK={rank}".encode() in environ):
            return int(entry.name)
    return None


def run_tag(environ: bytes) -> str | None:
    """The seam run_tag in a process's /proc/<pid>/environ (None when it has none)."""
    prefix = f"{seams.VARIABLE}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return json.loads(entry[len(prefix):]).get("run_tag")
    return None


def tagged_processes(tag: str) -> dict[int, str]:
    """The live processes (pid: command line) whose environment carries the seam run_tag=tag (planted in a launch's
    environment: every process it starts inherits it): every process of that launch, those that left its process
    group or session (torchrun's workers, pool workers) included. Zombies run nothing."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if (not entry.name.isdigit() or run_tag((entry / "environ").read_bytes()) != tag
                    or (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")):
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except (OSError, IndexError, ValueError):  # gone, or not ours to read
            continue
    return found


def seconds_until_gone(tag: str, within: float = 10.0) -> float:
    """How long the processes of launch `tag` took to end; fails if any is still there `within` seconds on (and
    kills it: a failed test leaves nothing running)."""
    started = time.monotonic()
    while (left := tagged_processes(tag)) and time.monotonic() - started < within:
        time.sleep(0.1)
    if left:
        kill_tagged(tag)
        raise AssertionError(f"still running {within:.0f} s after the kill: {left}")
    return time.monotonic() - started


def kill_tagged(tag: str) -> None:
    for pid in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(condition, timeout: float = 240, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def train_losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS)
            if "loss" in record}


# Secrets in the environment of the three launches of stopped_twice_run (test_secrets_never_reach_the_run_directory
# reads their files and consoles).
SECRETS = {"HF_TOKEN": "hf_SECRETtoken123", "WANDB_API_KEY": "wandbSECRET456", "MY_SERVICE_API_KEY": "sk-SECRET"}


@pytest.fixture(scope="module")
def reference_losses(tiny_model, tmp_path_factory):
    """The same job on two processes, never interrupted: what a resumed job's curve must match. Forked
    (tests/forked.py): the launcher's part is the kills and restarts of the tests below, not this curve.
    (data, losses)"""
    from conftest import preference_rows, write_jsonl

    root = tmp_path_factory.mktemp("reference")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(120))
    result = forked.run_job(2, job_args(tiny_model, data, root / "results"), env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return data, train_losses(root / "results" / "job")


def assert_finished_like_the_reference(run_dir: Path, reference: dict[int, float], steps: int = STEPS):
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["status"] == "completed" and info["summary"]["completed_steps"] == steps
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, steps + 1)), "the curve must continue, each step logged once"
    assert [losses[step] for step in sorted(losses)] == pytest.approx(
        [reference[step] for step in sorted(reference)], rel=1e-4, abs=1e-6)
    return info


@pytest.fixture(scope="module")
def twice_killed_run(tiny_model, reference_losses, tmp_path_factory):
    """One launch whose workers are killed twice, each at a named moment (the seam kill_at_checkpoint: the
    same moment on every run, not a race with a polling test), and that torchrun restarts each time: rank 0 dies with
    checkpoint-10's pieces written and its completion marker not yet; after that restart, rank 1 dies right after
    checkpoint-20 is complete. Serves the two tests below. (the run directory, its training_info.json)"""
    data, reference = reference_losses
    root = tmp_path_factory.mktemp("twice_killed")
    mid_save, after_save = root / "killed-mid-save", root / "killed-after-save"
    process = start_launcher(job_args(tiny_model, data, root / "results", save_steps=5), root / "log.txt",
                             **seams.env({}, kill_at_checkpoint=f"before_complete:10:0:{mid_save},"
                                                                f"after_complete:20:1:{after_save}"))
    try:
        assert process.wait(timeout=600) == 0, (root / "log.txt").read_text()[-3000:]
    finally:
        os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
    assert mid_save.exists() and after_save.exists(), "a seam never fired: the test proves nothing"
    run_dir = root / "results" / "job"
    info = assert_finished_like_the_reference(run_dir, reference)
    assert len(info["resumes"]) == 2, info["resumes"]
    return run_dir, info


def test_killed_while_saving_never_resumes_from_the_half_written_checkpoint(twice_killed_run):
    run_dir, info = twice_killed_run
    first = info["resumes"][0]
    assert first["from_step"] == 5 and first["previous_status"] == "running"
    assert str(run_dir / "model" / "checkpoint-10") in first["removed_incomplete_checkpoints"]


def test_lost_worker_restarts_and_resumes_from_the_newest_complete_checkpoint(twice_killed_run):
    _, info = twice_killed_run
    second = info["resumes"][1]
    assert second["from_step"] == 20 and second["previous_status"] == "running"


TERM_THEN_KILL_AT = 22  # launch 2's kill; its stop lands a few steps later, well before STEPS


@pytest.fixture(scope="module")
def stopped_twice_run(tiny_model, reference_losses, tmp_path_factory):
    """The same command launched three times into one run directory:
    1. SIGTERM to the launcher's whole process group at the end of step 12 (a seam: rank 0 sends it, no polling race),
       what a scheduler does to the whole job before preempting it;
    2. relaunched, `kill -9` of its launcher's process group at the end of step TERM_THEN_KILL_AT (a seam: rank 0
       kills it; a terminal's kill, an OOM kill of torchrun's agent): the workers, in sessions of their own, must see
       their agent gone and stop as on SIGTERM;
    3. relaunched right away: it takes the hold over and finishes.
    Each launch has SECRETS in its environment. Serves the three tests below. (the run directory; after launch 1, its
    training_info.json, the steps of its complete checkpoints and report.md's first line; training_info.json at the
    end; the three consoles; how long launch 2's processes took to end after its kill)"""
    data, reference = reference_losses
    root = tmp_path_factory.mktemp("stopped_twice")
    run_dir = root / "results" / "job"
    args = job_args(tiny_model, data, root / "results", save_steps=50)
    signalled, killed = root / "signalled", root / "killed"
    logs = [root / f"log{number}.txt" for number in (1, 2, 3)]
    launches = []
    try:
        launches.append(start_launcher(args, logs[0], **seams.env({}, kill_starter=f"step:12:{signalled}:TERM"),
                                       **SECRETS))
        launches[0].wait(timeout=600)
        assert signalled.exists(), "the seam never fired: the test proves nothing"
        after_sigterm = run_files.read_json(run_dir / run_files.TRAINING_INFO)
        report_line = (run_dir / "report.md").read_text().split("\n", 1)[0]
        complete_after_sigterm = [checkpoint_step(path) for path in checkpoints(run_dir / "model")
                                  if (path / COMPLETE_MARKER).exists()]

        launches.append(start_launcher(args, logs[1], **seams.env({}, kill_starter=f"step:{TERM_THEN_KILL_AT}:{killed}",
                                                                         run_tag=f"{root}-second"), **SECRETS))
        launches[1].wait(timeout=600)
        assert killed.exists(), "the seam never fired: the test proves nothing"
        third = seams.env({}, run_tag=f"{root}-third")
        launches.append(start_launcher(args, logs[2], **third, **SECRETS))  # right away
        gone_after = seconds_until_gone(f"{root}-second")
        assert launches[2].wait(timeout=600) == 0, logs[2].read_text()[-3000:]
    finally:
        for process in launches:
            os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        kill_tagged(f"{root}-second")
    info = assert_finished_like_the_reference(run_dir, reference)
    assert len(info["resumes"]) == 2, info["resumes"]
    return (run_dir, after_sigterm, complete_after_sigterm, info, report_line, [log.read_text() for log in logs],
            gone_after)


def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes(stopped_twice_run):
    _, after_sigterm, complete_after_sigterm, info, report_line, consoles, _ = stopped_twice_run
    assert after_sigterm["status"] == "stopped" and "stopped by SIGTERM at step" in after_sigterm["stop_reason"]
    stopped_at = int(after_sigterm["stop_reason"].split("at step ")[1].split(":")[0])
    assert 12 <= stopped_at < TERM_THEN_KILL_AT
    assert stopped_at in complete_after_sigterm
    assert "run the same command" in consoles[0]
    assert report_line.startswith(f"**stopped** (by SIGTERM) at step {stopped_at} of ")
    assert info["resumes"][0]["from_step"] == stopped_at and info["resumes"][0]["previous_status"] == "stopped"


def test_a_killed_launcher_stops_its_workers_as_sigterm_does_and_the_same_command_resumes(stopped_twice_run):
    """Launch 2's processes end within seconds of its launcher's kill -9, having saved a complete checkpoint and
    marked the run stopped; launch 3, started right away, takes the hold over and finishes with the curve of the run
    left alone (asserted by the fixture)."""
    _, _, _, info, _, consoles, gone_after = stopped_twice_run
    print(f"the killed launch's processes ended {gone_after:.1f} s after the kill")
    resume = info["resumes"][1]
    assert resume["previous_status"] == "stopped" and TERM_THEN_KILL_AT < resume["from_step"] < STEPS, resume
    assert f"stopped by the loss of its launcher at step {resume['from_step']}: checkpoint" in consoles[1]


def test_a_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_model, reference_losses, tmp_path):
    """Rank 1 of a 2-process job gets a NaN weight before step 13: the job stops at step 13 on every rank, saves
    nothing from it, says so, and a relaunch refuses to continue from a diverged run."""
    import torch
    from safetensors.torch import load_file

    data, _ = reference_losses
    results = tmp_path / "results"
    environ = os.environ | {"OMP_NUM_THREADS": "1", "PROBE_NAN_AT_STEP": "12", "PROBE_NAN_RANK": "1"}
    result = forked.run_job(2, [str(tmp_path / "probe"), *job_args(tiny_model, data, results, save_steps=5)],
                            env=environ, entry=rank_probe.entry)  # 2 processes as one job (tests/rank_probe.py)
    assert result.returncode != 0
    assert "training diverged at step 13 (loss nan (rank 1)" in result.stderr, result.stderr[-3000:]
    run_dir = results / "job"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["status"] == "diverged" and "last good checkpoint is" in info["stop_reason"]
    saved = [checkpoint_step(path) for path in checkpoints(run_dir / "model")]
    assert saved and max(saved) == 10 and all((path / COMPLETE_MARKER).exists()
                                              for path in checkpoints(run_dir / "model"))
    weights = load_file(run_dir / "model" / "checkpoint-10" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert not (run_dir / "model" / "final").exists()
    assert math.isnan(train_losses(run_dir)[13])
    status = (run_dir / "report.md").read_text().split("\n", 1)[0]
    assert status.startswith("**diverged** (loss nan (rank 1)") and f") at step 13 of {STEPS} ({100 * 13 / STEPS:.0f}%) · elapsed" in status
    assert "| [job](job/report.md) | diverged 13/" in (results / "index.md").read_text()

    again = forked.run_main(job_args(tiny_model, data, results, save_steps=5), timeout=120)
    assert again.returncode == 4 and "Traceback" not in again.stderr
    assert "training diverged at step 13" in again.stderr


def test_a_damaged_checkpoint_is_named_and_skipped_for_the_newest_intact_one(tiny_model, reference_losses, tmp_path):
    """The issue's reproduction on a real 2-process job (forked): killed whole right after checkpoint-15 (saving every
    5 steps, 2 kept: checkpoints 10 and 15), then checkpoint-15's weights cut to half.
    1. With checkpoint-10's optimizer state altered by one byte too, no checkpoint is intact: the relaunch stops in one
       line naming both, exit status 8, no traceback, nothing changed (a copy can still be restored).
    2. With that byte put back, the relaunch names checkpoint-15 in one line, sets it aside, resumes from checkpoint-10
       and finishes with the curve of the job never interrupted; its final model carries a manifest too."""
    data, reference = reference_losses
    results = tmp_path / "results"
    run_dir, model = results / "job", results / "job" / "model"
    args = job_args(tiny_model, data, results, save_steps=5)
    environ = os.environ | {"OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    first = forked.run_job(2, args, env=seams.env(environ, kill_at_checkpoint=f"after_complete:15:*:{killed}"))
    assert first.returncode != 0 and Path(f"{killed}.rank1").exists(), "the seam never fired: the test proves nothing"
    assert [checkpoint_step(path) for path in checkpoints(model)] == [10, 15]
    recorded = read_manifest(model / "checkpoint-15")["files"]  # each rank's files: rank 1's RNG state among them
    assert {"model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(recorded)

    weights, optimizer = model / "checkpoint-15" / "model.safetensors", model / "checkpoint-10" / "optimizer.pt"
    os.truncate(weights, weights.stat().st_size // 2)
    intact = optimizer.read_bytes()
    optimizer.write_bytes(intact[:1000] + bytes([intact[1000] ^ 1]) + intact[1001:])
    metrics = (run_dir / run_files.METRICS).read_text()

    refused = forked.run_job(2, args, env=environ)
    assert refused.returncode == ExitStatus.DAMAGED and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {model} has no intact checkpoint to resume from: checkpoint-15: model.safetensors has ")
    assert "(cut short); checkpoint-10: optimizer.pt differs from what was saved (bytes 0 to " in errors[0]
    assert [checkpoint_step(path) for path in checkpoints(model)] == [10, 15]
    assert (run_dir / run_files.METRICS).read_text() == metrics

    optimizer.write_bytes(intact)
    resumed = forked.run_job(2, args, env=environ)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    saved = recorded["model.safetensors"]["bytes"]
    assert (f"  warning: {model / 'checkpoint-15'} is damaged (model.safetensors has {saved // 2:,} bytes of the "
            f"{saved:,} saved (cut short)): set aside as damaged-checkpoint-15; resuming from checkpoint-10, the "
            "newest intact checkpoint\n") in resumed.stdout
    info = assert_finished_like_the_reference(run_dir, reference)
    assert info["resumes"][-1]["from_step"] == 10 and (model / "damaged-checkpoint-15").is_dir()
    assert read_manifest(model / "final") is not None and verify(model / "final", threads=1) is None


def test_secrets_never_reach_the_run_directory(stopped_twice_run):
    """The three launches of one run directory (2 processes under the launcher: stopped by SIGTERM, killed, resumed
    to the end) had SECRETS in their environment: none is in any file they wrote nor on their consoles."""
    run_dir, *_, consoles, _ = stopped_twice_run
    for path in run_dir.parent.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for value in SECRETS.values():
                assert value.encode() not in content, f"{value} found in {path}"
    assert "Traceback" not in consoles[2] and "job" in consoles[2]
    for console in consoles:
        for value in SECRETS.values():
            assert value not in console


def test_tokens_are_refused_as_flags_and_redacted_from_records():
    with pytest.raises(ConfigError, match="hub_token.*HF_TOKEN environment variable"):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--hub_token", "hf_abc"])
    record = {"learning_rate": 1e-5, "wandb_api_key": "k", "nested": {"HF_TOKEN": "t", "pad_token": "<pad>"},
              "max_new_tokens": 32, "hub_token": None}
    assert redact_secrets(record) == {"learning_rate": 1e-5, "wandb_api_key": "<redacted>",
                                      "nested": {"HF_TOKEN": "<redacted>", "pad_token": "<pad>"},
                                      "max_new_tokens": 32, "hub_token": None}
    assert json.dumps(redact_secrets(record)).count("<redacted>") == 2
