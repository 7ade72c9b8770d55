"""SFT on TRL's padding-free batches: exact with sdpa and eager (sequences of one packed row cannot see each other),
the choice made from the attention implementation, and recorded."""

from __future__ import annotations


import pytest

import forked
from conftest import write_jsonl
from src import run_files
from src.config_parse import parse_config
from src.trainers.stage_plan import resolve_sft_forward

LENGTHS = (5, 13, 3, 9)


def sft_trainer(model, tokenizer, padding_free: bool, tmp_path):
    import datasets
    from trl import SFTConfig

    from src.trainers.sft import ToolkitSFTTrainer

    rows = [{"input_ids": [(7 * index + 3 * position) % 90 + 10 for position in range(length)]}
            for index, length in enumerate(LENGTHS)]
    args = SFTConfig(output_dir=str(tmp_path / f"pf{padding_free}"), padding_free=padding_free,
                     max_length=None if padding_free else 64, use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=len(rows), activation_checkpointing=False)
    return ToolkitSFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, truncate_to=64 if padding_free else None)


def logits_and_loss(trainer, examples):
    """The final hidden states of TRL's own SFT forward for this batch (what the LM head reads; TRL computes the loss
    from them without calling the head module), and its loss."""
    import torch

    captured = []
    norm = trainer.model.model.norm
    handle = norm.register_forward_hook(lambda module, inputs, output: captured.append(output.detach()))
    try:
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    finally:
        handle.remove()
    return captured[0], float(loss)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padding_free_sft_is_exact(attention, tiny_model, tiny_tokenizer, tmp_path):
    """Each sequence of a padding-free row gets the logits it gets alone (it would not if it could attend to the one
    before it), and the batch loss equals the padded batch's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention, dtype=torch.float32)
    model.train()  # dropout is 0: train mode is the mode TRL runs the forward in
    padded, padding_free = (sft_trainer(model, tiny_tokenizer, flag, tmp_path) for flag in (False, True))
    examples = [padding_free.train_dataset[index] for index in range(len(LENGTHS))]
    batch = padding_free.data_collator(examples)
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in batch

    packed_logits, packed_loss = logits_and_loss(padding_free, examples)
    for example, logits in zip(examples, packed_logits[0].split(list(LENGTHS))):
        alone, _ = logits_and_loss(padded, [example])
        torch.testing.assert_close(logits, alone[0], rtol=1e-5, atol=1e-5)
    _, padded_loss = logits_and_loss(padded, examples)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)


def test_padding_free_with_a_kv_cache_would_leak(tiny_model):
    """Why the exactness rests on TRL passing use_cache=False: with a cache, transformers ignores the restarting
    positions and the second sequence attends to the first (this is what the test above guards against)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa", dtype=torch.float32)
    first, second = torch.arange(10, 16), torch.arange(20, 27)
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(6), torch.arange(7)])[None]
    with torch.no_grad():
        alone = model(input_ids=second[None]).logits[0]
        leaked = model(input_ids=row, position_ids=positions, use_cache=True).logits[0, 6:]
        kept = model(input_ids=row, position_ids=positions, use_cache=False).logits[0, 6:]
    torch.testing.assert_close(kept, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaked, alone, atol=1e-3)


def forward_for(flags: list[str], attention: str | None) -> dict:
    config = parse_config(["--stage", "sft", "--model_name_or_path", "embedded", "--dataset_name", "embedded", *flags])
    return resolve_sft_forward(config, attention)


@pytest.mark.parametrize("flags, attention, forward, warned", [
    ([], "sdpa", "padded", False),                                   # exact, but dearer than padding here
    ([], "flash_attention_2", "padding_free", False),                # exact and linear: the default
    (["--padding_free", "true"], "sdpa", "padding_free", False),
    (["--padding_free", "true"], "eager", "padding_free", False),
    (["--padding_free", "false"], "flash_attention_2", "padded", False),
    (["--packing", "true"], "sdpa", "packed", False),
    (["--padding_free", "true"], "flex_attention", "padded", True),  # not checked: not trusted
    (["--packing", "true"], "flex_attention", "padded", True),
])
def test_sft_forward_follows_the_attention(flags, attention, forward, warned):
    decided = forward_for(flags, attention)
    assert decided["forward"] == forward
    assert bool(decided["warning"]) == warned
    if warned:
        assert "\n" not in decided["warning"] and attention in decided["warning"]


def test_padding_free_sft_run_matches_the_padded_run(tiny_model, tmp_path):
    """End to end: --padding_free true trains the same first step as the padded run (same loss), the rows are cut
    to --max_length by the toolkit (TRL's config then has none), and training_info.json says which forward ran."""
    rows = [{"messages": [{"role": "user", "content": f"what color is the sky {index}"},
                          {"role": "assistant", "content": "the sky is " + " ".join(["blue"] * (1 + index % 7))}]}
            for index in range(40)]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    losses, infos = {}, {}
    for name, flags in (("padded", ["--padding_free", "false"]), ("padding_free", ["--padding_free", "true"])):
        args = ["--stage", "sft", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
                "--results_dir", str(tmp_path / "results"), "--run_name", name, "--max_length", "20",
                "--batch_size", "8", "--max_steps", "2", "--logging_steps", "1", "--eval_strategy", "no",
                "--num_samples", "2", "--max_new_tokens", "4", "--judge", "none", "--val_size", "4",
                "--test_size", "4", "--assistant_only_loss", "true", *flags]
        result = forked.run_main(args)
        assert result.returncode == 0, result.stderr[-3000:]
        run_dir = tmp_path / "results" / name
        infos[name] = run_files.read_json(run_dir / run_files.TRAINING_INFO)
        losses[name] = [record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS)
                        if "loss" in record]
    assert infos["padded"]["sft_forward"]["forward"] == "padded"
    assert infos["padding_free"]["sft_forward"]["forward"] == "padding_free"
    assert infos["padding_free"]["data"]["splits"]["train"]["truncated"] > 0  # rows the toolkit had to cut
    assert losses["padding_free"][0] == pytest.approx(losses["padded"][0], rel=1e-5)
    assert losses["padding_free"][1] == pytest.approx(losses["padded"][1], rel=1e-4)
