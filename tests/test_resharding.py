"""A run that lost processes, or gained some, goes on with the numbers of the run never interrupted (issue 58): the
same command on another number of processes resumes from the newest complete checkpoint under DDP, ZeRO-1/2/3 and
FSDP2 (src/run_safety/checkpoint_split.py, resharding.py; src/trainers/resume_state.py), and what it cannot do is
refused in one line before any process group.

Each cell is a forked job killed, then the same command on another number of processes (tests/forked.py), held to
the uninterrupted 2-process DDP run of the same command: every logged loss, grad norm, eval metric and DPO/SFT metric
within 1e-5 from the first step after the resume. The covering set (why these cells suffice, and their measured cost:
docs/reliability.md, "Another number of processes"):

| cell | engine | objective | processes | killed |
|---|---|---|---|---|
| ddp | DDP | DPO, reference cached | 2 -> 1 | off the checkpoint grid (step 5; checkpoint-3) |
| zero1 | ZeRO-1 | DPO, reference cached | 2 -> 4 | right after checkpoint-3 (every rank) |
| zero2 | ZeRO-2 | DPO, reference cached | 4 -> 2 | off the checkpoint grid |
| zero3_live | ZeRO-3 | DPO, reference live (sharded too) | 4 -> 2 | right after checkpoint-3 |
| fsdp | FSDP2 (sharded checkpoints) | DPO, reference cached | 2 -> 4 | off the checkpoint grid |
| zero3_lora | ZeRO-3 | SFT with LoRA | 2 -> 1 | right after checkpoint-3 |
| fsdp_lora | FSDP2 (whole checkpoints) | SFT with LoRA | 4 -> 2 | off the checkpoint grid |

KTO (2 -> 1, tests/test_kto.py) and GRPO (1 -> 2 and 2 -> 4, tests/test_grpo.py) resume on another number of
processes in their own tests' jobs. The checkpoint is off the logging grid in every cell (saved every 3 steps, logged
every 2), and the run crosses an epoch after the resume (44 training pairs, 5 steps of 8 an epoch, 4 left out).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from src import run_files, seams
from src.run_safety import checkpoint_manifest
from src.run_safety.resharding import LATEST_UNIVERSAL, universal_ready
from test_training import common_args

pytest.importorskip("deepspeed")

# What a logged record holds that is not a number of the training: its timings and speeds.
NOT_NUMBERS = ("perf/", "time", "train_", "eval_runtime", "eval_samples", "eval_steps", "total_flos", "epoch")
OFF_GRID, AT_CHECKPOINT = "off the checkpoint grid", "at a checkpoint"


def logged(run_dir: Path) -> list[dict]:
    """The run's logged numbers, record by record (timings left out)."""
    return [{key: value for key, value in record.items() if not key.startswith(NOT_NUMBERS)}
            for record in run_files.read_jsonl(run_dir / run_files.METRICS)]


def launch(processes: int, args: list[str], strategy: str, seam: dict | None = None):
    """A forked job of `processes` as `STRATEGY=<strategy> ./run_distributed.sh <processes>` starts its workers
    (fsdp_sharded: configs/accelerate/fsdp.yaml with fsdp_state_dict_type SHARDED_STATE_DICT)."""
    sharded = strategy == "fsdp_sharded"
    strategy = "fsdp" if sharded else strategy
    environment = (accelerate_environment(strategy, processes) if strategy != "ddp" else dict(os.environ)) | {
        "OMP_NUM_THREADS": "1"} | ({"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"} if sharded else {})
    return forked.run_job(processes, args, env=seams.env(environment, **(seam or {})))


def killed(processes: int, args: list[str], strategy: str, kill: str, flag: Path) -> None:
    """The job killed: rank 0 SIGKILLed at the end of step 5 (the newest checkpoint is 3, and steps 4-5 were logged
    after it), or every rank right after checkpoint-3 completed."""
    seam = {"kill_starter": f"step:5:{flag}"} if kill == OFF_GRID else {
        "kill_at_checkpoint": f"after_complete:3:*:{flag}"}
    result = launch(processes, args, strategy, seam)
    fired = flag.exists() if kill == OFF_GRID else Path(f"{flag}.rank0").exists()
    assert fired and result.returncode != 0, f"the seam never fired: the test proves nothing\n{result.stderr[-3000:]}"


def assert_same_numbers(run: list[dict], reference: list[dict]) -> None:
    assert [record["step"] for record in run] == [record["step"] for record in reference]
    wrong = []
    for mine, theirs in zip(run, reference):
        assert mine.keys() == theirs.keys(), (mine["step"], mine.keys() ^ theirs.keys())
        wrong += [(mine["step"], key, mine[key], value) for key, value in theirs.items()
                  if mine[key] != pytest.approx(value, rel=1e-5, abs=1e-7)]
    assert not wrong, wrong


def run_args(model: Path, data: Path, results: Path, stage: str):
    """The command of every cell of a stage: a global batch of 8 in micro-batches of 2, 6 steps, a log every 2
    steps, a checkpoint and an evaluation every 3."""
    def args(name: str, *extra: str) -> list[str]:
        return common_args(model, data, results, name, stage) + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "6", "--learning_rate", "1e-3",
            "--logging_steps", "2", "--save_steps", "3", "--eval_steps", "3", "--num_samples", "0", *extra]
    return args


@pytest.fixture(scope="module")
def dpo(tiny_model, tmp_path_factory):
    """DPO's command and its uninterrupted 2-process DDP run, the reference every DPO cell is held to."""
    root = tmp_path_factory.mktemp("resharding_dpo")
    args = run_args(tiny_model, write_jsonl(root / "pairs.jsonl", preference_rows(52)), root / "results", "dpo")
    reference = launch(2, args("reference"), "ddp")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return args, logged(root / "results" / "reference"), root / "results"


@pytest.fixture(scope="module")
def sft_lora(tiny_model, tmp_path_factory):
    """SFT with LoRA, its command and uninterrupted 2-process DDP run. Without LoRA's dropout: its masks are drawn by
    each process from its own random stream, so with dropout no two splits give the same numbers, resumed or not."""
    root = tmp_path_factory.mktemp("resharding_sft")
    rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(52)]
    args = run_args(tiny_model, write_jsonl(root / "chat.jsonl", rows), root / "results", "sft")
    lora = ("--use_lora", "true", "--lora_dropout", "0")
    reference = launch(2, args("reference", *lora), "ddp")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return (lambda name: args(name, *lora)), logged(root / "results" / "reference"), root / "results"


def resume_cell(setup, name: str, strategy: str, first: int, then: int, kill: str, tmp_path: Path,
                extra: tuple[str, ...] = (), between=None) -> tuple[Path, dict, str]:
    """A cell: the job of `first` processes killed, then the same command on `then`, held to the reference. Returns
    its run directory, training_info.json and the resumed launch's console. `between(args)`: what a test does with
    the killed run before the resume."""
    args_for, reference, results = setup
    args = args_for(name) + list(extra)
    killed(first, args, strategy, kill, tmp_path / "killed")
    if between is not None:
        between(args)
    again = launch(then, args, strategy)
    assert again.returncode == 0, f"{again.stdout[-3000:]}\n{again.stderr[-5000:]}"
    run_dir = results / name
    assert_same_numbers(logged(run_dir), reference)
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    resume = info["resumes"][-1]
    assert (info["world_size"], resume["from_step"], resume["saved_by"]["world_size"]) == (then, 3, first)
    return run_dir, info, again.stdout


def assert_universal_checkpoint_recorded(run_dir: Path, info: dict, first: int) -> None:
    """DeepSpeed's universal checkpoint, converted once inside checkpoint-3, is in its manifest and verifies; one
    byte altered in it is found."""
    conversion = info["resumes"][-1]["universal_checkpoint"]
    assert conversion["from_world_size"] == first and conversion["bytes"] > 0
    checkpoint = run_dir / "model" / "checkpoint-3"
    listed = checkpoint_manifest.read_manifest(checkpoint)["files"]
    converted = [name for name in listed if name.startswith(conversion["universal"] + "/")]
    assert LATEST_UNIVERSAL in listed and converted and universal_ready(checkpoint)
    assert checkpoint_manifest.verify(checkpoint, threads=1) is None
    damaged = checkpoint / converted[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert converted[0] in checkpoint_manifest.verify(checkpoint, threads=1)


def test_ddp_killed_off_the_checkpoint_grid_resumes_on_one_process_saying_what_changed(dpo, tmp_path):
    """DDP, 2 -> 1. Before the resume, 3 processes are refused in one line (8 does not split over 3: the counts that
    split it and the command), before any process group, nothing of the run changed. The resume says what changed
    (console, training_info.json) and the report's curves mark it."""
    from src.reporting.plots import resume_marks

    def three_processes_refused(args):
        metrics = dpo[2] / "ddp" / run_files.METRICS
        before = metrics.read_bytes()
        three = launch(3, args, "ddp")
        errors = [line for line in three.stderr.splitlines() if line.startswith("error:")]
        assert three.returncode == 2 and len(errors) == 1 and "Traceback" not in three.stderr, three.stderr[-3000:]
        assert "unfinished run at a global batch of 8, which 3 processes cannot split: resume it on 1, 2, 4 " \
               "processes" in errors[0] and "; run: ./run_distributed.sh 2 --stage dpo" in errors[0], errors[0]
        assert metrics.read_bytes() == before

    _run_dir, info, console = resume_cell(dpo, "ddp", "ddp", 2, 1, OFF_GRID, tmp_path,
                                          between=three_processes_refused)
    change = "saved by 2 processes, now 1: accumulation 2 → 4, global batch 8 unchanged"
    assert f"model/checkpoint-3 (step 3 of 6; {change})" in console
    assert info["resumes"][-1]["split_change"] == change
    assert resume_marks(info) == [(3, "resumed at step 3 on 1 process (saved by 2)")]


@pytest.mark.parametrize(("name", "strategy", "first", "then", "kill", "extra"), [
    ("zero1", "zero1", 2, 4, AT_CHECKPOINT, ()),
    ("zero2", "zero2", 4, 2, OFF_GRID, ()),
    ("zero3_live", "zero3", 4, 2, AT_CHECKPOINT, ("--precompute_ref_log_probs", "false")),
])
def test_deepspeed_checkpoints_resume_on_another_number_of_processes(dpo, tmp_path, name, strategy, first, then,
                                                                     kill, extra):
    """DeepSpeed ZeRO-1/2/3 (DPO): the checkpoint converted once to DeepSpeed's universal checkpoint and loaded on
    the new number of processes, recorded in the checkpoint's manifest. Before it, a launch under plain DDP is
    refused in one line naming the engine that saved it."""
    def ddp_refused(args):
        refused = launch(then, args, "ddp")
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 2 and len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert f"was saved under DeepSpeed ZeRO-{strategy[-1]} and this launch runs plain DDP: relaunch with " \
               f"STRATEGY={strategy}" in errors[0], errors[0]

    run_dir, info, _console = resume_cell(dpo, name, strategy, first, then, kill, tmp_path, extra,
                                          between=ddp_refused if name == "zero2" else None)
    assert (info["engine"], info["zero_stage"]) == ("deepspeed", int(strategy[-1]))
    assert_universal_checkpoint_recorded(run_dir, info, first)


def test_fsdp2_sharded_checkpoint_resumes_on_more_processes(dpo, tmp_path):
    """FSDP2 with sharded checkpoints (torch.distributed.checkpoint, which reshards as it loads), DPO, 2 -> 4."""
    _run_dir, info, _console = resume_cell(dpo, "fsdp", "fsdp_sharded", 2, 4, OFF_GRID, tmp_path)
    assert (info["engine"], info["resumes"][-1]["saved_by"]["state_dict_type"]) == ("fsdp", "SHARDED_STATE_DICT")


@pytest.mark.parametrize(("name", "strategy", "first", "then", "kill"), [
    ("zero3_lora", "zero3", 2, 1, AT_CHECKPOINT),
    ("fsdp_lora", "fsdp", 4, 2, OFF_GRID),
])
def test_lora_sft_resumes_on_another_number_of_processes(sft_lora, tmp_path, name, strategy, first, then, kill):
    """SFT with LoRA (the base frozen, only the adapter in the optimizer): ZeRO-3 2 -> 1 (its universal checkpoint
    holds the adapter's states), FSDP2 with whole checkpoints 4 -> 2."""
    run_dir, info, _console = resume_cell(sft_lora, name, strategy, first, then, kill, tmp_path)
    if strategy == "zero3":
        assert_universal_checkpoint_recorded(run_dir, info, first)
