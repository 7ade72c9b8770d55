"""The reference log-prob cache: reused when nothing that determines the numbers changed, recomputed when anything
did, built by 2 processes and used by 1 and the other way round, and training losses identical cold or warm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import forked
from conftest import build_tiny_model, preference_rows, thinking_rows, write_jsonl
from src import run_files


def dpo_args(model: Path, data: Path, results: Path, run_name: str, *extra: str) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", run_name, "--batch_size", "8", "--max_steps", "4", "--logging_steps", "1",
            "--eval_strategy", "no", "--save_strategy", "no", "--num_samples", "0", "--judge", "none",
            "--learning_rate", "1e-3", "--max_length", "64", "--val_size", "0", "--test_size", "0", *extra]


def train(args: list[str], cache: Path, processes: int = 1) -> dict:
    """One DPO run on a given cache; its reference log-prob outcome and losses."""
    environ = os.environ | {"PREFKIT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = forked.run_job(processes, args, env=environ) if processes > 1 else forked.run_main(args, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = Path(args[args.index("--results_dir") + 1]) / args[args.index("--run_name") + 1]
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    losses = [record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
    return {"cache": info["reference_log_probs"]["train"]["cache"], "losses": losses, "info": info}


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("refcache")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(40))
    cache = root / "cache"
    cold = train(dpo_args(tiny_model, data, root / "results", "cold"), cache)
    return root, data, cache, cold


def test_first_run_computes_and_records_it(setup):
    _, _, _, cold = setup
    assert cold["cache"] == "computed"
    assert cold["info"]["reference_log_probs"]["train"]["rows"] == 40


def test_warm_cache_is_reused_and_trains_identically(setup, tiny_model):
    root, data, cache, cold = setup
    warm = train(dpo_args(tiny_model, data, root / "results", "warm"), cache)
    assert warm["cache"] == "reused"
    assert warm["losses"] == cold["losses"]


def test_what_does_not_change_the_reference_reuses_it(setup, tiny_model):
    """beta, the loss and the learning rate all changed in one run (a run per change cost a process start each; any
    of them wrongly in the key recomputes, which this run would show)."""
    root, data, cache, _ = setup
    extra = ["--beta", "0.5", "--loss_type", "ipo", "--learning_rate", "3e-4"]
    assert train(dpo_args(tiny_model, data, root / "results", "keep", *extra), cache)["cache"] == "reused"


# A run per part of the key that is computed a different way: the weights (TRL's model hash), the tokenizer and the
# data (the prepared split's fingerprint), and one of the settings the toolkit adds (reference_cache_how, whose every
# part is checked below without a run: a run per setting cost a process start each).
@pytest.mark.parametrize("change", ["weights", "tokenizer_or_chat_template", "data", "ld_alpha"])
def test_what_changes_the_reference_recomputes_it(change, setup, tiny_model, corpus, tmp_path):
    root, data, cache, _ = setup
    model, extra = tiny_model, []
    if change == "weights":
        model = build_tiny_model(tmp_path / "other_seed", corpus, seed=1)
    elif change == "tokenizer_or_chat_template":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = tmp_path / "other_template"
        AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        tokenizer.chat_template = tokenizer.chat_template.replace("<|user|>", "<|user|> ")
        tokenizer.save_pretrained(model)
    elif change == "data":
        rows = preference_rows(40)
        rows[0]["chosen"][0]["content"] += " indeed"
        data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    else:
        extra = ["--ld_alpha", "0.5"]
    assert train(dpo_args(model, data, root / "results", f"change-{change}", *extra), cache)["cache"] == "computed"


@pytest.mark.filterwarnings("ignore:The `'keep_end'` truncation mode is deprecated:FutureWarning")  # TRL's, still valid
def test_every_setting_that_changes_the_log_probs_is_in_the_key():
    """Precision, device, LD-DPO weighting, max_length, truncation and the forward each change the key's part
    (the run above shows that part reaches the cache: ld_alpha recomputes)."""
    from trl import DPOConfig

    from src.trainers.dpo import reference_cache_how

    def how(device="cpu", ld_alpha=None, forward="padded", **fields):
        fields = {"bf16": False, "truncation_mode": "keep_start"} | fields
        args = DPOConfig(output_dir="unused", use_cpu=True, report_to=[], **fields)
        return reference_cache_how(args, device, ld_alpha, forward)

    base = how()
    changed = [how(bf16=True), how(fp16=True), how(device="cuda"), how(ld_alpha=0.5), how(max_length=48),
               how(truncation_mode="keep_end"), how(forward="packed-v3")]
    assert all(variant != base for variant in changed) and len(set(changed)) == len(changed)
    assert how() == base  # and the same settings give the same key


def test_a_cache_built_by_two_processes_serves_one_and_the_other_way_round(setup, tiny_model, tmp_path):
    _, data, one_built, cold = setup  # the module's cache: built by one process (the cold run)
    two_built = tmp_path / "cache-2"
    by_two = train(dpo_args(tiny_model, data, tmp_path / "results", "two"), two_built, processes=2)
    assert by_two["cache"] == "computed"
    assert train(dpo_args(tiny_model, data, tmp_path / "results", "one"), two_built)["cache"] == "reused"
    by_two_warm = train(dpo_args(tiny_model, data, tmp_path / "results", "two-warm"), one_built, processes=2)
    assert by_two_warm["cache"] == "reused"
    # Same global batch on 1 or 2 processes, reference log-probs from either: the same training.
    assert by_two_warm["losses"] == pytest.approx(cold["losses"], rel=1e-4, abs=1e-6)
    assert by_two["losses"] == pytest.approx(cold["losses"], rel=1e-4, abs=1e-6)


def test_reasoning_pairs_cached_by_one_process_serve_two_and_train_the_same(thinking_model, tmp_path):
    """Issue 38: pairs whose answers reason, prepared through DeepSeek-R1-Distill's template (their reasoning trained):
    the cache one process builds serves two, and the two train the same numbers as the one."""
    data = write_jsonl(tmp_path / "thinking.jsonl", thinking_rows(40))
    cache = tmp_path / "cache"
    one = train(dpo_args(thinking_model, data, tmp_path / "results", "one"), cache)
    two = train(dpo_args(thinking_model, data, tmp_path / "results", "two"), cache, processes=2)
    assert (one["cache"], two["cache"]) == ("computed", "reused")
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6) and len(one["losses"]) == 4
    assert one["info"]["data"]["reasoning"] == "keep"  # and the answers trained hold it:
    assert one["info"]["data_audit"]["train"]["chosen_reasoning_share"] == 1.0


def test_lora_runs_share_the_reference_cache_of_their_base(setup, tiny_model):
    """With LoRA the reference is the base with its adapters disabled: the cache is keyed by the base's weights alone
    (src/trainers/dpo.py `base_weights`: the names and tensors of the same model without adapters), so a LoRA run
    reuses the cache a full run of the same base built (the module's cold run), whatever its adapters (rank, targets:
    their random start differs); and what it reuses is its reference's log-probs: a first loss of ln 2, the policy
    starting as the base (LoRA's B at zero). Before, TRL's key hashed the adapters too and each LoRA setting
    recomputed."""
    import math

    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from src.config import ModelArguments
    from src.models import peft_config
    from src.trainers.dpo import base_weights

    _, data, cache, _ = setup
    plain = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), peft_config(ModelArguments(
        model_name_or_path=str(tiny_model), use_lora=True)))
    weights = base_weights(adapted)
    assert weights.keys() == plain.keys() and all(torch.equal(weights[name], plain[name]) for name in plain)
    lora = [["--use_lora", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"], ["--use_lora", "--lora_r", "8"]]
    for index, flags in enumerate(lora):
        run = train(dpo_args(tiny_model, data, setup[0] / "results", f"lora-{index}", *flags), cache)
        assert run["cache"] == "reused" and run["info"]["use_lora"], flags
        assert run["losses"][0] == pytest.approx(math.log(2), rel=1e-7), flags


def test_every_run_accounts_for_its_throughput(setup):
    _, _, _, cold = setup
    throughput = cold["info"]["summary"]["throughput"]
    assert throughput["tokens_per_second"] > 0 and throughput["samples_per_second"] > 0
    assert 0 <= throughput["padding_fraction"] < 1 and throughput["peak_memory_mb"] > 0
