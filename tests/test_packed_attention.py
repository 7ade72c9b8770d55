"""The packed forward on FlexAttention's block-sparse mask (src/packed_attention.py): the choice by row width and its
reason, the bucketed widths that bound the compiles, the compile count, the reference log-probs through the DPO
trainer equal to TRL's padded forward (CPU: forward only, FlexAttention uncompiled), and a leaking BlockMask caught
by the first-batch check (CPU, and on a GPU in bf16 with the compiled kernel: `python -m pytest -m gpu`). The family
enumeration is in tests/test_packed_support.py."""

from __future__ import annotations

import pytest

from conftest import plant
from test_packed_dpo import assert_close, pairs, reference_logps, tiny, tokenizer, trainer_for  # noqa: F401
from test_packed_support import flex_on_cpu, flex_policy


def test_bucketed_widths_bound_the_shapes_flex_compiles_for():
    from src.packed_attention import BLOCK, bucket_width

    buckets = {bucket_width(width) for width in range(1, 16_385)}
    assert len(buckets) == 40  # 8 multiples of 128 up to 1,024, then 8 per doubling
    for width in (1, 127, 129, 1_000, 1_025, 3_000, 9_000, 16_384):
        bucket = bucket_width(width)
        assert bucket >= width and bucket % BLOCK == 0
        assert bucket - width < max(BLOCK, width / 8)  # at most 1/8 of a row is bucket padding


def test_auto_picks_the_dense_mask_on_short_rows_and_flex_on_long_ones_with_the_reason():
    from src.packed_attention import AttentionPolicy
    from src.packed_layout import pack_pairs

    policy = AttentionPolicy("auto", flex_possible=True, crossover_width=32)
    assert policy.kind_for(31) == "dense" and policy.kind_for(32) == "flex"
    line = policy.note("flex", 256)
    assert "block-sparse" in line and "256 tokens" in line and "at least 32" in line and "published" in line
    assert policy.note("flex", 384) is None  # one line per kind, every batch counted
    assert policy.summary()["batches"] == {"flex": 2} and policy.summary()["flex_widths"] == [256, 384]
    # The collator: a dense layout at least 32 wide goes into one bucketed row; a narrower one stays dense
    rows = pairs(8, seed=1)
    dense = pack_pairs(rows, None, 0, "prefix_shared", 40, 1 / 192)["packed_input_ids"].shape
    flex = pack_pairs(rows, None, 0, "prefix_shared", 40, 1 / 192, attention=policy)["packed_input_ids"].shape
    assert dense[0] > 1 and dense[1] >= 32 and flex[0] == 1 and flex[1] % 128 == 0
    short = [{"prompt_ids": [9, 10], "chosen_ids": [11], "rejected_ids": [12]}] * 3
    assert pack_pairs(short, None, 0, "prefix_shared", 4, 1 / 192, attention=policy)["packed_input_ids"].shape[1] < 32
    # No CUDA GPU: never flex, and it says why
    cpu = AttentionPolicy("auto", flex_possible=False, why_not_flex="no CUDA GPU")
    assert cpu.kind_for(10_000) == "dense" and "no CUDA GPU" in cpu.note("dense", 10_000)


def test_the_compile_counter_sees_torch_compile():
    import torch

    from src.packed_attention import CompileCounter

    counter = CompileCounter()
    counter.watch()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    compiled(torch.ones(3))
    compiled(torch.ones(3))  # same shape: no new compile
    assert counter.count == 1 and counter.seconds > 0


def test_flex_reference_log_probs_through_the_trainer_equal_the_padded_forward(tokenizer, tmp_path, monkeypatch,
                                                                               capsys):
    """The reference pass (no grad) of the DPO trainer on the block-sparse mask, Qwen2 (grouped-query, q/k/v biases):
    TRL's padded forward's per-pair log-probs within 1e-5 in fp32, the first-batch check passed, the choice printed
    and in the summary training_info.json records."""
    import src.packed_dpo as packed_dpo

    rows = pairs(8, seed=3)
    model = tiny("qwen2", tokenizer)
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False), rows)
    flex_on_cpu(monkeypatch)
    monkeypatch.setattr(packed_dpo, "policy_for", lambda *args: flex_policy())
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True, packed_attention="flex")
    assert_close(reference_logps(trainer, rows), padded)
    summary = trainer.packed_forward.summary()
    assert trainer.packed_forward.enabled and summary["first_batch_check"]["passed"]
    assert summary["attention"]["batches"]["flex"] >= 2 and summary["attention"]["requested"] == "flex"
    assert "packed attention: block-sparse" in capsys.readouterr().out


def test_a_leaking_block_mask_turns_packing_off_in_one_line(tokenizer, tmp_path, monkeypatch, capsys):
    """A BlockMask that lets the rejected answer see the chosen one (planted through src/seams.py): the first-batch
    check catches it, the run falls back to the padded forward (and its numbers), one warning line."""
    import src.packed_dpo as packed_dpo

    rows = pairs(8, seed=4)
    model = tiny("llama", tokenizer)
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False), rows)
    flex_on_cpu(monkeypatch)
    monkeypatch.setattr(packed_dpo, "policy_for", lambda *args: flex_policy())
    plant(monkeypatch, packed_mask_leak=True)
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True, packed_attention="flex")
    assert_close(reference_logps(trainer, rows), padded)
    assert not trainer.packed_forward.enabled and "differ from the padded forward" in trainer.packed_forward.reason
    assert len([line for line in capsys.readouterr().out.splitlines() if "packed forward off" in line]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("leak", [False, True])
def test_on_gpu_in_bf16_the_flex_forward_matches_the_padded_one_or_is_turned_off(leak, tokenizer, tmp_path,
                                                                                 monkeypatch, capsys):
    """`python -m pytest -m gpu`: --packed_attention flex on CUDA (compiled FlexAttention, a compiled BlockMask) under
    bf16: the first-batch check passes with the half-precision tolerance and the numbers match the padded forward's;
    with a leaking mask planted, packing is turned off with one line."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")
    if leak:
        plant(monkeypatch, packed_mask_leak=True)
    rows = pairs(16, seed=7)
    model = tiny("qwen2", tokenizer).cuda()
    padded = reference_logps(trainer_for(model, tokenizer, rows, tmp_path, False, bf16=True, use_cpu=False),
                             rows).float()
    trainer = trainer_for(model, tokenizer, rows, tmp_path, True, bf16=True, use_cpu=False, packed_attention="flex")
    packed = reference_logps(trainer, rows).float()
    forward = trainer.packed_forward
    assert forward.check_result["tolerance"] == 0.1
    if leak:
        assert not forward.enabled
        assert len([line for line in capsys.readouterr().out.splitlines() if "packed forward off" in line]) == 1
    else:
        assert forward.enabled and forward.check_result["passed"]
        assert forward.summary()["attention"]["batches"]["flex"] >= 2
        assert forward.summary()["attention"]["compiles"]["count"] >= 1
    assert ((packed - padded).abs() <= 2e-2 * padded.abs() + 0.1).all()
