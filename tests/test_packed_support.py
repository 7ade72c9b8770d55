"""The packed forward's allow-list (src/packed_dpo_support.py) against every causal LM of the pinned transformers:
each model type is either exact — a tiny random model gives TRL's padded forward's per-token log-probs within 1e-5 on
rows longer than every window it has — or refused before training with a cause. docs/speed.md's table is the
registry's own. The same holds for the forward on FlexAttention's block-sparse mask (src/packed_attention.py): every
allowed family transformers runs under flex_attention is exact there too (forward only, on CPU), or named."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiny_architectures import causal_lm_types, tiny_config

ROOT = Path(__file__).resolve().parents[1]


# The families whose flex forward is traced by TorchDynamo as torch's eager flex_attention does (the toolkit's mask
# function with no window and with one, a score function with a soft cap): what a GPU's compile must be able to trace.
# The other families run the same math untraced.
TRACED_FLEX_FAMILIES = ("llama", "qwen2", "gemma2")


def pair_rows(count: int = 6, seed: int = 0, vocab: int = 90) -> list[dict]:
    """Prompts of 12-30 tokens and answers of 4-30: every row is longer than the tiny configs' windows (8)."""
    rng = random.Random(seed)
    ids = lambda low, high: [rng.randrange(3, vocab) for _ in range(rng.randint(low, high))]  # noqa: E731
    return [{"prompt_ids": ids(12, 30), "chosen_ids": ids(4, 30), "rejected_ids": ids(4, 30)} for _ in range(count)]


def flex_on_cpu(monkeypatch):
    """FlexAttention on CPU the way the suite runs it: transformers' flex path calls torch's flex_attention uncompiled
    (its CPU compile takes minutes for the families; the compiled kernel computes the same function on a GPU)."""
    import transformers.integrations.flex_attention as transformers_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_attention(query, key, value, **kwargs))


def flex_policy():
    """The attention policy with FlexAttention forced (what --packed_attention flex gives on a GPU)."""
    from src.packed_attention import AttentionPolicy, CompileCounter

    return AttentionPolicy("flex", flex_possible=True, compiles=CompileCounter())


def packed_and_padded_log_probs(model, rows: list[dict], attention=None):
    """Per-token log-probs of TRL's padded batch, through TRL's fused LM head, computed the padded way and the packed
    way (the trainer's own collator and redirect; `attention`: its attention policy, default the dense mask), no grad,
    eval mode."""
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    from src.packed_dpo import PackedPreferenceCollator, attention_layout
    from src.packed_forward import PackedDPOForward
    from src.packed_layout import PACKED_KEYS

    if not getattr(model, "_packed_dpo_installed", False):  # a second call: TRL's head would cover the redirect
        add_fused_lm_head(model, outputs=("log_probs",))
    layout = attention_layout(model)
    batch = PackedPreferenceCollator(DataCollatorForPreference(pad_token_id=0, max_length=None), layout, 1 / 192,
                                     attention=attention)(rows)
    forward = PackedDPOForward(None, layout, attention=attention)
    forward.checked = True  # compare here, not through the first-batch check

    def log_probs(inputs):
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                     use_cache=False, fused_lm_head=True).log_probs

    model.eval()
    with torch.no_grad():
        padded = log_probs({key: value for key, value in batch.items() if key not in PACKED_KEYS})
        with forward.running(batch, ("reference",), [model]) as inputs:
            packed = log_probs(inputs)
    return packed, padded


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_causal_lm_is_exact_or_refused(model_type, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from src.packed_attention import flex_refusal
    from src.packed_dpo_support import VERIFIED, refusal, router_aux_enabled

    try:
        config = tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 - a family no tiny config can be built for must not be trusted
        assert model_type not in VERIFIED, f"{model_type}: no tiny config ({error})"
        return
    reason = refusal(config)
    if reason is not None:
        assert model_type in reason or reason.startswith("TRL"), reason  # one line naming the family and the cause
        if model_type not in VERIFIED or not router_aux_enabled(config.get_text_config(), None):
            return
        # MoE families: TRL turns the router loss on with the config's own coefficient; with it at 0, packed and exact
        assert "router auxiliary loss" in reason
        reason = refusal(config, router_aux_loss_coef=0.0)
        if reason is not None:
            return
    assert model_type in VERIFIED
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    packed, padded = packed_and_padded_log_probs(model, pair_rows())
    assert (padded != 0).sum() > 100
    difference = (packed - padded).abs()
    assert (difference <= 1e-5 * padded.abs() + 1e-5).all(), f"{model_type}: max |difference| {difference.max():.3g}"
    # The same rows on FlexAttention's block-sparse mask, where transformers runs the family under flex_attention
    reason = flex_refusal(model)
    if reason is not None:
        assert model.config.model_type in reason  # one line naming the family (gpt-sw3's config says gpt2)
        return
    flex_on_cpu(monkeypatch)
    if model_type not in TRACED_FLEX_FAMILIES:
        import torch.nn.attention.flex_attention as torch_flex

        # torch's own debug switch: the same math (the FlexAttention operator's reference implementation) without
        # TorchDynamo tracing each family's score and mask functions first (~9 of the sweep's ~13 CPU-s)
        monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    policy = flex_policy()
    # three pairs in one row (FlexAttention on CPU evaluates the whole row's scores: its cost grows with the width)
    packed, padded = packed_and_padded_log_probs(model, pair_rows(3), policy)
    assert policy.chosen == {"flex": 1}  # the flex row ran, not the dense one
    difference = (packed - padded).abs()
    assert (difference <= 1e-5 * padded.abs() + 1e-5).all(), \
        f"{model_type} under flex: max |difference| {difference.max():.3g}"


def test_the_registry_names_only_types_the_pinned_transformers_has():
    from src.packed_dpo_support import CANNOT_TRAIN, REFUSED, VERIFIED

    known = set(causal_lm_types())
    assert not (VERIFIED | set(REFUSED) | set(CANNOT_TRAIN)) - known
    assert not VERIFIED & (set(REFUSED) | set(CANNOT_TRAIN))


def test_docs_speed_carries_the_registrys_table():
    from src.packed_dpo_support import markdown_table

    assert markdown_table() in (ROOT / "docs" / "speed.md").read_text(), \
        "regenerate docs/speed.md's table: python -m src.packed_dpo_support"


def saved_model(path: Path, model_type: str, tokenizer_from: Path, **overrides) -> Path:
    """A tiny model of `model_type` saved with the suite's tokenizer (what --model_name_or_path points at)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = tiny_config(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type, overrides, cause", [
    ("bloom", {}, "ALiBi"),
    ("falcon", {"alibi": True}, "ALiBi"),
    ("mamba", {}, "state-space"),
    ("lfm2_moe", {}, "not verified"),
    ("mixtral", {}, "router auxiliary loss is on (coefficient 0.001)"),
])
def test_a_refused_model_is_named_before_data_preparation(model_type, overrides, cause, tiny_model, tmp_path):
    """The launch reads config.json and says why the padded forward will run before it prepares any data: here the
    data has a broken line, and the warning comes first."""
    from test_cli import run_main

    from conftest import preference_rows, write_jsonl

    model = saved_model(tmp_path / model_type, model_type, tiny_model, **overrides)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))
    data.write_text(data.read_text() + "{broken\n")
    result = run_main("--model_name_or_path", str(model), "--dataset_name", str(data), "--stage", "dpo",
                      "--results_dir", str(tmp_path / "results"), "--dry_run")
    warnings = [line for line in result.stdout.splitlines() if "packed forward off" in line]
    assert len(warnings) == 1 and model_type in warnings[0] and cause in warnings[0], result.stdout[-2000:]
    assert result.returncode == 2 and "pairs.jsonl line 9" in result.stderr  # data preparation came after


def test_a_model_no_dpo_forward_can_run_stops_the_launch_in_one_line(tiny_model, tmp_path):
    from test_cli import assert_one_line_error, run_main

    from conftest import preference_rows, write_jsonl

    model = saved_model(tmp_path / "llama4_text", "llama4_text", tiny_model)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(8))
    assert_one_line_error(run_main("--model_name_or_path", str(model), "--dataset_name", str(data), "--stage", "dpo",
                                   "--results_dir", str(tmp_path / "results"), "--dry_run"),
                          "llama4_text cannot be trained with DPO", "fused LM head")
