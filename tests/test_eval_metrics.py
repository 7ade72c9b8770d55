"""DPO eval metrics are per-pair means (src/dpo_eval.py): independent of the eval batch size, the number of
processes and the split's remainder (an uneven last batch, which accelerate pads with duplicated pairs)."""

from __future__ import annotations

import pytest

from test_packed_dpo import pairs, tiny, tokenizer, trainer_for  # noqa: F401 - tokenizer is a fixture

EVAL_KEYS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
             "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen",
             "eval_logits/rejected", "eval_entropy", "eval_mean_token_accuracy")


def evaluate(tokenizer, tmp_path, eval_batch_size: int, packed: bool = True, **overrides) -> dict:
    from datasets import Dataset

    model = tiny("llama", tokenizer, seed=1)
    trainer = trainer_for(model, tokenizer, pairs(8, seed=7), tmp_path, packed,
                          per_device_eval_batch_size=eval_batch_size, **overrides)
    trainer.train()  # 2 steps: the reference and the policy differ, so rewards are not all 0
    return trainer.evaluate(Dataset.from_list(pairs(7, seed=8)))


@pytest.mark.parametrize("overrides", [{}, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.4]},
                                       {"loss_type": ["ipo"], "use_weighting": True}])
def test_eval_metrics_do_not_depend_on_the_eval_batch_size(overrides, tokenizer, tmp_path):
    """7 pairs in batches of 7, 4 + 3 and 2 + 2 + 2 + 1: TRL's mean of batch means differed (the 1-pair batch weighed
    as much as a 2-pair one); per-pair means agree, for the default loss, the sft-combined loss and IPO with WPO."""
    runs = [evaluate(tokenizer, tmp_path / str(size), size, max_steps=2, **overrides) for size in (7, 4, 2)]
    for key in EVAL_KEYS:
        values = [run[key] for run in runs]
        assert values == pytest.approx([values[0]] * 3, rel=1e-5, abs=1e-6), (key, values)
    assert runs[0]["eval_rewards/margins"] != 0


def test_the_per_pair_loss_is_the_mean_of_one_pair_evaluations(tokenizer, tmp_path):
    """The definition, worked by hand: eval_loss over 7 pairs equals the mean of 7 evaluations of one pair each."""
    from datasets import Dataset

    model = tiny("llama", tokenizer, seed=1)
    trainer = trainer_for(model, tokenizer, pairs(8, seed=7), tmp_path, True, per_device_eval_batch_size=4,
                          max_steps=2)
    trainer.train()
    rows = pairs(7, seed=8)
    whole = trainer.evaluate(Dataset.from_list(rows))
    single = [trainer.evaluate(Dataset.from_list([row])) for row in rows]
    # abs: a margin is beta x a difference of summed log-probs near -75 nats, whose float32 ulp is ~8e-6: batched
    # and single evaluations (other padding, other kernels) may differ by a few 1e-7 where the margin is near zero
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert whole[key] == pytest.approx(sum(run[key] for run in single) / 7, rel=1e-5, abs=2e-6), key


def test_eval_metrics_agree_on_1_2_and_4_processes(tiny_model, tmp_path, monkeypatch):
    """End to end (src.main_distributed under torchrun, gloo): the same global batch of 8 on 1 process (micro-batch
    4, accumulating 2), 2 (4 each) and 4 (2 each) train alike; a validation split of 7 pairs falls into eval batches
    differently on each (the last one padded with duplicated pairs on 2 and 4), and every logged eval metric agrees."""
    from conftest import preference_rows, write_jsonl
    from src import run_files
    from test_training import launch

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40))
    monkeypatch.setenv("PREFKIT_CACHE", str(tmp_path / "cache"))
    evals = {}
    for processes in (1, 2, 4):
        name = f"procs{processes}"
        launch(processes, ["--stage", "dpo", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
                           "--results_dir", str(tmp_path / "results"), "--run_name", name, "--max_length", "64",
                           "--logging_steps", "1", "--batch_size", "8", "--micro_batch_size", "4", "--max_steps", "2",
                           "--eval_steps", "2", "--val_size", "7", "--test_size", "2", "--num_samples", "0",
                           "--judge", "none", "--seed", "3", "--learning_rate", "1e-3"], tmp_path / f"probe-{name}")
        records = run_files.read_jsonl(tmp_path / "results" / name / run_files.METRICS)
        evals[processes] = next(record for record in records if "eval_loss" in record)
    keys = [key for key in EVAL_KEYS if key in evals[1]]
    assert len(keys) == len(EVAL_KEYS), sorted(evals[1])
    for key in keys:
        values = [evals[processes][key] for processes in (1, 2, 4)]
        assert values == pytest.approx([values[0]] * 3, rel=1e-5, abs=1e-6), (key, values)
