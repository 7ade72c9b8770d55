"""On a CUDA GPU: precision chosen from the hardware, QLoRA on CUDA, the embedded default on one GPU, SFT's
padding-free forward in bf16, and check_gpu.py reading the real driver through NVML.

    python -m pytest -m gpu tests/test_gpu.py      # on a machine with an NVIDIA GPU (docs/gpu.md)

Deselected by a plain `pytest` (tests/conftest.py). Selected on a machine without a GPU they fail: a GPU run that
silently tested nothing would be worse than none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT
from src import run_files

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    import torch

    assert torch.cuda.is_available(), "-m gpu runs the GPU tests: this machine has no CUDA GPU that torch can use"
    return torch.device("cuda", 0)


def all_bf16(torch) -> bool:
    return all(torch.cuda.get_device_capability(index) >= (8, 0) for index in range(torch.cuda.device_count()))


def run_single(args: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "src.main_distributed", *args], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=timeout, env=os.environ)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_auto_precision_follows_the_gpus(cuda):
    """auto: bf16 where every GPU has compute capability 8.0+, fp16 otherwise; explicit bf16 refused on older GPUs."""
    import torch

    from src.config_error import ConfigError
    from src.config_parse import parse_config
    from src.plan import resolve_plan
    from src.world import Devices, World

    devices = Devices.detect()
    assert devices.kind == "cuda" and len(devices.names) == torch.cuda.device_count()
    config = parse_config(["--stage", "sft", "--model_name_or_path", "embedded", "--dataset_name", "embedded"])
    plan = resolve_plan(config, World(), devices)
    assert (plan.device, plan.backend) == ("cuda", "nccl")
    assert plan.precision == ("bf16" if all_bf16(torch) else "fp16")
    bf16 = parse_config(["--stage", "sft", "--model_name_or_path", "embedded", "--dataset_name", "embedded",
                         "--mixed_precision", "bf16"])
    if all_bf16(torch):
        assert resolve_plan(bf16, World(), devices).precision == "bf16"
    else:
        with pytest.raises(ConfigError, match="compute capability 8.0"):
            resolve_plan(bf16, World(), devices)


def test_qlora_trains_on_cuda(cuda, tmp_path):
    """4-bit NF4 base on the GPU with LoRA adapters: trains, the adapters change, the adapter reloads."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = ["--stage", "dpo", "--model_name_or_path", "embedded", "--dataset_name", "embedded", "--use_lora",
            "--load_in_4bit", "--gradient_checkpointing", "--batch_size", "8", "--max_steps", "4", "--num_samples", "8",
            "--max_new_tokens", "8", "--results_dir", str(tmp_path / "results"), "--run_name", "qlora-cuda",
            "--eval_strategy", "no", "--max_length", "64", "--learning_rate", "1e-3", "--logging_steps", "1"]
    run_single(args)
    run_dir = tmp_path / "results" / "qlora-cuda"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert (info["device"], info["load_in_4bit"], info["summary"]["completed_steps"]) == ("cuda", True, 4)
    assert info["precision"] == ("bf16" if all_bf16(torch) else "fp16")
    losses = [record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
    assert len(losses) >= 4 and all(loss == loss for loss in losses)
    base = AutoModelForCausalLM.from_pretrained(info["model_name_or_path"].split("(")[-1].rstrip(")"))
    adapted = PeftModel.from_pretrained(base, run_dir / "model" / "final")
    assert any("lora_B" in name and param.abs().sum() > 0 for name, param in adapted.named_parameters())


def test_embedded_default_on_one_gpu(cuda, tmp_path):
    """`./run_distributed.sh 1` of the embedded default: SFT then DPO on one GPU, in the GPU's precision, judged."""
    import torch

    result = subprocess.run(["bash", "run_distributed.sh", "1", "--results_dir", str(tmp_path / "results"),
                             "--run_name", "default-gpu"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=1800, env=os.environ)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    run_dir = tmp_path / "results" / "default-gpu"
    for stage_dir, stage in ((run_dir / "sft", "sft"), (run_dir, "dpo")):
        info = run_files.read_json(stage_dir / run_files.TRAINING_INFO)
        assert (info["stage"], info["status"], info["device"], info["world_size"], info["backend"]) == (
            stage, "completed", "cuda", 1, "nccl")
        assert info["precision"] == ("bf16" if all_bf16(torch) else "fp16")
    sft, dpo = (run_files.read_json(path / run_files.TRAINING_INFO) for path in (run_dir / "sft", run_dir))
    # SFT teaches the tasks (the untrained model answers none correctly), DPO moves the style (README: about 60% on
    # CPU); a GPU run in 16-bit is not bit-identical to the CPU one, so the bar is well below that.
    assert sft["judges"]["test"]["details"]["correct"]["after"] > 0.4
    assert dpo["judge"]["after"] > 0.4 and dpo["judge"]["after"] > dpo["judge"]["before"]
    assert sft["sft_forward"]["forward"] in ("padded", "padding_free")


@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2"])
def test_padding_free_sft_in_bf16_matches_the_padded_forward(cuda, attention, tiny_model):
    """The SFT padding-free forward on the GPU, bf16: each sequence of the packed row gets (within bf16 rounding) the
    hidden states it gets alone. flash-attention 2 reads the boundaries TRL's collator passes (cu_seq_lens)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    if attention == "flash_attention_2":
        pytest.importorskip("flash_attn", reason="flash-attn is not installed (pip install flash-attn)")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention,
                                                 dtype=torch.bfloat16).to(cuda)
    lengths = (5, 13, 3, 9)
    examples = [{"input_ids": [(7 * index + 3 * position) % 90 + 10 for position in range(length)]}
                for index, length in enumerate(lengths)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    batch = {key: value.to(cuda) if torch.is_tensor(value) else value for key, value in batch.items()
             if key != "labels"}
    with torch.no_grad():
        packed = model(**batch, use_cache=False, output_hidden_states=True).hidden_states[-1][0]
        for example, part in zip(examples, packed.split(list(lengths))):
            alone = model(input_ids=torch.tensor([example["input_ids"]], device=cuda), use_cache=False,
                          output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(part.float(), alone.float(), rtol=2e-2, atol=2e-2)


def test_check_gpu_reads_the_real_driver(cuda):
    """check_gpu.py --json on real NVML: the driver answers, every GPU torch sees is reported with its name, compute
    capability and memory, and the suggested launch uses one process per usable GPU."""
    import torch

    completed = subprocess.run([sys.executable, "check_gpu.py", "--json"], cwd=PROJECT_ROOT, capture_output=True,
                               text=True, timeout=300)
    assert "Traceback" not in completed.stderr, completed.stderr
    report = json.loads(completed.stdout)
    assert completed.returncode == report["exit_code"] and report["exit_code"] in (0, 1), report["problems"]
    assert report["driver"]["status"] == "ok" and report["driver"]["driver_version"]
    assert report["launch"]["device"] == "gpu"  # check_gpu's word for the launch (src/diagnostics/check.py), "cpu" else
    reported = [(gpu["name"], tuple(gpu["compute_capability"]), gpu["memory_total_bytes"]) for gpu in report["gpus"]]
    assert len(reported) >= torch.cuda.device_count()
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        assert any(name == properties.name and capability == (properties.major, properties.minor)
                   and abs(memory - properties.total_memory) <= 0.05 * memory
                   for name, capability, memory in reported), (properties, reported)
    assert report["launch"]["num_procs"] == torch.cuda.device_count()
    assert report["command"].startswith(f"./run_distributed.sh {torch.cuda.device_count()}")
