"""The packed, prefix-shared forward (src/packed_dpo.py) for the objectives beside DPO whose rows have
`packed_forward`: SimPO (CPOTrainer), ORPO (ORPOTrainer). Their trainers' own padded forward (TRL's
`concatenated_forward`: full logits on `[chosen; rejected]` rows) against the packed one, on the same model weights
and the same global batch of 8 prepared pairs: one optimizer step's loss, logged metrics and gradient agree to 1e-5
(fp32; the `logits/*` metrics are the answers' mean logit both ways: src/trainers/legacy_pairs.py), the first-batch
check passed, fewer tokens were computed, and the packed step, its NLL and logits token means over the global batch,
is the same on any split of the global batch into processes x accumulation steps, micro-batch size included."""

from __future__ import annotations

import pytest

from pair_steps import assert_the_same_on_every_split, one_step, trainer_on_prepared_pairs

SETTINGS = {
    "simpo": dict(beta=2.5, simpo_gamma=1.25, loss_type="simpo", cpo_alpha=0.0),
    "cpo_simpo": dict(beta=2.5, simpo_gamma=1.25, loss_type="simpo", cpo_alpha=0.3),  # + the chosen answers' NLL
    "orpo": dict(beta=0.1),
}
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss", "grad")
ORPO_TERMS = ("log_odds_ratio", "log_odds_chosen")


def setup(name, model, tokenizer, work, packed):
    stage = "orpo" if name == "orpo" else "simpo"
    return trainer_on_prepared_pairs(stage, model, tokenizer, work / ("packed" if packed else "padded"), packed=packed,
                                     **SETTINGS[name])


def assert_close(packed, padded, key, tolerance=1e-5):
    import torch

    if torch.is_tensor(padded):
        difference = float((packed - padded).abs().max() / padded.abs().max().clamp(min=1e-12))
    else:
        difference = abs(packed - padded) / max(abs(padded), 1.0)
    assert difference < tolerance, (key, packed if not torch.is_tensor(packed) else "", padded, difference)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_packed_step_equals_the_padded_one(name, tiny_model, tiny_tokenizer, tmp_path):
    padded, rows, _ = setup(name, tiny_model, tiny_tokenizer, tmp_path, packed=False)
    packed, packed_rows, _ = setup(name, tiny_model, tiny_tokenizer, tmp_path, packed=True)
    assert packed.packed_forward.enabled and packed_rows == rows
    for processes, accumulation in ((1, 1), (2, 2)):
        expected = one_step(padded, rows, processes, accumulation)
        got = one_step(packed, rows, processes, accumulation)
        for key in COMPARED + (ORPO_TERMS if name == "orpo" else ()):
            assert_close(got[key], expected[key], key)
        assert float(expected["grad"].abs().max()) > 0
    if name != "cpo_simpo":
        assert abs(expected["nll_loss"]) > 0 if name == "orpo" else expected["nll_loss"] == 0
    summary = packed.packed_forward.summary()
    assert summary["first_batch_check"]["passed"] and summary["forward"].startswith("packed (prefix-shared")
    computed = summary["tokens"]["policy"]["computed_tokens"]
    assert computed < summary["padded_forward_would_compute"]["policy"]["computed_tokens"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_packed_step_is_the_same_on_any_split_of_the_global_batch(name, tiny_model, tiny_tokenizer, tmp_path):
    trainer, rows, _ = setup(name, tiny_model, tiny_tokenizer, tmp_path, packed=True)
    assert_the_same_on_every_split(trainer, rows, COMPARED)


def test_orpo_scores_the_shared_prompt_once_for_its_nll(tiny_model, tiny_tokenizer, tmp_path):
    """ORPO's NLL covers prompt + chosen answer: the packed layout scores the shared prompt's positions (computed
    once) into the chosen row, never the rejected one's."""
    trainer, rows, _ = setup("orpo", tiny_model, tiny_tokenizer, tmp_path, packed=True)
    batch = trainer.data_collator(rows[:2])
    scored = int((batch["packed_shift_labels"] != -100).sum())
    answers = sum(len(row[f"{side}_input_ids"]) - len(row["prompt_input_ids"]) for row in rows[:2]
                  for side in ("chosen", "rejected"))
    prompts = sum(len(row["prompt_input_ids"]) - 1 for row in rows[:2])
    assert scored == answers + prompts == len(batch["padded_target_index"])


def kto_reference_pass(model_path, tokenizer, work, packed: bool):
    """A KTO trainer's reference pass (precompute_ref_log_probs) on 24 prepared rows, packed or TRL's padded."""
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig

    from conftest import preference_rows, write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data
    from src.trainers.kto import PreparedKTOTrainer

    work.mkdir(parents=True, exist_ok=True)
    pairs = write_jsonl(work / "pairs.jsonl", preference_rows(24, seed=5))
    prepared = prepare_data(DataArguments(dataset_name=str(pairs), max_length=40, kto_from_pairs=True, val_size=2,
                                          test_size=2), SFTArguments(), "kto", 7, tokenizer, work / "cache")
    args = KTOConfig(output_dir=str(work / "out"), per_device_train_batch_size=4, use_cpu=True, report_to=[],
                     bf16=False, max_length=40, beta=0.1, disable_tqdm=True, precompute_ref_log_probs=True)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    forward = PreparedKTOTrainer.forward_for(model, tokenizer, args, None) if packed else {}
    return PreparedKTOTrainer(model=model, args=args, train_dataset=prepared.train, processing_class=tokenizer,
                              **forward)


def test_kto_reference_pass_packed_equals_the_padded_one(tiny_model, tiny_tokenizer, tmp_path):
    """KTO's reference pass: each row's completion and KL completion share its prompt, computed once in one packed
    forward; the cached log-probs of both equal TRL's two padded forwards' (1e-5), fewer tokens computed, and the
    packed cache is its own (the padded pass's key is unchanged)."""
    import torch

    padded = kto_reference_pass(tiny_model, tiny_tokenizer, tmp_path / "padded", packed=False)
    packed = kto_reference_pass(tiny_model, tiny_tokenizer, tmp_path / "packed", packed=True)
    for column in ("ref_logps", "ref_KL_logps"):
        expected, got = (torch.tensor(trainer.train_dataset[column]) for trainer in (padded, packed))
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5, column
    summary = packed.packed_forward.summary()
    assert summary["first_batch_check"]["passed"] and summary["forward"].startswith("packed (prefix-shared")
    assert set(summary["tokens"]) == {"reference"}
    computed = summary["tokens"]["reference"]["computed_tokens"]
    assert computed < summary["padded_forward_would_compute"]["reference"]["computed_tokens"]
    assert packed.reference_cache["train"]["cache"] == "computed"


KTO_COMPARED = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                "logits/chosen", "logits/rejected", "entropy", "grad")


def kto_trainer(policy, reference, tokenizer, prepared, work, packed: bool, precompute: bool):
    """A KTO trainer on the prepared rows, its forward packed (as build_trainer gives it) or TRL's padded one."""
    from trl import KTOConfig

    from src.trainers.kto import PreparedKTOTrainer

    args = KTOConfig(output_dir=str(work / ("packed" if packed else "padded")), per_device_train_batch_size=2,
                     precompute_ref_log_probs=precompute, use_cpu=True, report_to=[], bf16=False, max_length=64,
                     beta=0.5, disable_tqdm=True, desirable_weight=1.0, undesirable_weight=1.5)
    forward = PreparedKTOTrainer.forward_for(policy, tokenizer, args, None) if packed else {}
    return PreparedKTOTrainer(model=policy, ref_model=reference, args=args,
                              train_dataset=prepared.train, processing_class=tokenizer, **forward)


@pytest.mark.parametrize("precompute", [True, False], ids=["reference-cached", "reference-model"])
def test_kto_packed_step_equals_the_padded_one(precompute, tiny_model, tiny_tokenizer, tmp_path):
    """KTO's training step on the packed forward: its KL pass (no gradients, the step's whole batch first) and its
    completion pass (with gradients; and the reference's, when not cached) each packed padding-free, one answer per
    prompt. Loss, KL, every logged metric and the gradient equal the padded step's to 1e-5 on two splits of the global
    batch, the first-batch check passed, and fewer tokens were computed in both passes."""
    import copy

    from transformers import AutoModelForCausalLM

    from conftest import preference_rows, write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data
    from test_kto import GLOBAL_BATCH, _raise_answer_likelihood, kto_step

    rows = preference_rows(24, seed=5)
    for index, row in enumerate(rows):  # prompts of three lengths: the padded batches hold padding
        row["prompt"][0]["content"] += " please" * (4 * (index % 3))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    prepared = prepare_data(DataArguments(dataset_name=str(pairs), max_length=64, kto_from_pairs=True, val_size=2,
                                          test_size=2), SFTArguments(), "kto", 7, tiny_tokenizer, tmp_path / "cache")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    policy = copy.deepcopy(reference)
    _raise_answer_likelihood(policy, prepared.train, tiny_tokenizer)  # a KL term that is not clamped to 0
    padded = kto_trainer(copy.deepcopy(policy), copy.deepcopy(reference), tiny_tokenizer, prepared, tmp_path, False,
                         precompute)
    packed = kto_trainer(policy, reference, tiny_tokenizer, prepared, tmp_path, True, precompute)
    assert packed.packed_forward.enabled and "packed_input_ids" in packed.data_collator(
        [packed.train_dataset[0]]) and "KL_packed_input_ids" in packed.data_collator([packed.train_dataset[0]])
    rows = [packed.train_dataset[index] for index in range(GLOBAL_BATCH)]
    for processes, accumulation in ((1, 1), (2, 2)):
        expected = kto_step(padded, rows, processes, accumulation, shipped=False)
        got = kto_step(packed, rows, processes, accumulation, shipped=False)
        for key in KTO_COMPARED:
            assert_close(got[key], expected[key], key)
    assert expected["kl"] > 1e-3 and float(expected["grad"].abs().max()) > 0
    summary = packed.packed_forward.summary()
    assert summary["first_batch_check"]["passed"], summary
    assert "padded forward for" not in summary["forward"]
    for kind in ("policy", "kl") + (("reference",) if not precompute else ()):
        computed = summary["tokens"][kind]["computed_tokens"]
        assert computed < summary["padded_forward_would_compute"][kind]["computed_tokens"], kind
        assert summary["tokens"][kind]["repeated_prompt_share"] == 0, kind  # one answer per prompt: nothing shared
