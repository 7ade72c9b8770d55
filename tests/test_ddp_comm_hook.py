"""--ddp_comm_hook: DDP's gradient compression hook, for real on gloo (CPU), and refused where it cannot apply."""

from __future__ import annotations

import pytest

from src import run_files
from src.config_error import ConfigError
from src.config_parse import parse_config
from src.engines import check_engine, requested
from src.plan import resolve_plan
from src.world import Devices, World
from src.trainers.stage_plan import silent_no_op_warnings
from test_training import assert_trained_as_one_job, common_args, launch, run_single


def test_fp16_compression_on_gloo_halves_the_bytes_and_keeps_the_loss_curve(tiny_model, preference_file, tmp_path):
    """Two 2-process runs, identical but for the hook. Tolerance: fp16 keeps 11 significant bits, so each gradient
    element (in fp16's normal range) is rounded by at most 2^-11 (about 5e-4) relative, in the cast and in the sum;
    Adam normalises each update by the gradient's own scale, so such an error moves an update, and so the loss, by
    about that fraction. A relative 1e-3 between the curves allows that and nothing more (measured here: 6e-7);
    the loss itself moves by over ten times the allowance during the run (checked), so the comparison is not
    vacuous."""
    from transformers import AutoModelForCausalLM

    losses, infos = {}, {}
    for hook in ("fp16", "none"):
        args = common_args(tiny_model, preference_file, tmp_path / "results", f"hook-{hook}", "dpo") + [
            "--batch_size", "8", "--max_steps", "6", "--learning_rate", "1e-3", "--num_samples", "0",
            "--eval_strategy", "no", "--ddp_comm_hook", hook]
        launch(2, args, tmp_path / f"probe_{hook}")
        assert_trained_as_one_job(tmp_path / f"probe_{hook}", "dpo", 6)
        infos[hook] = run_files.read_json(tmp_path / "results" / f"hook-{hook}" / run_files.TRAINING_INFO)
        metrics = run_files.read_jsonl(tmp_path / "results" / f"hook-{hook}" / run_files.METRICS)
        losses[hook] = [record["loss"] for record in metrics if "loss" in record]

    info = infos["fp16"]
    assert (info["ddp_comm_hook"], infos["none"]["ddp_comm_hook"]) == ("fp16", "none")  # the plan
    assert "gradient_all_reduce" not in infos["none"]
    # What DDP's buckets held, as the hook saw them: every parameter's fp32 gradient once per step, sent as fp16.
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert info["gradient_all_reduce"] == {"name": "fp16", "applied": True, "bytes_per_step": 2 * parameters,
                                           "uncompressed_bytes_per_step": 4 * parameters, "saved_fraction": 0.5,
                                           "steps": 6}

    assert len(losses["fp16"]) == len(losses["none"]) == 6
    assert losses["fp16"] == pytest.approx(losses["none"], rel=1e-3)
    assert losses["fp16"] != losses["none"], "identical curves: the compressed all-reduce did not run"
    assert losses["none"][0] - losses["none"][-1] > 10 * 1e-3 * losses["none"][0]  # 6.7% here


def test_bf16_compression_on_cpu_is_refused_in_one_line(tiny_model, preference_file, tmp_path):
    """torch's DDP allows its bf16 hook only with NCCL 2.10+ on CUDA; gloo would fail on the first backward."""
    args = common_args(tiny_model, preference_file, tmp_path / "results", "bf16", "dpo") + [
        "--max_steps", "1", "--ddp_comm_hook", "bf16"]
    result = run_single(args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --ddp_comm_hook bf16 needs CUDA GPUs" in result.stderr and "use fp16" in result.stderr


def test_compression_is_refused_under_sharding_and_ignored_on_one_process():
    for strategy in ("zero1", "zero3", "fsdp"):
        with pytest.raises(ConfigError, match="--ddp_comm_hook fp16 compresses DDP's all-reduce"):
            check_engine(requested({"STRATEGY": strategy}), "cuda", "fp16")
    config = parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--ddp_comm_hook", "fp16"])
    single = resolve_plan(config, World(), Devices(kind="cpu"))
    assert single.ddp_comm_hook == "none"
    assert any("--ddp_comm_hook fp16 is ignored on one process" in w for w in silent_no_op_warnings("dpo", config,
                                                                                                     single))
    multi = resolve_plan(config, World(world_size=2, local_world_size=2), Devices(kind="cpu"))
    assert multi.ddp_comm_hook == "fp16" and silent_no_op_warnings("dpo", config, multi) == []
