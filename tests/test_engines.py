"""The sharding engines on CPU processes (src/engines.py): DeepSpeed ZeRO-1/2/3 through accelerate's launch
configs (configs/accelerate/zero*.yaml, the environment accelerate launch gives its workers: tests/engine_launch.py),
each a forked 2-process job on gloo. One job per engine and objective carries every assertion: the engine that ran
(training_info.json, read from the trainer's accelerator), the same loss curve as plain DDP at the same global batch
(fp32, 1e-5), each rank's share (tests/rank_probe.py: optimizer states halved, under ZeRO-3 the weights and a live
reference too), and the final model consolidated into ordinary safetensors equal to DDP's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
import rank_probe
from conftest import preference_rows, write_jsonl
from engine_launch import accelerate_environment
from src import run_files
from test_training import assert_reloads_generates_and_changed, common_args, probes

pytest.importorskip("deepspeed")


def run_engine(strategy: str, args: list[str], probe_dir: Path) -> dict:
    """A forked 2-process job as `STRATEGY=<strategy> ./run_distributed.sh 2` starts its workers (ddp: torchrun's
    plain DDP); its training_info.json, loss curve and per-rank probes."""
    environment = accelerate_environment(strategy) if strategy != "ddp" else dict(os.environ)
    result = forked.run_job(2, [str(probe_dir), *args], env=environment | {"OMP_NUM_THREADS": "1"},
                            entry=rank_probe.entry)
    assert result.returncode == 0, (f"{strategy}: exit {result.returncode}\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-4000:]}")
    run_dir = Path(args[args.index("--results_dir") + 1]) / args[args.index("--run_name") + 1]
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    losses = [record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
    stage = args[args.index("--stage") + 1]
    return {"info": info, "losses": losses, "ranks": probes(probe_dir, stage, 2), "final": run_dir / "model" / "final"}


def final_weights(path: Path) -> dict:
    """The saved model's weights as from_pretrained loads them (a tied head saved separately or not alike)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_dpo_under_zero2_and_zero3_trains_as_ddp_does_each_rank_holding_its_share(tiny_model, preference_file,
                                                                                   tmp_path):
    """DPO (packed forward), global batch 8 = 2 per device x 2 accumulation x 2 processes, 3 steps: DDP, ZeRO-2 and
    ZeRO-3 with the reference log-probs precomputed (TRL's inference engine under DeepSpeed, released before
    training: src/trainers/dpo.py), ZeRO-3 with the live reference (prepared by TRL as a sharded engine too)."""
    runs = {}
    for name, strategy, extra in (("ddp", "ddp", []), ("zero2", "zero2", []), ("zero3", "zero3", []),
                                  ("zero3_live", "zero3", ["--precompute_ref_log_probs", "false"])):
        args = common_args(tiny_model, preference_file, tmp_path / "results", name, "dpo") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3", *extra]
        runs[name] = run_engine(strategy, args, tmp_path / f"probe_{name}")
    ddp = runs["ddp"]
    assert (ddp["info"]["engine"], ddp["info"]["distributed_type"]) == ("ddp", "MULTI_CPU")
    assert len(ddp["losses"]) == 3 and ddp["losses"][0] > ddp["losses"][-1]
    whole = ddp["ranks"][0]["held"]
    assert whole["weights"] == whole["full_weights"] and whole["optimizer_states"] == 2 * whole["weights"]  # AdamW
    for name, stage in (("zero2", 2), ("zero3", 3), ("zero3_live", 3)):
        run = runs[name]
        assert (run["info"]["distributed_type"], run["info"]["engine"], run["info"]["zero_stage"]) == (
            "DEEPSPEED", "deepspeed", stage), name
        assert run["losses"] == pytest.approx(ddp["losses"], rel=1e-5), name
        assert run["info"]["one_job"]["identical_weights"] and run["info"]["one_job"]["disjoint_rows_per_step"]
        for rank in run["ranks"]:
            held = rank["held"]
            assert held["full_weights"] == whole["weights"], name
            assert held["optimizer_states"] == whole["optimizer_states"] // 2, name  # each rank its half
            assert held["weights"] == (whole["weights"] // 2 if stage == 3 else whole["weights"]), name
        if name == "zero3_live":
            assert [rank["held"]["reference_weights"] for rank in run["ranks"]] == [whole["weights"] // 2] * 2
        else:
            assert [rank["held"]["reference_weights"] for rank in run["ranks"]] == [None, None]
    # ZeRO-3's final model: the partitions gathered into ordinary safetensors, DDP's weights to fp32 noise
    import torch

    assert_reloads_generates_and_changed(runs["zero3"]["final"], tiny_model)
    expected = final_weights(ddp["final"])
    for name in ("zero2", "zero3"):
        saved = final_weights(runs[name]["final"])
        assert saved.keys() == expected.keys()
        for key, tensor in expected.items():
            torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_sft_under_zero1_and_zero3_trains_as_ddp_does(tiny_model, tmp_path):
    rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(48)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    runs = {}
    for strategy in ("ddp", "zero1", "zero3"):
        args = common_args(tiny_model, data, tmp_path / "results", strategy, "sft") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3"]
        runs[strategy] = run_engine(strategy, args, tmp_path / f"probe_{strategy}")
    whole = runs["ddp"]["ranks"][0]["held"]
    for strategy, stage in (("zero1", 1), ("zero3", 3)):
        run = runs[strategy]
        assert (run["info"]["engine"], run["info"]["zero_stage"]) == ("deepspeed", stage)
        assert run["losses"] == pytest.approx(runs["ddp"]["losses"], rel=1e-5), strategy
        assert [rank["held"]["optimizer_states"] for rank in run["ranks"]] == [whole["optimizer_states"] // 2] * 2
