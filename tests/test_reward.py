"""--stage reward: TRL's RewardTrainer on the preference data, for real on the tiny model (one process and a two-process
torchrun job), its tokenization checked against TRL's own, and the trained model used as the reward-model judge."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import preference_rows, write_jsonl
from src import run_files
from src.config import DataArguments, SFTArguments
from src.data import normalize_row, prepare_data, tokenize_reward
from test_training import assert_run_dir_complete, assert_trained_as_one_job, common_args, launch, run_single

ROWS = preference_rows(24)


def _text(messages):
    return messages[0]["content"]


def _trl_reward_ids(tokenizer, model_path, rows, tmp_path):
    """chosen_ids / rejected_ids as TRL's RewardTrainer prepares the raw rows itself."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_length=64,
                        activation_checkpointing=False)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    prepared = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer).train_dataset
    return prepared["chosen_ids"], prepared["rejected_ids"]


SHAPES = {
    "chat": lambda row: row,
    "text": lambda row: {"prompt": _text(row["prompt"]) + " ", "chosen": _text(row["chosen"]),
                         "rejected": _text(row["rejected"])},
    # No prompt column: TRL tokenizes the whole conversations; the toolkit splits the shared prompt off first.
    "implicit_chat": lambda row: {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]},
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reward_tokenization_matches_trl(shape, tiny_tokenizer, tiny_model, tmp_path):
    rows = [SHAPES[shape](row) for row in ROWS[:12]]
    theirs = _trl_reward_ids(tiny_tokenizer, tiny_model, rows, tmp_path)
    normalized = [normalize_row(row, "implicit_prompt" if shape == "implicit_chat" else "explicit_prompt", None)
                  for row in rows]
    ours = [tokenize_reward(row, tiny_tokenizer) for row in normalized]
    assert [item["chosen_ids"] for item in ours] == theirs[0]
    assert [item["rejected_ids"] for item in ours] == theirs[1]


def test_prepared_reward_data_is_what_trl_would_train_on(tiny_tokenizer, tiny_model, tmp_path):
    """Through the whole data path (load, shape, checks, splits, cache): the ids of every split are TRL's for the
    same rows, pairs over --max_length are dropped and counted (TRL's rule), and held-out rows keep their prompt as
    the data has it for judges."""
    rows = [dict(row) for row in ROWS]
    rows[0] = dict(rows[0], chosen=[{"role": "assistant", "content": "the sky is blue " * 20}])
    data = DataArguments(dataset_name=str(write_jsonl(tmp_path / "p.jsonl", rows)), val_size=4, test_size=4,
                         max_length=64)
    prepared = prepare_data(data, SFTArguments(), "reward", 0, tiny_tokenizer, tmp_path / "cache")
    kept = sum(counts["kept"] for counts in prepared.summary["splits"].values())
    assert kept == 23 and sum(counts["dropped_too_long"] for counts in prepared.summary["splits"].values()) == 1
    for split in prepared.splits.values():
        raw = [{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in split]
        assert (split["chosen_ids"], split["rejected_ids"]) == _trl_reward_ids(tiny_tokenizer, tiny_model, raw,
                                                                                tmp_path)
    assert prepared.test[0]["judge_prompt"] == prepared.test[0]["prompt"]


def reward_args(model, data, results, run_name):
    return common_args(model, data, results, run_name, "reward") + ["--batch_size", "8", "--learning_rate", "1e-3"]


def held_out_test_pairs(data_file, tokenizer, tmp_path, stage: str = "reward"):
    """The held-out test pairs of a run made with reward_args (its split settings and seed)."""
    data = DataArguments(dataset_name=str(data_file), val_size=4, test_size=4, max_length=64)
    return prepare_data(data, SFTArguments(), stage, 3, tokenizer, tmp_path / "cache").test


def assert_pair_accuracy_recorded(info: dict, pairs: int = 4):
    assert info["judge"]["metric"] == "pair_accuracy" and info["judge"]["split"] == "test"
    assert info["judge"]["n"] == pairs
    assert set(info["judges"]) == {"val", "test"}
    for result in info["judges"].values():
        assert 0 <= result["before"] <= 1 and 0 <= result["after"] <= 1
        assert result["details"]["mean_margin"]["after"] > result["details"]["mean_margin"]["before"]


def test_reward_run_trains_reloads_and_judges(tiny_model, tiny_tokenizer, preference_file, tmp_path):
    """One process, all weights: the score head and the body train, TRL's metrics are recorded and finite, the pair
    accuracy is measured before and after, and the saved model is a reward model that RewardModelJudge loads and
    that scores the held-out answers exactly as it was trained to (same ids, same numbers as the run measured)."""
    from transformers import AutoModelForSequenceClassification, set_seed

    from src.judges import RewardModelJudge, reward_scores
    from src.pipeline.held_out import record_samples
    from src.reporting.report import build_report

    result = run_single(reward_args(tiny_model, preference_file, tmp_path / "results", "rm") + ["--max_steps", "6"])
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "results" / "rm"
    info, metrics = assert_run_dir_complete(run_dir, 1, "reward", samples=False)
    train = [record for record in metrics if "accuracy" in record]
    assert len(train) == 6 and all(math.isfinite(record["margin"]) for record in train)
    assert any("eval_accuracy" in record for record in metrics)
    assert_pair_accuracy_recorded(info)
    assert info["summary"]["final_reward_accuracy_train"] == train[-1]["accuracy"]
    assert info["one_job"]["identical_weights"]
    report = (run_dir / "report.md").read_text()
    assert "pair accuracy" in report and (run_dir / "plots" / "reward_accuracy.png").exists()
    copied = tmp_path / "metrics_only"  # the report from metrics.jsonl alone recognises a reward run
    copied.mkdir()
    (copied / run_files.METRICS).write_bytes((run_dir / run_files.METRICS).read_bytes())
    status_line, _, title = build_report(copied).read_text().split("\n")[:3]  # the first line is the run's status
    assert status_line.startswith("**") and title.startswith("# REWARD run")
    assert (copied / "plots" / "margins.png").exists()

    final = run_dir / "model" / "final"
    trained = AutoModelForSequenceClassification.from_pretrained(final)
    assert trained.config.num_labels == 1 and trained.config.pad_token_id == tiny_tokenizer.pad_token_id
    set_seed(3)  # the run's seed: the score head it started from
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    assert not torch.equal(trained.score.weight, initial.score.weight)
    body, initial_body = dict(trained.model.named_parameters()), dict(initial.model.named_parameters())
    assert sum(not torch.equal(body[name], initial_body[name]) for name in body) > len(body) // 2

    # The judge round trip, on the run's own test pairs.
    test = held_out_test_pairs(preference_file, tiny_tokenizer, tmp_path)
    judge = RewardModelJudge(str(final), device="cpu")
    for row in test:
        assert judge._input_ids(row["judge_prompt"], _text(row["chosen"])) == row["chosen_ids"]
    prompts = [row["judge_prompt"] for row in test]
    chosen = judge.score(prompts, [_text(row["chosen"]) for row in test])
    rejected = judge.score(prompts, [_text(row["rejected"]) for row in test])
    recorded = info["judges"]["test"]
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(test) == recorded["after"]
    assert sum(c - r for c, r in zip(chosen, rejected)) / len(test) == pytest.approx(
        recorded["details"]["mean_margin"]["after"], rel=1e-4)
    # As the judge of a DPO run's held-out answers (here: the trained answers are the chosen ones, the reference
    # answers the rejected ones), fed through the pipeline's own sample recording: it must score the very ids the
    # reward model was trained on, not the policy's rendering of the prompt.
    dpo_test = held_out_test_pairs(preference_file, tiny_tokenizer, tmp_path, "dpo").to_list()
    (tmp_path / "dpo_run").mkdir()
    judged = record_samples(tmp_path / "dpo_run", {"test": dpo_test}, {"test": [_text(row["rejected"]) for row in test]},
                            {"test": [_text(row["chosen"]) for row in test]}, judge)
    assert judged["test"]["after"] == recorded["after"]
    samples = run_files.read_jsonl(tmp_path / "dpo_run" / run_files.samples_file("test"))
    assert [sample["verdict"]["trained"]["reward"] for sample in samples] == pytest.approx(
        reward_scores(trained, test["chosen_ids"], tiny_tokenizer.pad_token_id, 8), abs=1e-5)


def test_lora_reward_run_trains_the_score_head_and_saves_a_merged_reward_model(tiny_model, preference_file,
                                                                                 tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    result = run_single(reward_args(tiny_model, preference_file, tmp_path / "results", "rm_lora") + [
        "--max_steps", "3", "--use_lora", "--lora_r", "4", "--eval_strategy", "no",
        "--center_rewards_coefficient", "0.01"])  # a RewardConfig field, passed through to TRL
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "results" / "rm_lora"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert_pair_accuracy_recorded(info)
    adapter = load_file(run_dir / "model" / "final" / "adapter_model.safetensors")
    assert "base_model.model.score.weight" in adapter and any("lora_B" in key for key in adapter)
    merged = AutoModelForSequenceClassification.from_pretrained(info["merged_model"])
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    with_adapter = PeftModel.from_pretrained(base, run_dir / "model" / "final").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert merged(input_ids=ids).logits.item() == pytest.approx(with_adapter(input_ids=ids).logits.item(),
                                                                    abs=1e-5)
    assert torch.equal(merged.score.weight, adapter["base_model.model.score.weight"])
    # The model card's own loading snippet works as written.
    from peft import AutoPeftModelForSequenceClassification

    card = (run_dir / "model" / "final" / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "num_labels=1" in card
    assert "from peft import AutoPeftModelForSequenceClassification as Model" in card
    as_carded = AutoPeftModelForSequenceClassification.from_pretrained(run_dir / "model" / "final", num_labels=1).eval()
    with torch.no_grad():
        assert as_carded(input_ids=ids).logits.item() == pytest.approx(merged(input_ids=ids).logits.item(), abs=1e-5)
    trl_args = torch.load(run_dir / "model" / "final" / "training_args.bin", weights_only=False)
    assert type(trl_args).__name__ == "RewardConfig" and trl_args.center_rewards_coefficient == 0.01


def test_reward_on_two_processes_trains_as_one_job(tiny_model, tiny_tokenizer, preference_file, tmp_path):
    from transformers import AutoModelForSequenceClassification, set_seed

    from src.judges import reward_scores

    args = reward_args(tiny_model, preference_file, tmp_path / "results", "rm2") + ["--max_steps", "4"]
    launch(2, args, tmp_path / "probe")
    assert_trained_as_one_job(tmp_path / "probe", "reward", 4)
    info, _ = assert_run_dir_complete(tmp_path / "results" / "rm2", 2, "reward", samples=False)
    assert (info["per_device_batch_size"], info["global_batch_size"]) == (4, 8)
    assert info["one_job"]["ranks"] == 2 and info["one_job"]["identical_weights"]
    assert info["one_job"]["disjoint_rows_per_step"]  # the one-job check reads reward batches too
    assert_pair_accuracy_recorded(info)
    # The starting model, scored by the two ranks on half the pairs each, gives what one process gives on all.
    set_seed(3)
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1,
                                                                 pad_token_id=tiny_tokenizer.pad_token_id)
    test = held_out_test_pairs(preference_file, tiny_tokenizer, tmp_path)
    chosen, rejected = (reward_scores(initial, test[column], tiny_tokenizer.pad_token_id, 8)
                        for column in ("chosen_ids", "rejected_ids"))
    before = info["judges"]["test"]
    assert before["before"] == sum(c > r for c, r in zip(chosen, rejected)) / len(test)
    assert before["details"]["mean_margin"]["before"] == pytest.approx(
        sum(c - r for c, r in zip(chosen, rejected)) / len(test), rel=1e-4)
