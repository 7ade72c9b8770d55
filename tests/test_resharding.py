"""A run resumed on another number of processes goes on with the numbers of the run never interrupted (issue 58)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from src import run_files, seams
from test_training import common_args

# What a logged record holds that is not a number of the training: its timings and speeds.
NOT_NUMBERS = ("perf/", "time", "train_", "eval_runtime", "eval_samples", "eval_steps", "total_flos", "epoch")


def logged(run_dir: Path) -> list[dict]:
    """The run's logged numbers, record by record (timings left out)."""
    return [{key: value for key, value in record.items() if not key.startswith(NOT_NUMBERS)}
            for record in run_files.read_jsonl(run_dir / run_files.METRICS)]


def launch(processes: int, args: list[str], strategy: str, seam: dict | None = None):
    environment = (accelerate_environment(strategy, processes) if strategy != "ddp" else dict(os.environ)) | {
        "OMP_NUM_THREADS": "1"}
    if seam:
        environment = seams.env(environment, **seam)
    return forked.run_job(processes, args, env=environment)


@pytest.fixture(scope="module")
def dpo(tiny_model, tmp_path_factory):
    """DPO at a global batch of 8 (micro-batches of 2), 6 steps, a log every 2 steps and a checkpoint every 3 (so
    checkpoint-3 is off the logging grid: its window holds step 3), an evaluation at 3 and 6; its uninterrupted
    2-process DDP run, the reference every resumed run is held to."""
    root = tmp_path_factory.mktemp("resharding")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(48))

    def args(name: str, *extra: str) -> list[str]:
        return common_args(tiny_model, data, root / "results", name, "dpo") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "6", "--learning_rate", "1e-3",
            "--logging_steps", "2", "--save_steps", "3", "--eval_steps", "3", "--num_samples", "0", *extra]

    reference = launch(2, args("reference"), "ddp")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return args, logged(root / "results" / "reference"), root


def assert_same_numbers(run: list[dict], reference: list[dict]) -> None:
    assert [record["step"] for record in run] == [record["step"] for record in reference]
    wrong = []
    for mine, theirs in zip(run, reference):
        assert mine.keys() == theirs.keys(), (mine.keys() ^ theirs.keys())
        for key, value in theirs.items():
            if mine[key] != pytest.approx(value, rel=1e-5, abs=1e-7):
                wrong.append((mine["step"], key, mine[key], value))
    assert not wrong, wrong


def test_ddp_two_processes_killed_off_the_checkpoint_grid_resume_on_one(dpo, tmp_path):
    args, reference, root = dpo
    killed = tmp_path / "killed"
    first = launch(2, args("ddp_2_to_1"), "ddp", {"kill_starter": f"step:5:{killed}"})
    assert killed.exists() and first.returncode != 0, first.stderr[-3000:]
    again = launch(1, args("ddp_2_to_1"), "ddp")
    assert again.returncode == 0, again.stderr[-3000:]
    print(again.stdout)
    assert_same_numbers(logged(root / "results" / "ddp_2_to_1"), reference)


STRATEGY = os.environ.get('SCRATCH_STRATEGY', 'zero3')


def test_zero3_scratch(dpo, tmp_path):
    args, reference, root = dpo
    killed = tmp_path / "killed"
    first = launch(2, args("zero3_2_to_1"), STRATEGY, {"kill_at_checkpoint": f"after_complete:3:*:{killed}"})
    assert first.returncode != 0, first.stderr[-3000:]
    again = launch(1, args("zero3_2_to_1"), STRATEGY)
    print(again.stdout[-5000:], again.stderr[-5000:])
    assert again.returncode == 0
    assert_same_numbers(logged(root / "results" / "zero3_2_to_1"), reference)


def test_zero3_one_uninterrupted_scratch(dpo, tmp_path):
    args, reference, root = dpo
    again = launch(1, args("zero3_1"), "zero3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_numbers(logged(root / "results" / "zero3_1"), reference)
