"""ORPO (issue 37): `--stage orpo` through TRL's ORPOTrainer on the toolkit's prepared pairs.

One optimizer step on the same global batch of 8 pairs of varied lengths, split as 1x1 (8 pairs per micro-batch), 1x4,
2x2 and 4x1 (2) processes x accumulation steps, each micro-batch run on its own as a rank runs it
(tests/pair_steps.py): ORPO's loss is the chosen answers' NLL, a token mean over the global batch, plus beta x the
odds-ratio term, a mean over its pairs, so every split gives the global batch's step (loss, NLL, odds ratio, rewards and
gradient to 1e-5, each micro-batch padded to its own longest); and real jobs of 1 x 8, 2 x 4 and 2 processes x 2
accumulation steps x 2 give the same losses and grad norms."""

from __future__ import annotations

import pytest

import os

import forked
from conftest import preference_rows, write_jsonl
from pair_steps import assert_the_same_on_every_split, trainer_on_prepared_pairs
from src import run_files


@pytest.fixture(scope="module")
def orpo_setup(tiny_model, tiny_tokenizer, tmp_path_factory):
    trainer, rows, _prepared = trainer_on_prepared_pairs("orpo", tiny_model, tiny_tokenizer,
                                                         tmp_path_factory.mktemp("orpo"), beta=0.1)
    return trainer, rows


KEYS = ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/margins",
        "rewards/accuracies", "grad")


def test_orpo_step_is_the_same_on_any_split_of_the_global_batch(orpo_setup):
    trainer, rows = orpo_setup
    assert_the_same_on_every_split(trainer, rows, KEYS)


def test_orpo_jobs_give_the_same_numbers_whatever_the_micro_batch(tiny_model, tmp_path):
    """Issue 57: TRL's NLL term was a token mean over the micro-batch, so 1 process x 8 pairs and 2 x 4 differed at the
    first step (1.7e-5 relative on the loss, 6.7e-4 on the grad norm, measured on these pairs; 2 x 2 x 2 accumulation
    4.9e-5 and 1e-2). Now the token counts of the step's global batch are summed over the ranks as each step begins
    (src/trainers/legacy_pairs.py `begin_step`): the same losses, NLL and grad norms on every split, the first step to
    fp32 summation order."""
    from test_training import common_args

    rows = preference_rows(24)
    for index, row in enumerate(rows):  # answers and prompts of other lengths: micro-batches of other token counts
        for side in ("chosen", "rejected"):
            row[side][0]["content"] += " very" * (1 + index % 3)
        row["prompt"][0]["content"] += " please" * (index % 4)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    logged = {}
    for name, processes, micro in (("1x8", 1, "8"), ("2x4", 2, "4"), ("2x2x2", 2, "2")):
        args = common_args(tiny_model, data, tmp_path / "results", name, "orpo") + [
            "--batch_size", "8", "--micro_batch_size", micro, "--max_steps", "2", "--learning_rate", "1e-3",
            "--num_samples", "0", "--eval_strategy", "no"]
        result = forked.run_job(processes, args, env=os.environ | {"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        logged[name] = [record for record in run_files.read_jsonl(tmp_path / "results" / name / run_files.METRICS)
                        if "loss" in record]
    one = logged["1x8"]
    assert len(one) == 2
    for name in ("2x4", "2x2x2"):
        for key in ("loss", "grad_norm", "nll_loss", "log_odds_ratio"):
            assert logged[name][0][key] == pytest.approx(one[0][key], rel=1e-6), (name, key)
            assert [record[key] for record in logged[name]] == pytest.approx([record[key] for record in one],
                                                                             rel=1e-5), (name, key)


def test_orpoconfig_fields_are_flags_and_recipe_keys(tmp_path):
    from trl.experimental.orpo import ORPOConfig

    from src.config_parse import parse_config, toolkit_fields, trl_fields

    known = set(toolkit_fields()) | set(trl_fields("orpo"))
    assert {name for name, item in ORPOConfig.__dataclass_fields__.items() if item.init} <= known
    config = parse_config(["--stage", "orpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl",
                           "--padding_value", "0", "--max_completion_length", "32", "--generate_during_eval", "false"])
    assert config.trl_overrides == {"padding_value": 0, "max_completion_length": 32, "generate_during_eval": False}
    recipe = tmp_path / "orpo.yaml"
    recipe.write_text("stage: orpo\nmodel_name_or_path: m\ndataset_name: d.jsonl\nbeta: 0.2\npadding_value: 0\n")
    config = parse_config(["--config", str(recipe)])
    assert config.dpo.beta == 0.2 and config.trl_overrides == {"padding_value": 0}


def test_trl_config_is_orpo_without_a_reference(tmp_path):
    from src.config_parse import parse_config
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.trainers.trl_config import build_trl_config

    for flags, beta in (([], 0.1), (["--beta", "0.25"], 0.25)):
        config = parse_config(["--stage", "orpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", *flags])
        args = build_trl_config("orpo", config, resolve_plan(config, World(), Devices("cpu", 0, [])), tmp_path, False,
                                10)
        assert args.beta == beta and not hasattr(args, "precompute_ref_log_probs")


def test_orpo_on_two_processes_killed_and_resumed_matches_one_and_reports(tiny_model, tmp_path):
    """A real 2-process ORPO run whose rank 1 is killed right after checkpoint-2 and the job relaunched, against
    one uninterrupted process on the same global batch (1 x 2 accumulation vs 2 x 1): every logged train and eval
    metric agrees (1e-5). The one-process run end to end: no reference pass; NLL and odds-ratio curves in the report
    and on the console."""
    from test_resilience import one_process_against_two_killed_and_resumed
    from test_training import _same, common_args

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40, seed=2))
    metrics, _info, console = one_process_against_two_killed_and_resumed(
        lambda name: common_args(tiny_model, data, tmp_path / "results", name, "orpo") + [
            "--batch_size", "4", "--micro_batch_size", "2", "--max_steps", "4", "--learning_rate", "5e-3", "--beta",
            "0.2", "--eval_steps", "2", "--save_steps", "2", "--val_size", "8", "--num_samples", "0"],
        tmp_path / "results", tmp_path / "log.txt")
    assert any("log_odds_chosen" in record for record in metrics[1]) and any("eval_nll_loss" in r for r in metrics[1])
    assert _same(metrics[1], metrics[2])

    assert "reference log-probs" not in console and "nll_loss" in console
    run_dir = tmp_path / "results" / "1-process"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert (info["stage"], info["loss_type"], info["beta"]) == ("orpo", "orpo", 0.2)
    forward = info["forward"]  # the packed forward trained it, checked against the padded one on its first batch
    assert forward["forward"].startswith("packed (prefix-shared") and forward["first_batch_check"]["passed"]
    report = (run_dir / "report.md").read_text()
    assert "nll.png" in report and "odds_ratio.png" in report and "| ORPO | beta (lambda) 0.2" in report
    for name in ("nll.png", "odds_ratio.png"):
        assert (run_dir / "plots" / name).stat().st_size > 10_000
