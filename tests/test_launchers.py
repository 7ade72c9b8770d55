"""accelerate launch next to torchrun: the shipped accelerate configs, STRATEGY in run_distributed.sh, a real DDP run
through `accelerate launch` on CPU, the refusals where a strategy cannot run, and the LoRA adapter check at save time."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT
from src import run_files
from src.engines import check_engine, requested

CONFIGS = sorted((PROJECT_ROOT / "configs" / "accelerate").glob("*.yaml"))
EXPECTED = {"ddp": ("MULTI_GPU", None), "zero1": ("DEEPSPEED", 1), "zero2": ("DEEPSPEED", 2),
            "zero3": ("DEEPSPEED", 3), "fsdp": ("FSDP", None)}


def launcher(*args, **environment) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "run_distributed.sh", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                          timeout=300, env=os.environ | {"PYTHON": sys.executable} | environment)


def test_every_strategy_has_a_config_that_accelerate_reads():
    from accelerate.commands.config.config_args import load_config_from_file

    assert sorted(path.stem for path in CONFIGS) == sorted(EXPECTED)
    for path in CONFIGS:
        config = load_config_from_file(str(path))
        distributed_type, zero_stage = EXPECTED[path.stem]
        assert config.distributed_type.value == distributed_type, path.name
        # Precision and batch come from the toolkit's flags, never from the launcher config.
        assert str(getattr(config.mixed_precision, "value", config.mixed_precision)) == "no", path.name
        if zero_stage:
            assert config.deepspeed_config["zero_stage"] == zero_stage
            assert config.deepspeed_config["gradient_accumulation_steps"] == "auto"
    zero3 = load_config_from_file(str(PROJECT_ROOT / "configs/accelerate/zero3.yaml"))
    assert zero3.deepspeed_config["zero3_save_16bit_model"] is True  # otherwise adapters are saved as empty shards


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_strategy_assembles_the_accelerate_launch(strategy):
    result = launcher("4", "--config", "configs/default.yaml", "--beta", "0.2", STRATEGY=strategy, PRINT_LAUNCH="1",
                      NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29511")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout)
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    options = dict(zip(command[3:-5:2], command[4:-5:2]))
    assert options == {"--config_file": f"configs/accelerate/{strategy}.yaml", "--num_processes": "8",
                       "--num_machines": "2", "--machine_rank": "1", "--main_process_ip": "10.1.2.3",
                       "--main_process_port": "29511", "--max_restarts": "3"}
    assert command[-5:] == ["src/main_distributed.py", "--config", "configs/default.yaml", "--beta", "0.2"]


def test_default_strategy_is_torchrun_with_the_flags_unchanged():
    result = launcher("2", "--max_steps", "5", PRINT_LAUNCH="1", MASTER_PORT="29512")
    command = shlex.split(result.stdout)
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node" in command
    assert command[-4:] == ["-m", "src.main_distributed", "--max_steps", "5"]


@pytest.mark.parametrize("strategy, message", [
    ("zero9", "STRATEGY=zero9: use torchrun (default), ddp, zero1, zero2, zero3 or fsdp"),
])
def test_a_strategy_this_machine_cannot_run_is_one_clear_line(strategy, message):
    result = launcher("2", STRATEGY=strategy)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_entry_point_reads_the_engine_and_runs_both_on_cpu_processes():
    """DeepSpeed and FSDP2 both run on CPU processes (tests/test_engines.py), so neither is refused there. The engine
    is read from accelerate launch's environment in the workers and from STRATEGY in run_distributed.sh's
    preflight."""
    assert requested({}) is None and requested({"STRATEGY": "ddp"}) is None
    assert requested({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}).title == (
        "DeepSpeed ZeRO-3")
    assert requested({"STRATEGY": "zero2"}).title == "DeepSpeed ZeRO-2"
    assert requested({"ACCELERATE_USE_FSDP": "true"}).title == requested({"STRATEGY": "fsdp"}).title == "FSDP"
    check_engine(requested({"ACCELERATE_USE_FSDP": "true"}), "cpu")
    check_engine(requested({"STRATEGY": "zero3"}), "cpu")
    check_engine(requested({"STRATEGY": "fsdp"}), "cuda")


def test_ddp_through_accelerate_launch_trains_as_one_job(tiny_model, preference_file, tmp_path):
    from test_training import common_args

    args = common_args(tiny_model, preference_file, tmp_path / "results", "accelerate", "dpo")
    result = launcher("2", *args, "--batch_size", "4", "--max_steps", "3", STRATEGY="ddp", OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    info = run_files.read_json(tmp_path / "results" / "accelerate" / run_files.TRAINING_INFO)
    assert (info["distributed_type"], info["world_size"], info["summary"]["completed_steps"]) == ("MULTI_CPU", 2, 3)
    assert info["one_job"]["identical_weights"] and info["one_job"]["disjoint_rows_per_step"]
    assert info["one_job"]["steps_checked"] > 0  # rows recorded: what each rank was given


def test_an_empty_lora_adapter_is_caught_when_saved(tiny_model, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from src.models import ModelError, verify_adapter

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    verify_adapter(tmp_path / "adapter", model)  # a healthy adapter passes

    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    save_file(tensors | {first: torch.empty(0)}, weights)  # what ZeRO-3 without a 16-bit gather writes
    with pytest.raises(ModelError, match=f"LoRA tensor {first} was saved as \\(0,\\)"):
        verify_adapter(tmp_path / "adapter", model)
    save_file({}, weights)
    with pytest.raises(ModelError, match="saved with no tensors"):
        verify_adapter(Path(tmp_path / "adapter"), model)
