"""SimPO (issue 37): `--stage simpo` through TRL's CPOTrainer on the toolkit's prepared pairs.

One optimizer step on the same global batch of 8 pairs, split as P processes x A accumulation steps (micro-batches of
8 / (P A) pairs), each micro-batch collated and run on its own as a rank would run it: DDP averages the P ranks'
gradients and accumulation adds the A micro-steps' (each loss divided by A). SimPO's loss is the mean over a
micro-batch's pairs, with no reference and no cross-pair term, so every split must give the global batch's step: the
test checks the loss, rewards and gradient agree to 1e-5, padding included (each micro-batch pads to its own longest).
"""

from __future__ import annotations

import pytest

from conftest import preference_rows, write_jsonl
from pair_steps import assert_the_same_on_every_split, trainer_on_prepared_pairs
from src import run_files


@pytest.fixture(scope="module")
def simpo_setup(tiny_model, tiny_tokenizer, tmp_path_factory):
    return trainer_on_prepared_pairs("simpo", tiny_model, tiny_tokenizer, tmp_path_factory.mktemp("simpo"), beta=2.5,
                                     simpo_gamma=1.25, loss_type="simpo", cpo_alpha=0.0)


KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "grad")


def test_simpo_step_is_the_same_on_any_split_of_the_global_batch(simpo_setup):
    trainer, rows, _ = simpo_setup
    assert_the_same_on_every_split(trainer, rows, KEYS)


def test_prepared_pairs_are_laid_out_as_cpo_tokenizes_them(simpo_setup, tiny_tokenizer):
    """The ids are DPO's (src/data/: TRL's DPOTrainer tokenization); CPO's layout: prompt + answer, prompt labels
    -100, the answer cut at max_length."""
    from src.trainers.legacy_pairs import LABEL_PAD, pair_row

    trainer, rows, prepared = simpo_setup
    source = prepared.train[0]
    row = rows[0]
    assert row["chosen_input_ids"] == source["prompt_ids"] + source["chosen_ids"]
    assert row["chosen_labels"] == [LABEL_PAD] * len(source["prompt_ids"]) + source["chosen_ids"]
    assert row["rejected_input_ids"][len(source["prompt_ids"]):] == source["rejected_ids"]
    cut = pair_row([1, 2, 3], [4, 5, 6, 7], [8], max_length=5)
    assert cut["chosen_input_ids"] == [1, 2, 3, 4, 5] and cut["rejected_input_ids"] == [1, 2, 3, 8]


def test_cpoconfig_fields_are_flags_and_recipe_keys(tmp_path):
    """Every field of TRL's CPOConfig is a key of --stage simpo (a flag or a recipe key): the toolkit's own fields, or
    passed through to TRL."""
    from trl.experimental.cpo import CPOConfig

    from src.config_parse import parse_config, toolkit_fields, trl_fields

    known = set(toolkit_fields()) | set(trl_fields("simpo"))
    assert set(CPOConfig.__dataclass_fields__) - {"_n_gpu"} <= known | {name for name, item in
                                                                       CPOConfig.__dataclass_fields__.items()
                                                                       if not item.init}
    config = parse_config(["--stage", "sft_then_simpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl",
                           "--simpo_gamma", "1.5", "--cpo_alpha", "0.05", "--alpha", "0.1",
                           "--max_completion_length", "32"])
    assert config.trl_overrides == {"simpo_gamma": 1.5, "cpo_alpha": 0.05, "alpha": 0.1, "max_completion_length": 32}
    recipe = tmp_path / "simpo.yaml"
    recipe.write_text("stage: simpo\nmodel_name_or_path: m\ndataset_name: d.jsonl\nsimpo_gamma: 2.0\n"
                      "generate_during_eval: false\n")
    config = parse_config(["--config", str(recipe)])
    assert config.trl_overrides == {"simpo_gamma": 2.0, "generate_during_eval": False}


def test_trl_config_is_simpo_without_a_reference(tmp_path):
    from src.config_parse import parse_config
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.trainers.trl_config import build_trl_config

    config = parse_config(["--stage", "simpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--beta",
                           "2.5"])
    plan = resolve_plan(config, World(), Devices("cpu", 0, []))
    args = build_trl_config("simpo", config, plan, tmp_path, False, 10)
    assert (args.loss_type, args.cpo_alpha, args.beta, args.simpo_gamma) == ("simpo", 0.0, 2.5, 1.25)
    assert not hasattr(args, "precompute_ref_log_probs")


@pytest.mark.parametrize("flags, warned", [
    (["--beta", "2.5", "--simpo_gamma", "1.25"], []),
    (["--beta", "0.1"], ["--beta 0.1 is outside SimPO's range 2-10"]),
    (["--beta", "2.0", "--simpo_gamma", "0.5"], ["--simpo_gamma 0.5 is 0.25 x beta, outside SimPO's range 0.3-0.8"]),
    ([], []),  # the defaults: beta 2, gamma beta / 2
])
def test_beta_and_gamma_outside_the_papers_ranges_are_warned_with_why(flags, warned):
    from src.config_parse import parse_config
    from src.objectives import objective

    config = parse_config(["--stage", "simpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", *flags])
    warnings = objective("simpo").advice.warnings(config)
    assert len(warnings) == len(warned)
    for warning, start in zip(warnings, warned):
        assert warning.startswith(start) and ":" in warning  # then why


@pytest.mark.parametrize("stage", ["dpo", "kto", "simpo", "orpo", "grpo", "sft_then_simpo"])
def test_a_beta_default_is_the_objectives_value_not_whether_the_flag_was_typed(stage, tmp_path):
    """--beta left out trains with the row's default_beta, exactly as --beta typed with that value does (SimPO's 2.0,
    not DPO's 0.1: before, SimPO's beta was 2.0 unless a --beta was typed, even --beta 0.1, the value --help showed
    as the default); a recipe's `beta:` is a value given like the flag's. Settings and what training_info records."""
    import dataclasses

    from src.config import DPOArguments
    from src.config_parse import parse_config, stage_config
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.objectives import final_stage, objective
    from src.trainers.trl_config import build_trl_config

    row = objective(stage)
    base = ["--stage", stage, "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--judge",
            "tests.round_judges:by_length"]
    built = []
    for flags in ([], ["--beta", f"{row.training.default_beta:g}"]):
        config = stage_config(parse_config(base + flags), final_stage(stage))
        plan = resolve_plan(config, World(), Devices("cpu", 0, []), final_stage(stage))
        args = build_trl_config(final_stage(stage), config, plan, tmp_path, False, 10)
        built.append((args.beta, getattr(args, "simpo_gamma", None), row.report.run_info(config, {})["beta"]))
    assert built[0] == built[1] and built[0][0] == row.training.default_beta
    beta_help = next(field for field in dataclasses.fields(DPOArguments) if field.name == "beta").metadata["help"]
    assert f"{row.display_name} {row.training.default_beta:g}" in beta_help  # --help says the default each one trains with
    assert objective("simpo").training.default_beta == 2.0 and objective("dpo").training.default_beta == 0.1
    recipe = tmp_path / "simpo.yaml"
    recipe.write_text("stage: simpo\nmodel_name_or_path: m\ndataset_name: d.jsonl\nbeta: 0.1\n")
    assert objective("simpo").report.run_info(parse_config(["--config", str(recipe)]), {})["beta"] == 0.1


def test_memory_plan_keeps_no_reference_and_says_what_that_saves():
    """check_gpu's plan for --stage simpo: no reference copy; its reference cell names the copy DPO would keep (full
    fine-tuning without cached reference log-probs: a copy of the weights at the plan's precision)."""
    from src.diagnostics.inputs import parse_launch_arguments, training_setup
    from src.diagnostics.memory_plan import GIB, plan_memory
    from src.diagnostics.model_shape import shape_from_param_count

    shape = shape_from_param_count(7_000_000_000)
    plans = {stage: plan_memory(shape, training_setup(parse_launch_arguments(["--stage", stage],
                                                                              size_given=True)),
                                num_devices=8, device_kind="gpu", budget_bytes=80 * GIB, budget_source="test",
                                deepspeed_installed=True)
             for stage in ("simpo", "dpo")}
    simpo, dpo = ({estimate.method: estimate for estimate in plans[stage].estimates} for stage in ("simpo", "dpo"))
    assert all(estimate.reference_bytes == 0 for estimate in simpo.values())
    weight_bytes = 4 if plans["simpo"].precision == "fp32" else 2
    assert simpo["full"].reference_saved_bytes == shape.total_params * weight_bytes
    assert simpo["lora"].reference_saved_bytes == 0  # DPO with adapters keeps none either
    assert all(estimate.reference_saved_bytes == 0 for estimate in dpo.values())


def test_simpo_on_two_processes_killed_and_resumed_matches_one_and_reports(tiny_model, tmp_path):
    """A real 2-process SimPO run whose rank 1 is killed right after checkpoint-2 (the seam in
    src/run_safety/checkpoints.py) and the job relaunched, against one uninterrupted process on the same global
    batch (1 x 2 accumulation vs 2 x 1): every logged train and eval metric agrees (1e-5). The one-process run end to
    end: no reference pass, the margin chart with gamma's line, the curves in report.md, the console line."""
    from test_resilience import one_process_against_two_killed_and_resumed
    from test_training import _same, common_args

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40, seed=2))
    metrics, _info, console = one_process_against_two_killed_and_resumed(
        lambda name: common_args(tiny_model, data, tmp_path / "results", name, "simpo") + [
            "--batch_size", "4", "--micro_batch_size", "2", "--max_steps", "4", "--learning_rate", "5e-3", "--beta",
            "2.5", "--simpo_gamma", "1.0", "--eval_steps", "2", "--save_steps", "2", "--val_size", "8",
            "--num_samples", "0"],
        tmp_path / "results", tmp_path / "log.txt")
    assert any("rewards/margins" in record for record in metrics[1]) and any("eval_loss" in r for r in metrics[1])
    assert _same(metrics[1], metrics[2])

    assert "reference log-probs" not in console and "rewards/margins" in console  # the console line
    run_dir = tmp_path / "results" / "1-process"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert (info["stage"], info["loss_type"], info["simpo_gamma"]) == ("simpo", "simpo", 1.0)
    forward = info["forward"]  # the packed forward trained it, checked against the padded one on its first batch
    assert forward["forward"].startswith("packed (prefix-shared") and forward["first_batch_check"]["passed"]
    assert any("eval_rewards/margins" in record for record in run_files.read_jsonl(run_dir / run_files.METRICS))
    report = (run_dir / "report.md").read_text()
    assert "margins.png" in report and "| SimPO | beta 2.5, gamma 1 (target margin)" in report
    assert "| SimPO forward | packed (prefix-shared" in report  # the row's display name, not "SIMPO" or "DPO"
    assert (run_dir / "plots" / "margins.png").stat().st_size > 10_000

