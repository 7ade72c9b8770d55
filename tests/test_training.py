"""End to end on CPU: real torchrun jobs (gloo) that train as one, world-size invariance, LoRA and 4-bit, reloading."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

import forked
import rank_probe
from conftest import preference_rows, write_jsonl
from src import run_files, seams


def launch(nproc: int, args: list[str], probe_dir: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """torchrun on `nproc` CPU processes running the instrumented entry point; fails the test with its output."""
    result = forked.run_job(nproc, [str(probe_dir), *args], env=os.environ | {"OMP_NUM_THREADS": "1"},
                            timeout=timeout, entry=rank_probe.entry)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def probes(probe_dir: Path, stage: str, world_size: int) -> list[dict]:
    return [json.loads((probe_dir / f"{stage}_rank{rank}.json").read_text()) for rank in range(world_size)]


def common_args(model: Path, data: Path, results: Path, run_name: str, stage: str) -> list[str]:
    return ["--stage", stage, "--model_name_or_path", str(model), "--dataset_name", str(data),
            "--results_dir", str(results), "--run_name", run_name, "--max_length", "64", "--logging_steps", "1",
            "--eval_steps", "2", "--num_samples", "4", "--max_new_tokens", "6", "--judge", "none", "--seed", "3",
            "--val_size", "4", "--test_size", "4"]


def assert_trained_as_one_job(probe_dir: Path, stage: str, steps: int):
    ranks = probes(probe_dir, stage, 2)
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert [rank["steps"] for rank in ranks] == [steps, steps]
    assert ranks[0]["weights"] == ranks[1]["weights"], "the ranks ended with different weights"
    for step in ranks[0]["seen"]:
        mine, theirs = set(ranks[0]["seen"][step]), set(ranks[1]["seen"][step])
        assert mine and theirs and not mine & theirs, f"step {step}: the ranks trained on the same rows"


def assert_run_dir_complete(run_dir: Path, world_size: int, stage: str, samples: bool = True):
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    for key in ("world_size", "backend", "per_device_batch_size", "gradient_accumulation_steps", "global_batch_size",
                "learning_rate", "base_learning_rate", "precision", "stage", "versions", "git_commit", "summary"):
        assert key in info, key
    assert (info["world_size"], info["backend"], info["stage"], info["precision"]) == (world_size, "gloo", stage,
                                                                                     "fp32")
    metrics = run_files.read_jsonl(run_dir / run_files.METRICS)
    train = [record for record in metrics if "loss" in record]
    assert train and all(math.isfinite(record["loss"]) for record in train)
    assert any("eval_loss" in record for record in metrics)
    for split in ("val", "test") if samples else ():  # a reward model answers no prompts: no sample files
        answered = run_files.read_jsonl(run_dir / run_files.samples_file(split))
        assert [sample["index"] for sample in answered] == [0, 1, 2, 3]
    return info, metrics


def assert_reloads_generates_and_changed(final_dir: Path, initial_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    initial = AutoModelForCausalLM.from_pretrained(initial_dir)
    changed = [name for (name, p), (_, q) in zip(trained.named_parameters(), initial.named_parameters())
               if not torch.equal(p, q)]
    assert len(changed) > len(list(trained.parameters())) // 2, "training left most parameters unchanged"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "what color is the sky"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = trained.generate(**ids, max_new_tokens=5, do_sample=False)
    assert output.shape[1] > ids["input_ids"].shape[1]


def test_sft_on_two_processes_trains_as_one_job(tiny_model, tmp_path):
    rows = [{"messages": row["prompt"] + row["chosen"]} for row in preference_rows(48)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    args = common_args(tiny_model, data, tmp_path / "results", "sft2", "sft") + [
        "--batch_size", "8", "--max_steps", "4", "--learning_rate", "1e-3", "--assistant_only_loss"]
    launch(2, args, tmp_path / "probe")
    assert_trained_as_one_job(tmp_path / "probe", "sft", 4)
    assert_run_dir_complete(tmp_path / "results" / "sft2", 2, "sft")
    assert_reloads_generates_and_changed(tmp_path / "results" / "sft2" / "model" / "final", tiny_model)


# Logged per step, the same on any split: the token means too (the window's tokens, not TRL's mean of micro-batch ratios)
SPLIT_INVARIANT = ("loss", "rewards/margins", "logps/chosen", "entropy", "logits/chosen", "logits/rejected",
                   "mean_token_accuracy")


def test_same_global_batch_gives_the_same_loss_curve_on_one_and_two_processes(tiny_model, tmp_path):
    """Global batch 8 with at most 2 per device: 1 process x 4 accumulation steps vs 2 processes x 2: the same losses
    and logged metrics (SPLIT_INVARIANT: the token means among them). The data and answer audits (src/audit/) come out
    the same too: the judge part and the answers are split across the ranks.
    The 2-process run trains as one job (each rank its own rows, the same weights at the end) and saves a model that
    reloads, generates and has changed."""
    rows = preference_rows(48)
    for index, row in enumerate(rows):  # answers of 1 to 3 more tokens: micro-batches of different token counts
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " very" * (1 + index % 3)
    preference_file = write_jsonl(tmp_path / "pairs.jsonl", rows)
    logged, audits = {}, {}
    for nproc in (1, 2):
        args = common_args(tiny_model, preference_file, tmp_path / "results", f"w{nproc}", "dpo") + [
            "--batch_size", "8", "--micro_batch_size", "2", "--max_steps", "5", "--learning_rate", "1e-3",
            "--judge", "tests.round_judges:by_length", "--audit_judge_pairs", "30"]
        launch(nproc, args, tmp_path / f"probe{nproc}")
        info = run_files.read_json(tmp_path / "results" / f"w{nproc}" / run_files.TRAINING_INFO)
        assert info["gradient_accumulation_steps"] == 4 // nproc and info["per_device_batch_size"] == 2
        metrics = run_files.read_jsonl(tmp_path / "results" / f"w{nproc}" / run_files.METRICS)
        logged[nproc] = [[record[key] for key in SPLIT_INVARIANT] for record in metrics if "loss" in record]
        audits[nproc] = {"data_audit": info["data_audit"], "answers": info["answers"]}
    assert len(logged[1]) == 5
    for step, (one, two) in enumerate(zip(logged[1], logged[2]), start=1):
        assert one == pytest.approx(two, rel=1e-4, abs=1e-6), step
    train = audits[1]["data_audit"]["train"]
    for key in ("pairs", "identical_pairs", "duplicate_pairs", "chosen_longer_share", "chosen_truncated_share",
                "rejected_truncated_share", "reference_agreement", "judge_inverted_share", "judge_tie_share",
                "inverted_pairs_file"):
        assert key in train, key
    assert train["judged_pairs"] == 30 and train["judge_inverted_share"] == 1.0  # by_length: the rejected is longer
    assert 0 <= train["reference_agreement"] <= 1 and set(audits[1]["answers"]) == {"val", "test"}
    for key in ("length_before", "length_after", "cut_share_after", "repetition_share_after"):
        assert key in audits[1]["answers"]["test"], key
    assert _same(audits[1], audits[2])
    assert_trained_as_one_job(tmp_path / "probe2", "dpo", 5)
    run_dir = tmp_path / "results" / "w2"
    info, metrics = assert_run_dir_complete(run_dir, 2, "dpo")
    assert (info["per_device_batch_size"], info["gradient_accumulation_steps"], info["global_batch_size"]) == (2, 2, 8)
    assert all(key in metrics[-2] or key in metrics[-3] for key in ("rewards/margins",))
    assert_reloads_generates_and_changed(run_dir / "model" / "final", tiny_model)
    report = (tmp_path / "results" / "w1" / "report.md").read_text()
    assert "## Data" in report and "## Answers" in report and "plots/data.png" in report
    assert (tmp_path / "results" / "w1" / "plots" / "data.png").stat().st_size > 0


@pytest.mark.parametrize("stage", ["dpo", "sft"])
def test_an_epoch_that_ends_in_a_partial_global_batch_gives_the_same_losses_on_any_split(tiny_model, tmp_path, stage):
    """44 training examples, global batch 8: each epoch trains 40 (5 whole steps) and 1.2 epochs are 6 steps on
    1 process x 2 accumulation and 2 processes x 1. Before each epoch was cut to whole global batches, step 6 was the
    first epoch's 4 leftover examples: one micro-batch's mean on one process, those 4 beside 4 repeated ones on two
    (DPO's loss 0.6411 vs 0.6387, SFT's 5.7386 vs 5.7508), and the steps after differed too. The 2-process job is
    killed after checkpoint-4 (both ranks, the kill_at_checkpoint seam) and relaunched: it resumes across the epoch's end
    to the same numbers."""
    rows = preference_rows(52)  # 4 validation, 4 test, 44 training
    if stage == "sft":  # answers of 1 to 3 more tokens: micro-batches of different token counts
        rows = [{"messages": row["prompt"] + [{**row["chosen"][0], "content": row["chosen"][0]["content"]
                                                + " very" * (1 + index % 3)}]} for index, row in enumerate(rows)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    losses = {}
    for nproc in (1, 2):
        run_dir = tmp_path / "results" / f"w{nproc}"
        args = common_args(tiny_model, data, tmp_path / "results", f"w{nproc}", stage) + [
            "--batch_size", "8", "--micro_batch_size", "4", "--num_epochs", "1.2", "--learning_rate", "1e-3",
            "--eval_steps", "100"]
        if nproc == 2:
            killed = tmp_path / "killed"
            args += ["--save_steps", "4"]
            environment = seams.env(os.environ | {"OMP_NUM_THREADS": "1"}, kill_at_checkpoint=f"after_complete:4:*:{killed}")
            assert forked.run_job(2, args, env=environment, timeout=600).returncode != 0  # both: no wait for a survivor
            assert (tmp_path / "killed.rank0").exists() and (tmp_path / "killed.rank1").exists()
        result = forked.run_job(nproc, args, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        assert result.stdout.count("the last 4 (a partial global batch of 8) are not trained") == 1, result.stdout
        info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
        assert (info["trained_per_epoch"], info["planned_steps"]) == (40, 6)
        assert [resume["from_step"] for resume in info["resumes"]] == ([4] if nproc == 2 else [])
        records = [record for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record]
        assert [record["epoch"] for record in records] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
        # the token means too (TRL logs a mean of micro-batch ratios; the toolkit, the step's token mean)
        losses[nproc] = [[record[key] for key in ("loss", "entropy", "mean_token_accuracy")] for record in records]
    for one, two in zip(losses[1], losses[2]):
        assert one == pytest.approx(two, rel=1e-5, abs=1e-6)


def test_fewer_examples_than_a_global_batch_give_the_same_losses_on_any_split(tiny_model, tmp_path):
    """3 training pairs at a global batch of 4 (an on-policy round's few pairs): each step fills the batch with one
    pair twice, drawn alike on 1 process x 2 accumulation and 2 x 1. Before, the one process stepped on 2 + 1 pairs
    (micro-batch means) and the two padded with another pair: step 2's loss 0.675463 vs 0.675408, step 3's 0.667522
    vs 0.668792."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(11))  # 4 validation, 4 test, 3 training
    losses = {}
    for nproc in (1, 2):
        run_dir = tmp_path / "results" / f"w{nproc}"
        args = common_args(tiny_model, data, tmp_path / "results", f"w{nproc}", "dpo") + [
            "--batch_size", "4", "--micro_batch_size", "2", "--max_steps", "3", "--learning_rate", "1e-3",
            "--eval_steps", "100"]
        result = forked.run_job(nproc, args, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "3 pairs fill less than a global batch of 4: its step trains 1 of them twice" in result.stdout
        info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
        assert info["trained_per_epoch"] == 4 and info["one_job"]["disjoint_rows_per_step"], info["one_job"]
        assert "did not train as one job" not in result.stdout  # a pair twice in a step may fall on both ranks
        losses[nproc] = [record["loss"] for record in run_files.read_jsonl(run_dir / run_files.METRICS)
                         if "loss" in record]
    assert len(losses[1]) == 3 and losses[1] == pytest.approx(losses[2], rel=1e-5, abs=1e-6)


def test_lora_sft_differs_between_splits_only_by_its_dropout_masks(tiny_model, tmp_path):
    """Issue 57: LoRA SFT on 1 process x 8 and 2 x 4 drifted apart (the first loss equal, 5e-5 relative by step 2,
    the grad norms 2.3% apart from the first step; ZeRO-2 as 2-process DDP) while full SFT agreed to 1e-7. The cause,
    measured: LoRA's dropout (TRL's default --lora_dropout 0.05; SFT, unlike DPO, leaves dropout on) draws its masks
    from each process's random stream, so another split of the same global batch draws other masks. The first loss
    still agrees (LoRA's B starts at zero: the adapter adds nothing whatever its mask), its gradient does not; with
    --lora_dropout 0 the splits agree to fp32, every step, so Adam turning summation-order noise into whole steps is not
    it (docs/configuration.md). Pinned: without dropout 1e-6 at the first step and 1e-5 after; with it, the first loss
    equal, the grad norms apart by more than fp32 and less than 10%, the losses by less than 1e-3."""
    rows = [{"messages": row["prompt"] + [{**row["chosen"][0], "content": row["chosen"][0]["content"]
                                            + " very" * (1 + index % 3)}]} for index, row in enumerate(preference_rows(32))]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    logged = {}
    for dropout in ("0.05", "0"):
        for nproc in (1, 2):
            name = f"d{dropout}-w{nproc}"
            args = common_args(tiny_model, data, tmp_path / "results", name, "sft") + [
                "--batch_size", "8", "--max_steps", "3", "--learning_rate", "1e-3", "--use_lora", "true",
                "--lora_dropout", dropout, "--num_samples", "0", "--eval_strategy", "no"]
            result = forked.run_job(nproc, args, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
            assert result.returncode == 0, result.stderr[-4000:]
            records = [record for record in run_files.read_jsonl(tmp_path / "results" / name / run_files.METRICS)
                       if "loss" in record]
            logged[dropout, nproc] = {key: [record[key] for record in records] for key in ("loss", "grad_norm")}
    exact, one, two = logged["0", 1], logged["0.05", 1], logged["0.05", 2]
    for key in ("loss", "grad_norm"):
        assert logged["0", 2][key][0] == pytest.approx(exact[key][0], rel=1e-6), key
        assert logged["0", 2][key] == pytest.approx(exact[key], rel=1e-5), key
    assert two["loss"][0] == pytest.approx(one["loss"][0], rel=1e-6)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    apart = [abs(a - b) / b for a, b in zip(two["grad_norm"], one["grad_norm"])]
    assert 1e-5 < max(apart) < 0.1, apart


def _same(first, second, path="") -> bool:
    """Equal but for timings, floats within 1e-5 (the reference log-probs are reduced in another order on 2
    processes)."""
    if isinstance(first, dict):
        assert first.keys() == second.keys(), path
        return all(_same(first[key], second[key], f"{path}.{key}") for key in first if not key.endswith("_seconds"))
    if isinstance(first, list):
        assert len(first) == len(second), path
        return all(_same(a, b, f"{path}[{index}]") for index, (a, b) in enumerate(zip(first, second)))
    if isinstance(first, float):
        assert first == pytest.approx(second, rel=1e-5, abs=1e-5), path
        return True
    assert first == second, path
    return True


def run_single(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return forked.run_main(args, timeout=timeout)


def test_lora_run_saves_an_adapter_that_reloads_and_a_merged_copy(tiny_model, preference_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = common_args(tiny_model, preference_file, tmp_path / "results", "lora", "dpo") + [
        "--use_lora", "--lora_r", "4", "--batch_size", "4", "--max_steps", "3", "--learning_rate", "1e-3",
        "--merge_adapter"]
    result = run_single(args)
    assert result.returncode == 0, result.stderr[-3000:]
    final = tmp_path / "results" / "lora" / "model" / "final"
    assert (final / "adapter_model.safetensors").stat().st_size > 0
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), final)
    assert any("lora_B" in name and param.abs().sum() > 0 for name, param in reloaded.named_parameters())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "results" / "lora" / "model" / "merged")
    assert sum(p.numel() for p in merged.parameters()) == sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    info = run_files.read_json(tmp_path / "results" / "lora" / run_files.TRAINING_INFO)
    assert info["use_lora"] is True


def test_qlora_runs_on_cpu_where_bitsandbytes_can(tmp_path):
    """The embedded model (128 wide) quantizes on bitsandbytes' CPU backend; QLoRA trains and saves an adapter."""
    args = ["--stage", "dpo", "--model_name_or_path", "embedded", "--dataset_name", "embedded", "--use_lora",
            "--load_in_4bit", "--batch_size", "4", "--max_steps", "2", "--num_samples", "2", "--max_new_tokens", "4",
            "--results_dir", str(tmp_path / "results"), "--run_name", "qlora", "--eval_strategy", "no",
            "--max_length", "64", "--learning_rate", "1e-4", "--max_train_samples", "16"]  # 4-bit on CPU is slow
    result = run_single(args)
    assert result.returncode == 0, result.stderr[-3000:]
    info = run_files.read_json(tmp_path / "results" / "qlora" / run_files.TRAINING_INFO)
    assert info["load_in_4bit"] is True and info["summary"]["completed_steps"] == 2
    # DPO alone on the embedded model: what it starts from, said plainly (test_config.py has the rule)
    assert info["starts_from"].startswith("the untrained embedded base model")
    assert "starts from  the untrained embedded base model" in result.stdout
    assert "warning: DPO starts from the untrained embedded base model" in result.stdout, result.stdout[-3000:]
    assert any(warning.startswith("DPO starts from the untrained") for warning in info["warnings"])
    assert (tmp_path / "results" / "qlora" / "model" / "final" / "adapter_model.safetensors").exists()


def _bitsandbytes_runs_4bit_at_width(width: int) -> bool:
    """Whether this machine's bitsandbytes CPU backend runs a 4-bit layer this narrow (it depends on the CPU and the
    bitsandbytes build: some refuse widths that are not multiples of 64)."""
    import torch
    from bitsandbytes.nn import Linear4bit

    layer = Linear4bit(width, width, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    try:
        with torch.no_grad():
            layer(torch.randn(1, width))
        return True
    except (RuntimeError, ValueError):
        return False


def test_qlora_of_a_narrow_model_trains_or_gets_a_clear_message(tiny_model, preference_file, tmp_path):
    """The tiny model is 32 wide: where bitsandbytes runs that, QLoRA trains; where it cannot, one clear line."""
    pytest.importorskip("bitsandbytes")
    args = common_args(tiny_model, preference_file, tmp_path / "results", "q", "dpo") + [
        "--use_lora", "--load_in_4bit", "--max_steps", "1", "--batch_size", "4"]
    result = run_single(args)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if _bitsandbytes_runs_4bit_at_width(32):
        assert result.returncode == 0, result.stderr[-3000:]
        info = run_files.read_json(tmp_path / "results" / "q" / run_files.TRAINING_INFO)
        assert info["load_in_4bit"] is True and info["summary"]["completed_steps"] == 1
    else:
        assert result.returncode == 2
        assert "error: --load_in_4bit: bitsandbytes could not run" in result.stderr


def test_sft_then_dpo_then_grpo_of_a_base_model_with_chat_template_path_resumes_in_its_middle_stage(
        tiny_model, preference_file, tmp_path):
    """A base model (no chat template) on chat data: refused naming the flag; with --chat_template_path (a tokenizer
    directory bringing a new special token) the three stages of sft_then_dpo_then_grpo train (SFT and DPO on the pairs,
    GRPO on their prompts), each from the model before: the SFT model is saved with the template and the grown
    embeddings, which DPO and then GRPO start from. The launch is killed in the DPO stage, right after its checkpoint-1
    (a seam), and the same command relaunched reuses the SFT stage, resumes DPO from that checkpoint, and trains GRPO;
    the final report judges the held-out prompts untrained, after SFT, after DPO and after GRPO."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = None
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(base)
    source = AutoTokenizer.from_pretrained(tiny_model)
    source.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    source.save_pretrained(tmp_path / "instruct")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": row["prompt"]} for row in preference_rows(48)])

    args = common_args(base, prompts, tmp_path / "results", "base", "sft_then_dpo_then_grpo") + [
        "--batch_size", "4", "--max_steps", "2", "--learning_rate", "1e-3", "--judge", "tests.round_judges:by_length",
        "--num_generations", "2", "--audit_judge_pairs", "0", "--sft.max_steps", "2", "--sft.dataset_name",
        str(preference_file), "--dpo.max_steps", "2", "--dpo.save_steps", "1", "--dpo.dataset_name",
        str(preference_file)]
    refused = run_single(args)
    assert refused.returncode == 2 and "--chat_template_path" in refused.stderr, refused.stderr[-2000:]
    args += ["--chat_template_path", str(tmp_path / "instruct")]
    killed = tmp_path / "killed"
    first = forked.run_main(args, env=seams.env(kill_at_checkpoint=f"after_complete:1:0:{killed}"))
    assert killed.exists() and first.returncode == -9, first.stderr[-3000:]
    result = run_single(args)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "results" / "base"
    assert "SFT → " in result.stdout and "finished in an earlier launch, reused" in result.stdout
    assert f"resuming from {run_dir / 'dpo' / 'model' / 'checkpoint-1'} (step 1 of 2)" in result.stdout
    sft_final = run_dir / "sft" / "model" / "final"
    saved = AutoTokenizer.from_pretrained(sft_final)
    assert saved.chat_template and "<|tool|>" in saved.get_vocab()
    assert AutoModelForCausalLM.from_pretrained(sft_final).get_input_embeddings().weight.shape[0] >= len(saved)
    infos = {name: run_files.read_json(directory / run_files.TRAINING_INFO)
             for name, directory in (("sft", run_dir / "sft"), ("dpo", run_dir / "dpo"), ("grpo", run_dir))}
    assert infos["dpo"]["model_name_or_path"] == str(sft_final)
    assert infos["sft"]["starts_from"] == str(base) and not any("untrained" in w for w in infos["dpo"]["warnings"])
    assert infos["dpo"]["starts_from"] == f"the sft stage's final model ({sft_final})"
    assert f"starts from  the dpo stage's final model ({run_dir / 'dpo' / 'model' / 'final'})" in result.stdout
    assert infos["grpo"]["model_name_or_path"] == str(run_dir / "dpo" / "model" / "final")
    assert [resume["from_step"] for resume in infos["dpo"]["resumes"]] == [1] and not infos["grpo"].get("resumes")
    assert AutoTokenizer.from_pretrained(run_dir / "model" / "final").chat_template
    report = (run_dir / "report.md").read_text()
    assert "| untrained | after SFT | after DPO | after GRPO | GRPO change |" in report, report[:3000]


def test_the_one_job_check_compares_the_rows_each_rank_was_given_not_their_content():
    """Rows with the same content (duplicates are common in public sets) given to two ranks in one step are not a
    broken job; the same row given to both is. Each rank's loader is sharded as accelerate shards the trainer's, and
    the check records what that loader fetched."""
    from accelerate.data_loader import BatchSamplerShard
    from datasets import Dataset
    from torch.utils.data import BatchSampler, DataLoader

    from src.trainers.callbacks import OneJobCheck, steps_with_shared_rows

    # Rows i and i + 8 are identical; each step gives rank 0 two rows (a batch of 2) and rank 1 their duplicates.
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3 + i % 8] for i in range(16)]})
    order = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]

    def given_to(rank: int, shards: int = 2) -> tuple[dict[int, list[int]], list]:
        check, contents = OneJobCheck(), []
        loader = DataLoader(rows, batch_sampler=BatchSamplerShard(BatchSampler(order, batch_size=2, drop_last=False),
                                                                  num_processes=shards, process_index=rank),
                            collate_fn=lambda batch: {"input_ids": [row["input_ids"] for row in batch]})
        check.on_train_dataloader(loader)
        for step, batch in enumerate(loader):
            check.step = step
            check.on_micro_batch(None, batch)
            contents.append(batch["input_ids"])
        return check.rows, contents

    (rank0, content0), (rank1, content1) = given_to(0), given_to(1)
    assert content0 == content1  # the same content on both ranks in every step...
    assert rank0 == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}  # ...as different rows
    assert rank1 == {0: [8, 9], 1: [10, 11], 2: [12, 13], 3: [14, 15]}
    assert steps_with_shared_rows([rank0, rank1]) == []
    # A broken sampler (every rank fed the whole batch) is still found, step by step.
    assert steps_with_shared_rows([given_to(0, shards=1)[0], given_to(0, shards=1)[0]]) == list(range(8))
    # 3 rows and a step of 4 (stage_plan.trained_per_epoch): one row twice, on both ranks or one; not every row: wrong
    assert steps_with_shared_rows([{0: [2, 0]}, {0: [1, 2]}], repeated_from=3) == []
    assert steps_with_shared_rows([{0: [2, 0]}, {0: [2, 0]}], repeated_from=3) == [0]
