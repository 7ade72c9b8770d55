"""Dropout off means off for DPO (`disable_dropout`, TRL's default): every dropout a family applies (nn.Dropout
modules, probabilities stored on modules, probabilities read from the config at run time) is 0 for the policy and
the reference, the saved config keeps the model's own values, and a dropout the toolkit cannot reach is named."""

from __future__ import annotations

import json
import re

import pytest

from tiny_architectures import tiny_config


def trainer_with(model, tiny_model, tmp_path, **overrides):
    import copy

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from src.trainers.dpo import PreparedDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_length=32, bf16=False,
                     use_cpu=True, activation_checkpointing=False, report_to=[], disable_tqdm=True,
                     precompute_ref_log_probs=False, **overrides)
    rows = [{"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10, 11]}] * 4
    return PreparedDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


def dropout_fields(config) -> dict[str, float]:
    return {name: value for name, value in vars(config).items()
            if re.search("drop", name, re.I) and isinstance(value, float)}


@pytest.mark.parametrize("model_type", ["opt", "gpt_bigcode", "persimmon", "llama"])
def test_every_dropout_is_off_for_dpo_and_the_saved_config_keeps_it(model_type, tiny_model, tmp_path):
    """OPT applies `config.dropout` functionally, GPTBigCode and Llama their attention dropout from a module
    attribute, Persimmon reads `config.attention_dropout` at run time: TRL's own disable_dropout leaves all of them
    on (two train-mode forwards differ). Here they are off, and the saved config still says 0.3."""
    import torch
    from transformers import AutoModelForCausalLM

    from src.trainers.dpo import dropout_still_on

    fields = dropout_fields(tiny_config(model_type))
    config = tiny_config(model_type, vocab_size=400, **dict.fromkeys(fields, 0.3))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(model)
    assert dropout_still_on(model), "the family's dropout survives TRL's own switch (else this test has no teeth)"
    trainer = trainer_with(model, tiny_model, tmp_path)
    assert not dropout_still_on(trainer.model)
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert {name: saved[name] for name in fields} == dict.fromkeys(fields, 0.3)
    assert not dropout_still_on(trainer.model)  # zero again after the save


def test_a_dropout_the_toolkit_cannot_reach_is_named_in_one_warning(tiny_model, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    norm = model.model.norm
    original = norm.forward
    norm.forward = lambda hidden: torch.nn.functional.dropout(original(hidden), 0.5, model.training)  # hard-coded
    trainer_with(model, tiny_model, tmp_path)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "still applies dropout" in line]
    assert len(warnings) == 1 and "llama" in warnings[0]


def test_dropout_stays_as_configured_when_disable_dropout_is_false(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from src.trainers.dpo import dropout_still_on

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("opt", vocab_size=400, dropout=0.3))
    trainer = trainer_with(model, tiny_model, tmp_path, disable_dropout=False)
    assert dropout_still_on(trainer.model)
