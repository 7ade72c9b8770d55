"""QLoRA on CPU: 4-bit layers stay on bitsandbytes' trainable path, so a model whose attention projections have biases
(the Qwen2 family) trains under gradient checkpointing with the right gradients.

On a CPU with AVX512-BF16, bitsandbytes converts 4-bit weights to an inference-only layout at the first forward in eval
mode without gradients; its kernel has no backward. The tests make bitsandbytes believe the CPU has it
(`has_avx512bf16`), which takes the same code path on any CPU (a plain-torch fallback of the kernel where it lacks
AVX512-BF16; the real kernel where it has it, as on an AMD EPYC Zen 4 where these tests also ran).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, build_tiny_tokenizer, preference_rows, write_jsonl, WORDS
from src import run_files

bitsandbytes = pytest.importorskip("bitsandbytes")

EMULATE_AVX512_BF16 = "import bitsandbytes.nn.modules as m; m.has_avx512bf16 = lambda: True; "


def build_tiny_qwen2(path: Path) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, GQA, tied embeddings), 128 wide (bitsandbytes' CPU kernels need multiples
    of 64)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    rows = preference_rows(64)
    tokenizer = build_tiny_tokenizer([" ".join(WORDS)] + [" ".join(
        [row["prompt"][0]["content"], row["chosen"][0]["content"], row["rejected"][0]["content"]]) for row in rows])
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def lora_gradients(model) -> dict:
    """LoRA gradients of one training forward/backward under gradient checkpointing (after an eval-mode forward
    without gradients, as answering held-out prompts does before training)."""
    import torch
    from peft import LoraConfig, get_peft_model

    inputs = torch.arange(3, 27).reshape(2, 12)
    model.eval()
    with torch.no_grad():
        model(input_ids=inputs)
    torch.manual_seed(0)  # the same random adapters each time (non-zero B, so every adapter gets a gradient)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM",
                                             init_lora_weights=False))
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model.train()
    model(input_ids=inputs, labels=inputs, use_cache=False).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def test_4bit_layers_keep_their_trainable_layout(tiny_qwen2, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from src.config_parse import parse_config
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.models import load_model, quantization_config

    config = parse_config(["--stage", "dpo", "--model_name_or_path", str(tiny_qwen2), "--use_lora", "--load_in_4bit",
                           "--dataset_name", "embedded"])
    plan = resolve_plan(config, World(), Devices("cpu"))
    expected = lora_gradients(load_model(str(tiny_qwen2), config.model, plan, World()))

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    # The emulation takes bitsandbytes' inference-only path when nothing prevents it (so this test can fail).
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32, device_map={"": "cpu"},
                                                 quantization_config=quantization_config(config.model, plan))
    # How the inference-only layout goes wrong depends on the CPU: where bitsandbytes' kernel really runs (AVX512-BF16)
    # the bias add fails as users saw it; where it is emulated, torch warns and the gradients are wrong.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            wrong = lora_gradients(plain)
        except RuntimeError as error:
            assert "leaf Variable that requires grad is being used in an in-place operation" in str(error)
        else:
            assert any("autograd kernel was not registered" in str(warning.message) for warning in caught)
            assert any(not torch.allclose(wrong[name], expected[name]) for name in expected)

    model = load_model(str(tiny_qwen2), config.model, plan, World())
    got = lora_gradients(model)
    assert not any(getattr(module.weight.quant_state, "packing_format_for_cpu", False) for module in model.modules()
                   if isinstance(module, bitsandbytes.nn.Linear4bit))
    assert got.keys() == expected.keys() and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_qlora_dpo_with_gradient_checkpointing_of_qwen2_trains(tiny_qwen2, tmp_path):
    """What the user ran: the QLoRA recipe pointed at a Qwen2-family model, gradient checkpointing on."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    args = ["--config", "configs/dpo_llama3.1-8b_qlora.yaml", "--model_name_or_path", str(tiny_qwen2),
            "--dataset_name", str(data), "--val_size", "2", "--test_size", "2", "--batch_size", "4",
            "--micro_batch_size", "2", "--max_steps", "2", "--num_samples", "2", "--max_new_tokens", "4",
            "--results_dir", str(tmp_path / "results"), "--run_name", "qwen2-qlora", "--eval_strategy", "no",
            "--max_length", "64", "--judge", "none", "--logging_steps", "1"]
    code = EMULATE_AVX512_BF16 + "import sys; from src.main_distributed import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "autograd kernel was not registered" not in result.stderr
    info = run_files.read_json(tmp_path / "results" / "qwen2-qlora" / run_files.TRAINING_INFO)
    assert info["gradient_checkpointing"] and info["load_in_4bit"] and info["summary"]["completed_steps"] == 2
    losses = [record["loss"] for record in run_files.read_jsonl(tmp_path / "results" / "qwen2-qlora" /
                                                                 run_files.METRICS) if "loss" in record]
    assert losses and all(loss == loss for loss in losses)
