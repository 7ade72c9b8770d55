"""A full disk: refused at start when the run cannot fit, and one line (no traceback) when a write fails anyway, with
the newest complete checkpoint kept for the relaunch. The results live on a small tmpfs mount (root), or the test
skips outside CI."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

import forked
from conftest import preference_rows, write_jsonl
from src import run_files, seams
from src.run_safety.disk_space import is_write_failure, write_failure_errno
from src.run_safety.exit_status import ExitStatus
from src.run_safety.build_once import COMPLETE_MARKER
from src.run_safety.checkpoints import checkpoint_step, newest_complete_checkpoint
from test_run_lock import complete_checkpoint_from
from test_resilience import job_args, start_launcher, train_losses, wait_for


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs of a few megabytes at tmp_path/small (size set per test through the returned function)."""
    mounted = []

    def mount(size: str) -> Path:
        target = tmp_path / "small"
        target.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                                capture_output=True, text=True)
        if result.returncode:
            if os.environ.get("CI") == "true":
                pytest.fail(f"cannot mount a tmpfs: {result.stderr.strip()} (CI runs as root and must run it)")
            pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_a_run_that_cannot_fit_is_refused_before_training(tiny_model, tmp_path, small_filesystem):
    small = small_filesystem("1m")
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))
    args = job_args(tiny_model, data, small / "results", steps=40, save_steps=5)  # --save_total_limit 2
    result = forked.run_main(args, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --results_dir: this run will write about ") and "× 3 kept" in line, line
    assert "free: keep fewer checkpoints (--save_total_limit 1), or put --results_dir" in line, line
    assert not list((small / "results").rglob("checkpoint-*")), "refused before the first step"


def test_a_disk_that_fills_up_stops_every_rank_in_one_line_and_the_relaunch_resumes(tiny_model, tmp_path,
                                                                                       small_filesystem):
    small = small_filesystem("4m")
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(120))
    results, run_dir = small / "results", small / "results" / "job"
    args = job_args(tiny_model, data, results, steps=5000, save_steps=5)  # far longer than the test
    args[args.index("--save_total_limit") + 1] = "1"
    args[args.index("--logging_steps") + 1] = "5"  # each checkpoint holds the log history: it must fit at start
    launch = start_launcher(args, tmp_path / "first.txt")  # torchrun may restart: it must not, for a full disk
    filler = small / "filler"
    try:
        wait_for(lambda: complete_checkpoint_from(run_dir / "model", 10), what="a complete checkpoint")
        descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)  # another job fills the disk: all it can take
        try:
            while True:
                os.write(descriptor, b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
        finally:
            os.close(descriptor)
        assert launch.wait(timeout=240) == ExitStatus.WRITE_FAILED, (tmp_path / "first.txt").read_text()[-4000:]
    finally:
        os.killpg(launch.pid, signal.SIGKILL) if launch.poll() is None else None
    output = (tmp_path / "first.txt").read_text()
    newest = newest_complete_checkpoint(run_dir / "model")
    assert newest is not None
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: writing to {re.escape(str(run_dir))}\S* failed: no space left on device \([\d.]+ K?B free there\); a "
        rf"relaunch of the same command resumes from {re.escape(str(newest))} \(step {newest.name.split('-')[1]}\): "
        "free space, lower --save_total_limit or move --results_dir, then relaunch", errors[0]), output[-4000:]
    # No rank shows a traceback, torchrun neither restarts the job nor adds its failure report: the line is the end.
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert "restart" not in output.lower() and output.rstrip().endswith(errors[0]), output[-4000:]
    assert [path for path in (run_dir / "model").glob("checkpoint-*") if not (path / COMPLETE_MARKER).exists()] == []
    steps = sorted(train_losses(run_dir))
    assert steps == sorted({1, *range(5, steps[-1] + 1, 5)}), "every logged step once, none lost"

    filler.unlink()
    # Stopped 3 steps after it resumed: SIGTERM to its process group from a seam (rank 0 sends it at that step's end).
    stopped = tmp_path / "stopped"
    relaunched = start_launcher(args, tmp_path / "relaunched.txt",
                                **seams.env({}, kill_starter=f"step:{checkpoint_step(newest) + 3}:{stopped}:TERM"))
    try:
        relaunched.wait(timeout=600)
    finally:
        os.killpg(relaunched.pid, signal.SIGKILL) if relaunched.poll() is None else None
    assert stopped.exists(), (tmp_path / "relaunched.txt").read_text()[-3000:]
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["resumes"][0]["from_step"] == int(newest.name.split("-")[1]), (tmp_path / "relaunched.txt").read_text()


# A failed write at each site, injected (the seam fail_write: src/run_safety/disk_space.py fail_write_if_injected),
# one launch each: every launch but the first resumes from what the previous one's line named, and fails at the next
# site. (what, which write fails: file-name glob[@rank][#n-th write of that process], more environment)
FAILING_WRITES = [
    ("the prepared-data cache (the launcher's preflight)", "dpo-*", {}),
    ("metrics.jsonl (rank 0, between two steps' checks)", "metrics.jsonl#6", {}),
    ("rank 1's share of a checkpoint (its RNG state)", "rng_state_1.pth@1#2", {}),
    ("the trainer state (a checkpoint's last write)", "trainer_state.json#2", {}),
    ("the live report (rank 0, at the step after a checkpoint)", "report.md", {"PREFKIT_LIVE_REPORT_SHARE": "1e9"}),
    ("a tracker's files (TensorBoard, rank 0, before the first step)", "events.out.tfevents*", {}),
    ("training_info.json (rank 0, before the stage's first barrier)", "training_info.json", {}),
    ("the reference log-probs cache (rank 0, between TRL's collectives)", "cache-*.arrow", {}),
    ("the held-out samples (rank 0, after training)", "samples_*.jsonl", {}),
]


def test_a_failed_write_at_any_site_stops_every_rank_in_one_line_and_the_relaunch_resumes(tiny_model, tmp_path):
    """Deterministic: each site in turn, on 2 processes (the first under the launcher, whose preflight it is; the others
    forked as one job, tests/forked.py); exit 5, the one line, no traceback from any rank, no incomplete checkpoint,
    and the next launch resumes from the one the line names."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))
    results, run_dir = tmp_path / "results", tmp_path / "results" / "job"
    args = job_args(tiny_model, data, results, steps=24, save_steps=4) + [
        "--report_to", "tensorboard", "--precompute_ref_log_probs", "true"]
    named_step = None  # the step of the checkpoint the previous launch's line said a relaunch resumes from
    for index, (what, spec, environment) in enumerate(FAILING_WRITES):
        if spec == "cache-*.arrow":  # the cache the earlier launches wrote beside the prepared data: written again
            for cache in (Path(os.environ["PREFKIT_CACHE"]) / "datasets").glob("dpo-*/cache-*.arrow"):
                cache.unlink()
        if index == 0:  # the launcher's own preflight: under the launcher, which ends with the line, no restart
            log = tmp_path / f"launch-{index}.txt"
            launch = start_launcher(args, log, **seams.env({}, fail_write=spec), **environment)
            try:
                status = launch.wait(timeout=300)
            finally:
                os.killpg(launch.pid, signal.SIGKILL) if launch.poll() is None else None
            output = log.read_text()
        else:  # the workers' sites: 2 processes as one job, forked (how the launcher takes exit 5: the test above)
            job = forked.run_job(2, args, env=seams.env(os.environ | {"OMP_NUM_THREADS": "1"} | environment,
                                                              fail_write=spec), timeout=300)
            status, output = job.returncode, job.stdout + job.stderr
        assert status == ExitStatus.WRITE_FAILED, f"{what}: exit {status}\n{output[-4000:]}"
        assert "Traceback" not in output and "ChildFailedError" not in output, f"{what}:\n{output[-4000:]}"
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "failed: no space left on device (" in errors[0], f"{what}:\n{output[-4000:]}"
        assert index or ("restart" not in output.lower() and output.rstrip().endswith(errors[0])), output[-4000:]
        if named_step is not None:
            resumes = run_files.read_json(run_dir / run_files.TRAINING_INFO)["resumes"]
            assert resumes[-1]["from_step"] == named_step, f"{what}: resumed {resumes[-1]}, not {named_step}"
        newest = newest_complete_checkpoint(run_dir / "model")
        if newest is None:
            assert "no complete checkpoint was saved yet, so a relaunch starts afresh" in errors[0], errors[0]
        else:
            assert f"resumes from {newest} (step {newest.name.split('-')[1]})" in errors[0], errors[0]
            assert all((path / COMPLETE_MARKER).exists() for path in (run_dir / "model").glob("checkpoint-*"))
        named_step = int(newest.name.split("-")[1]) if newest else None
    assert named_step == 24, "the last site fails after training, with the last checkpoint complete"

    finished = forked.run_job(2, args, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=300)
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["status"] == "completed" and info["resumes"][-1]["from_step"] == 24, info["resumes"]
    assert sorted(train_losses(run_dir)) == list(range(1, 25)), "every step logged once, none lost"


def fill_after_checkpoint_10_then_run(argv: list[str]) -> int:
    """The toolkit's main, in a forked process whose disk another writer fills once checkpoint-10 is complete:
    deterministic, no race with the test."""
    import src.run_safety.checkpoints as checkpoints
    import src.trainers.checkpointing as checkpointing
    from src.main_distributed import main

    mark_complete = checkpoints.mark_complete

    def mark_then_fill(path: Path, manifest: dict | None) -> None:
        mark_complete(path, manifest)
        if path.name == "checkpoint-10":
            with open(path.parent.parent.parent / "filler", "wb") as filler:
                try:
                    while True:
                        filler.write(bytes(4096))
                        filler.flush()
                except OSError:
                    pass

    checkpoints.mark_complete = checkpointing.mark_complete = mark_then_fill
    return main(argv)


def test_a_failed_write_in_one_process_is_one_line_with_its_exit_status(tiny_model, tmp_path, small_filesystem):
    """Without torchrun: the exit status is ExitStatus.WRITE_FAILED; --debug shows the traceback."""
    small = small_filesystem("4m")
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48))
    args = job_args(tiny_model, data, small / "results", steps=30, save_steps=5)
    result = forked.run_main(args, timeout=300, entry=fill_after_checkpoint_10_then_run)
    assert result.returncode == ExitStatus.WRITE_FAILED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "no space left on device" in line and "resumes from" in line and "checkpoint-10 (step 10)" in line, line

    shutil.rmtree(small / "results")  # the filler with it
    debug = forked.run_main([*args, "--debug"], timeout=300, entry=fill_after_checkpoint_10_then_run)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "WriteFailed" in debug.stderr


def test_failed_writes_are_recognised_however_the_library_words_them():
    safetensors_error = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                     '"No space left on device" })')
    assert is_write_failure(safetensors_error) == errno.ENOSPC
    assert is_write_failure(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    wrapped = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 448")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert is_write_failure(wrapped) == errno.EIO
    assert is_write_failure(ValueError("bad value")) is None
    assert is_write_failure(OSError(errno.ENOENT, "No such file")) is None


def test_torch_writer_errors_count_as_a_full_disk_only_when_it_is_full(tmp_path, small_filesystem):
    """torch.save's zip writer drops the errno ("unexpected pos 64 vs 0"): the free space decides."""
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert write_failure_errno(torch_error, tmp_path) is None  # room to spare: some other fault, raised as is
    small = small_filesystem("1m")
    with open(small / "filler", "wb") as handle:
        handle.write(b"\0" * (1024 * 1024 - 64 * 1024))
    assert write_failure_errno(torch_error, small / "results" / "checkpoint-5") == errno.ENOSPC
