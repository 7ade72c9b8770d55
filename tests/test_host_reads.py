"""No stall per step (issue 50 point 4): outside logging steps, a training step of the toolkit's trainers reads no
device value on the host but the one the NaN stop needs (StopConditions: whether any rank saw a non-finite loss or
gradient norm, agreed at the step's end), counted in real runs (tests/read_probe.py: `Tensor.item`, `.tolist`,
`bool()`, `float()`, `int()`, `.nonzero`, `.cpu`, `.numpy` from the second optimizer step to the one before the first
log, evaluation or checkpoint).

TRL 1.16's own trainers, counted the same way (bench/host_reads.py, docs/speed.md; one micro-batch per optimizer
step): DPO 17.2 reads per step (+4 of the model's own), SFT 7.2, CPO (SimPO) 11.2, ORPO 13.2, KTO 16.2, GRPO's training
part 11.2 (KL term on, its sampling and judging not counted); the toolkit's DPO made 25 before (its callbacks and token
counters added to TRL's metric reads), its KTO 14.8.

Reads the count leaves out: the model's own (transformers' sdpa mask check on a padded batch, `masking_utils`, two per
forward, listed apart) and those C++ makes without a Python call (a boolean-mask index on a GPU): docs/speed.md.
"""

from __future__ import annotations

import json

import forked
import read_probe
from conftest import preference_rows, write_jsonl
from test_grpo import JUDGE, prompt_rows

MODEL_OWN = "transformers/masking_utils.py"  # the model's forward, not the trainer's
NAN_STOP = "tolist src/distributed.py"        # StopConditions' agreement: the one read a step may make


def counted_run(tiny_model, tmp_path, stage: str, *extra: str) -> dict:
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(48, seed=1))
    result = tmp_path / "reads.json"
    args = [str(result), "--stage", stage, "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
            "--results_dir", str(tmp_path / "results"), "--run_name", "reads", "--max_length", "64",
            "--logging_steps", "100", "--eval_steps", "100", "--max_steps", "5", "--num_samples", "0", "--judge",
            "none", "--seed", "3", "--val_size", "0", "--test_size", "0", "--per_device_batch_size", "2",
            "--gradient_accumulation_steps", "2", *extra]
    completed = forked.run_main(args, entry=read_probe.entry)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(result.read_text())


def assert_one_read_per_step(window: dict, stage: str) -> None:
    assert window["steps"] >= 3, (stage, window)
    trainer_reads = {place: count for place, count in window["places"].items() if MODEL_OWN not in place}
    assert trainer_reads == {next(place for place in trainer_reads if place.startswith(NAN_STOP)): window["steps"]}, \
        (stage, window["places"])


def test_sft_then_dpo_steps_read_only_the_nan_stop(tiny_model, tmp_path):
    """SFT and DPO (packed forward, two micro-batches per optimizer step): one read per optimizer step, where TRL's
    own SFT makes 7.2 and DPO 17.2 per micro-batch (bench/host_reads.py)."""
    windows = counted_run(tiny_model, tmp_path, "sft_then_dpo")
    assert set(windows) == {"sft", "dpo"}
    for stage, window in windows.items():
        assert_one_read_per_step(window, stage)


def test_simpo_and_orpo_steps_read_only_the_nan_stop(tiny_model, tmp_path):
    """SimPO (TRL's CPOTrainer, 11.2 reads per micro-batch of its own) and ORPO (13.2), both packed."""
    for stage in ("simpo", "orpo"):
        assert_one_read_per_step(counted_run(tiny_model, tmp_path / stage, stage)[stage], stage)


def test_kto_steps_read_only_the_nan_stop(tiny_model, tmp_path):
    """KTO (the step's KL over its global batch first, then the packed completion pass): one read per optimizer step,
    where TRL's own KTOTrainer makes 16.2 per micro-batch (bench/host_reads.py); the toolkit's made 29 (14.5 per micro-batch)
    before its training step computed TRL's loss itself."""
    assert_one_read_per_step(counted_run(tiny_model, tmp_path, "kto", "--kto_from_pairs")["kto"], "kto")


def test_grpo_training_part_reads_only_the_nan_stop(tiny_model, tmp_path):
    """GRPO's training part (its sampling and judging left out: token ids go to the judges on the host by nature), KL
    term on: one read per optimizer step, where TRL's own GRPOTrainer makes 11.2 per micro-batch (bench/host_reads.py)."""
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    window = counted_run(tiny_model, tmp_path, "grpo", "--dataset_name", str(data), "--num_generations", "4",
                         "--max_new_tokens", "8", "--beta", "0.1", "--judge", JUDGE)
    assert_one_read_per_step(window["grpo"], "grpo")
