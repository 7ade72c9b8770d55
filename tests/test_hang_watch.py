"""A stuck rank stops the job (issue 51, src/run_safety/hang_watch.py): planted stalls at each place on 2 forked
processes, each stopped within the bound naming the right rank and phase, with every rank's stack in the run
directory; the same command resumes to the same numbers; a long honest phase is no hang; the rules in process.

The forked jobs are started together (module fixture `stalled`) and mostly sleep while their watch counts the
timeout, so their waits overlap instead of adding up."""

from __future__ import annotations

import faulthandler
import json
import os
import re
import time
from pathlib import Path

import pytest

import forked
from conftest import preference_rows, write_jsonl
from src import run_files, seams
from src.run_safety import hang_blame, hang_board, hang_stacks, hang_watch
from src.run_safety.exit_status import ExitStatus
from src.run_safety.run_lock import hold_path

TIMEOUT = 10  # --hang_timeout of the stalled jobs: past any honest pause of these tiny runs, on a loaded machine
JUDGE = "tests.round_judges:by_length"


def dpo_args(model: Path, data: Path, results: Path, run_name: str, *extra: str) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", run_name, "--batch_size", "8", "--max_steps", "2", "--logging_steps", "1",
            "--eval_strategy", "no", "--save_steps", "100", "--num_samples", "2", "--judge", "none",
            "--max_new_tokens", "4", "--learning_rate", "1e-3", "--max_length", "64", "--val_size", "2",
            "--test_size", "0", "--seed", "3", "--hang_timeout", str(TIMEOUT), *extra]


def grpo_args(model: Path, data: Path, results: Path, run_name: str, *extra: str) -> list[str]:
    return ["--stage", "grpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", run_name, "--batch_size", "16", "--num_generations", "4", "--max_steps", "1",
            "--max_new_tokens", "8", "--logging_steps", "1", "--save_steps", "100", "--num_samples", "0",
            "--val_size", "0", "--test_size", "0", "--max_length", "64", "--seed", "5", "--judge", JUDGE,
            "--audit_judge_pairs", "0", "--hang_timeout", str(TIMEOUT), *extra]


class Stalled:
    """A forked 2-process job with planted seams (a stall, slow phases), and what it left."""

    def __init__(self, args: list[str], cache: Path, planted: dict):
        self.args = args
        self.run_dir = Path(args[args.index("--results_dir") + 1]) / args[args.index("--run_name") + 1]
        # Its own caches: the prepared data and the reference log-probs are computed by this job, not reused
        environment = planted | {"OMP_NUM_THREADS": "1", "PREFKIT_CACHE": str(cache)}
        self.job = forked.Running(args, env=environment, nproc=2)
        self.ended: float | None = None

    def wait(self):
        if self.ended is None:
            self.stdout, self.stderr = self.job.communicate(timeout=400)
            self.ended = time.time()
            self.codes = self.job.codes()
        return self


@pytest.fixture(scope="module")
def stalled(tiny_model, tmp_path_factory):
    """Every planted stall's job, and the honest job, started at once: they mostly wait, so the waits overlap."""
    folder = tmp_path_factory.mktemp("stalls")
    pairs = write_jsonl(folder / "pairs.jsonl", preference_rows(24))
    many = write_jsonl(folder / "many.jsonl", preference_rows(2100))  # a pool of 2 workers prepares it
    prompts = write_jsonl(folder / "prompts.jsonl", [{"prompt": row["prompt"]} for row in preference_rows(24)])
    results = folder / "results"
    cache = lambda name: folder / f"cache-{name}"  # noqa: E731
    resumable = ("--max_steps", "4", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2",
                 "--num_samples", "0")
    jobs = {
        "judge": Stalled(grpo_args(tiny_model, prompts, results, "judge", "--max_steps", "2"), cache("judge"),
                         seams.env(stall="judge:1:2", live_report_log=str(folder / "judge-report-lines"))),
        "generation": Stalled(dpo_args(tiny_model, pairs, results, "generation"), cache("generation"),
                              seams.env(stall="generation:1")),
        # Whichever rank prepares the data (the other waits for it), one of its pool workers blocks
        "data_worker": Stalled(dpo_args(tiny_model, many, results, "data_worker", "--dataset_num_proc", "2"),
                               cache("data_worker"), seams.env(stall="data_worker:*")),
        "collective": Stalled(dpo_args(tiny_model, pairs, results, "collective", "--num_samples", "0"),
                              cache("collective"), seams.env(stall="collective:1")),
        "reference": Stalled(dpo_args(tiny_model, pairs, results, "reference", "--num_samples", "0"),
                             cache("reference"), seams.env(stall="reference:0")),
        # The second checkpoint's write, frozen in a C call that holds the interpreter's lock; resumed below
        "checkpoint": Stalled(dpo_args(tiny_model, pairs, results, "resumed", *resumable), cache("checkpoint"),
                              seams.env(stall="checkpoint:1:2:gil")),
        # The same run, never stopped, each honest long phase 6 s (the plain step: ~0.1 s), --hang_timeout 15
        "honest": Stalled(dpo_args(tiny_model, pairs, results, "honest", *resumable, "--hang_timeout", "15"),
                          cache("honest"), seams.env(slow=["step:6", "evaluation:6", "checkpoint:6:0"])),
    }
    yield jobs
    for job in jobs.values():
        job.wait()


def assert_stopped_naming(job: Stalled, rank: int, words: str, codes=(ExitStatus.HUNG, ExitStatus.HUNG),
                          stack_of: str = "rank"):
    job.wait()
    output = job.stdout + job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert job.codes == list(codes), (job.codes, output[-4000:])
    assert len(errors) == 1 and errors[0].startswith(f"error: hang: rank {rank} in {words}"), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    verdict = json.loads((job.run_dir / "hang" / "hang.json").read_text())
    assert verdict["rank"] == rank
    stalled_at = float(re.search(r"test seam: stalled at ([0-9.]+)", job.stderr).group(1))
    assert job.ended - stalled_at <= verdict["timeout_s"] + 60, (job.ended - stalled_at, verdict)
    stacks = {path.name: path.read_text() for path in (job.run_dir / "hang").glob("rank*.txt")}
    assert {"rank0.txt", "rank1.txt"} <= set(stacks), sorted(stacks)
    if stack_of == "rank":  # (a pool worker's stall is in its own file)
        assert "_stall_forever" in stacks[f"rank{rank}.txt"]
    assert not hold_path(job.run_dir).exists()  # released at once: the same command is not refused
    return verdict, errors[0]


def losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS)
            if "loss" in record}


def test_a_judge_stuck_on_rank_1_stops_the_job_naming_it_on_the_console_and_in_the_report(stalled):
    """GRPO's reward on rank 1 stops answering in step 2 (the issue's case): rank 0 waits in the rewards' gather.
    Before the stop, the console and the live report say no step has finished instead of an ETA."""
    job = stalled["judge"]
    verdict, line = assert_stopped_naming(job, 1, "the judge")
    assert "judges.py" in (verdict["where"] or ""), verdict
    assert re.search(r"\n  no step for [0-9.]+ s; rank 1 in the judge", job.stdout), job.stdout[-3000:]
    live = (job.run_dir.parent.parent / "judge-report-lines").read_text().splitlines()
    assert any(re.match(r"\*\*running\*\* · step 1 of 2 \(50%\) · elapsed .* · no step for [0-9.]+ s; rank 1 in the "
                        r"judge \(.*\) · updated ", line) for line in live), live
    info = run_files.read_json(job.run_dir / run_files.TRAINING_INFO)
    assert info["status"] == "stopped" and info["stop_reason"].startswith("stopped by a hang: rank 1 in the judge")
    report = (job.run_dir / "report.md").read_text().splitlines()[0]
    assert report.startswith("**stopped** (by a hang: rank 1 in the judge"), report


def test_a_generation_stuck_on_rank_1_stops_the_job_naming_it(stalled):
    assert_stopped_naming(stalled["generation"], 1, "generation")


def test_a_data_worker_stuck_on_rank_1_stops_the_job_naming_it(stalled):
    """A pool worker of the preparing rank blocks (the stall is planted on every rank: whichever prepares); the other
    rank waits for the preparation. The rank named is the one whose worker stalled."""
    job = stalled["data_worker"].wait()
    rank = json.loads((job.run_dir / "hang" / "hang.json").read_text())["rank"]
    workers = list((job.run_dir / "hang").glob(f"rank{rank}-worker-*.txt"))
    assert any("_stall_forever" in path.read_text() for path in workers), \
        sorted(path.name for path in (job.run_dir / "hang").iterdir())  # the rank named is the one whose worker stalled
    verdict, _ = assert_stopped_naming(job, rank, "data preparation", stack_of="worker")
    assert "in 2 pool workers" in verdict["what"], verdict


def test_a_collective_stuck_on_one_rank_stops_the_job_naming_that_rank(stalled):
    assert_stopped_naming(stalled["collective"], 1, "a collective")


def test_the_reference_pass_stuck_on_rank_0_stops_the_job_naming_it(stalled):
    assert_stopped_naming(stalled["reference"], 0, "the reference pass")


def test_a_checkpoint_write_frozen_holding_the_interpreter_stops_and_the_same_command_resumes_to_the_same_numbers(
        stalled):
    """Rank 1 freezes in its second checkpoint save inside a C call that keeps the interpreter's lock (its own watch
    cannot run): rank 0 dumps its stack by signal, names it, and kills it once written (-9); rank 0 exits 7 and
    releases the run directory's hold. The same command then resumes from checkpoint-2 to the numbers of the run that
    was never stopped."""
    job = stalled["checkpoint"]
    assert_stopped_naming(job, 1, "a checkpoint save", codes=(ExitStatus.HUNG, -9))
    honest = stalled["honest"].wait()
    assert honest.codes == [0, 0]
    resumed = forked.run_job(2, job.args, env=os.environ | {"OMP_NUM_THREADS": "1",
                                                           "PREFKIT_CACHE": str(job.run_dir.parent / "cache")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "checkpoint-2" in resumed.stdout
    expected = losses(honest.run_dir)
    assert sorted(expected) == [1, 2, 3, 4]
    assert losses(job.run_dir) == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_long_honest_phases_below_the_timeout_are_no_hang(stalled):
    """A slow first step (a compile), slow evaluations and a slow save on rank 0, each 6 s against a plain step of
    a fraction of a second, under --hang_timeout 15: the run finishes, no hang (the console may say no step has
    finished for a while: it is true)."""
    honest = stalled["honest"].wait()
    assert honest.codes == [0, 0], honest.stderr[-3000:]
    assert "hang" not in honest.stderr and not (honest.run_dir / "hang").exists()
    assert run_files.read_json(honest.run_dir / run_files.TRAINING_INFO)["status"] == "completed"
    records = run_files.read_jsonl(honest.run_dir / run_files.METRICS)
    first = next(record for record in records if record.get("step") == 1 and "loss" in record)
    assert first["time_s"] >= 6  # the slow first step did run past the plain step time


# ------------------------------------------------------------------------------------------------ the rules, in process


def test_the_stuck_rank_is_the_silent_one_outside_torch_distributed():
    """Stacks decide: the rank inside a collective waits for the other; without stacks, a rank marked waiting is the
    victim; ties go to a nested phase, then to the longest silent."""
    collective = ['File "/venv/torch/distributed/distributed_c10d.py", line 4287 in all_gather']
    sleeping = ['File "/src/judges.py", line 127 in scores']
    records = {0: {"rank": 0, "mode": "", "depth": 1}, 1: {"rank": 1, "mode": "", "depth": 2}}
    assert hang_blame.find_stuck(records, {0: 30.0, 1: 20.0}, {0: collective, 1: sleeping}) == 1
    assert hang_blame.find_stuck(records, {0: 30.0, 1: 20.0}, {0: sleeping, 1: collective}) == 0
    waiting = {0: {"rank": 0, "mode": hang_board.WAITING, "depth": 2}, 1: {"rank": 1, "mode": "", "depth": 1}}
    assert hang_blame.find_stuck(waiting, {0: 30.0, 1: 20.0}, {}) == 1
    assert hang_blame.find_stuck(records, {0: 30.0, 1: 20.0}, {}) == 1  # the nested phase (a judged batch)
    flat = {0: {"rank": 0, "mode": "", "depth": 1}, 1: {"rank": 1, "mode": "", "depth": 1}}
    assert hang_blame.find_stuck(flat, {0: 20.0, 1: 30.0}, {}) == 1  # silent longest
    assert hang_blame.find_stuck(flat, {0: 30.0, 1: 30.0}, {0: collective, 1: collective}) == 0
    nccl_read = ['File "/repo/src/distributed.py", line 105 in any_rank']  # NCCL: the wait is at the result's read
    assert hang_blame.find_stuck(flat, {0: 30.0, 1: 20.0}, {0: nccl_read, 1: sleeping}) == 1
    # Rank 0 waits in a gather TRL makes (not marked waiting) and falls silent first; rank 1 stuck in the judge after
    # its last beat, silent for less than the timeout yet: its stack names it (seen once in CI, under load).
    assert hang_blame.find_stuck(flat, {0: 30.0, 1: 20.0}, {0: collective, 1: sleeping}, timeout_s=25.0) == 1
    assert hang_blame.find_stuck(flat, {0: 30.0, 1: 20.0}, {0: collective}, timeout_s=25.0) == 0, "no stack, no blame"
    assert hang_blame.find_stuck(flat, {0: 30.0, 1: 20.0}, {0: sleeping, 1: sleeping}, timeout_s=25.0) == 0


def test_the_main_threads_frames_are_read_from_a_real_faulthandler_dump(tmp_path):
    """faulthandler lists the newest thread first; the main thread (not started through threading) is the one read,
    innermost frame first, from the last dump in the file."""
    import threading

    release = threading.Event()
    helper = threading.Thread(target=release.wait, daemon=True)
    helper.start()
    with open(tmp_path / "stack", "w") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        faulthandler.dump_traceback(out, all_threads=True)
    release.set()
    frames = hang_stacks.main_thread_frames((tmp_path / "stack").read_text())
    assert "test_the_main_threads_frames_are_read_from_a_real_faulthandler_dump" in frames[0]
    assert not hang_stacks.in_collective(frames)
    assert "test_hang_watch.py" in hang_stacks.innermost_toolkit_frame(frames)


def test_the_timeout_is_at_least_three_times_the_longest_pause_measured():
    assert hang_blame.effective_timeout(600, 30) == 600
    assert hang_blame.effective_timeout(600, 240) == 720  # a 4-minute first-step compile: 12 minutes from then on
    assert hang_blame.effective_timeout(10, 0) == 10


def test_a_stalled_run_says_how_long_since_a_step_instead_of_an_eta():
    from src.reporting.status import Live, run_state, status_line

    line = hang_blame.stalled_line(250, "rank 1 in the judge")
    assert line == "no step for 4 min 10 s; rank 1 in the judge"
    state = run_state({"status": "running"}, [], Live(step=10, total=12, elapsed_s=300, eta_s=None, stalled=line))
    assert status_line(state).startswith("**running** · step 10 of 12 (83%) · elapsed 5 min 0 s · no step for 4 min "
                                         "10 s; rank 1 in the judge · updated ")
    assert "ETA" not in status_line(state)


def test_a_watched_process_that_ends_by_itself_leaves_no_board(tmp_path, monkeypatch):
    """The board next to the run directory is the launch's scratch: gone once every rank is done. (The process's
    watch state is put back after: this is the pytest process.)"""
    monkeypatch.setattr(hang_watch, "_watch", [])
    monkeypatch.setattr(hang_watch, "_me", hang_watch._Process())
    monkeypatch.delenv("MASTER_PORT", raising=False)
    hang_watch.start(tmp_path / "run", 0, 1, 600)
    assert (tmp_path / ".run.hang").is_dir()
    hang_watch.stop_watching()
    hang_watch._watch[0].thread.join(timeout=30)  # the watch thread ends with it (and arms nothing any more)
    assert not hang_watch._watch[0].thread.is_alive()
    assert list(tmp_path.iterdir()) == []
    faulthandler.unregister(hang_stacks.DUMP_SIGNAL)  # this (pytest) process as it was
