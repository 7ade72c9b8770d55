"""GRPO (issue 39): `--stage grpo` through TRL's GRPOTrainer on prepared prompts, the toolkit's judges as rewards.

The guarantee the rounds keep, kept here: every answer is sampled from its own stream seeded by (seed, step, prompt
row, answer number), so one process x 4 accumulation steps, 2 x 2 and 4 x 1 sample the same answers, get the same
rewards and advantages (each prompt's group is normalised over all its answers, wherever they were sampled) and the
same loss, KL and entropy (TRL's dapo loss is normalised over the global batch's answer tokens; the toolkit logs the KL
and entropy as means over the window's tokens); and a worker killed after a checkpoint resumes to the same numbers,
generation included: one launch per split, the 2 x 2 one killed and resumed, one test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

import forked
import grpo_probe
from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files, seams

JUDGE = "tests.round_judges:by_length"


def prompt_rows(count: int) -> list[dict]:
    """preference_rows' prompts alone, each with a meta the judges may read."""
    return [{"prompt": row["prompt"], "meta": {"thing": row["prompt"][0]["content"].split()[-2]}}
            for row in preference_rows(count)]


def grpo_args(model: Path, data: Path, results: Path, run_name: str, *extra: str) -> list[str]:
    return ["--stage", "grpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", run_name, "--batch_size", "16", "--num_generations", "4", "--max_steps", "2",
            "--max_new_tokens", "8", "--learning_rate", "1e-3", "--beta", "0.1", "--logging_steps", "1",
            "--save_steps", "100", "--num_samples", "2", "--val_size", "2", "--test_size", "2", "--max_length", "64",
            "--seed", "5", "--judge", JUDGE, "--audit_judge_pairs", "0", *extra]


# ------------------------------------------------------------------------------------------------ flags and the row


def test_grpoconfig_fields_are_flags_and_recipe_keys(tmp_path):
    """Every field of TRL's GRPOConfig is a key of --stage grpo (a flag or a recipe key): the toolkit's own fields, or
    passed through to TRL; --beta and --loss_type are GRPO's when given (TRL's defaults 0 and dapo when not)."""
    from trl import GRPOConfig

    from src.config_error import ConfigError
    from src.config_parse import parse_config, toolkit_fields, trl_fields
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.trainers.trl_config import build_trl_config

    known = set(toolkit_fields()) | set(trl_fields("grpo"))
    assert {name for name, item in GRPOConfig.__dataclass_fields__.items() if item.init} - {"_n_gpu"} <= known
    base = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--judge", JUDGE]
    config = parse_config(["--stage", "sft_then_grpo", *base, "--num_generations", "4", "--epsilon", "0.3",
                           "--epsilon_high", "0.28", "--scale_rewards", "batch", "--mask_truncated_completions", "true",
                           "--entropy_coef", "0.01", "--top_entropy_quantile", "0.2", "--temperature", "0.7",
                           "--beta", "0.04", "--loss_type", "dr_grpo", "--reward_weights", "2.0"])
    plan = resolve_plan(config, World(), Devices("cpu", 0, []))
    args = build_trl_config("grpo", config, plan, tmp_path, False, 10)
    assert (args.num_generations, args.epsilon, args.epsilon_high, args.scale_rewards, args.mask_truncated_completions,
            args.entropy_coef, args.top_entropy_quantile, args.temperature, args.beta, args.loss_type,
            args.reward_weights) == (4, 0.3, 0.28, "batch", True, 0.01, 0.2, 0.7, 0.04, "dr_grpo", [2.0])
    assert args.max_completion_length == config.training.max_new_tokens and not args.remove_unused_columns
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(f"stage: sft_then_dpo\nmodel_name_or_path: m\ndataset_name: d.jsonl\njudge: {JUDGE}\n"
                      "num_generations: 4\nmax_completion_length: 16\nloss_type: [sigmoid, sft]\nbeta: 0.3\n")
    config = parse_config(["--config", str(recipe), "--stage", "grpo"])
    args = build_trl_config("grpo", config, resolve_plan(config, World(), Devices("cpu", 0, [])), tmp_path, False, 10)
    # A DPO recipe's loss does not apply to GRPO; a flag asking for one is refused (test_mistakes_are_one_line), and
    # so is a GRPO recipe's (not TRL's error at the first step)
    assert (args.num_generations, args.max_completion_length, args.loss_type, args.beta) == (4, 16, "dapo", 0.3)
    recipe.write_text(recipe.read_text().replace("sft_then_dpo", "grpo"))
    with pytest.raises(ConfigError, match=r"dpo.yaml: loss_type sigmoid sft: GRPO takes one of grpo, dr_grpo"):
        parse_config(["--config", str(recipe)])
    # the settings whose step depends on the split are warned of as the stage opens (docs/grpo.md)
    from src.objectives import objective

    warned = objective("grpo").advice.warnings(parse_config(["--stage", "grpo", *base, "--loss_type", "bnpo",
                                                      "--entropy_coef", "0.01"]))
    assert [line.split(" ", 2)[:2] for line in warned] == [["--loss_type", "bnpo"], ["the", "entropy"]]
    assert not objective("grpo").advice.warnings(config)
    # check_gpu plans from a size alone, with no data: no judge is asked for
    assert parse_config(["--stage", "grpo", "--num_generations", "8"], require_sources=False,
                        default_recipe=False).training.stage == "grpo"



def test_sft_then_dpo_then_grpo_is_three_stages_of_the_table_each_with_its_own_block(tmp_path):
    """configs/sft_dpo_grpo.yaml: a pipeline from the table (GRPO's row names DPO in `pipeline_after`), its stages SFT,
    DPO and GRPO, each one's config its block's (`sft:`, `dpo:`, flags --sft.KEY / --dpo.KEY) over the top level's,
    the top level's loss settings GRPO's alone; each reads its own embedded data; every stage but the last hands its
    model on (merged under LoRA), each in its own directory."""
    from src.config_error import ConfigError
    from src.config_parse import parse_config
    from src.plan import stage_plans
    from src.world import Devices, World
    from src.data import source_location
    from src.pipeline.stages import plan_stages
    from src.objectives import PIPELINES, STAGES
    from src.trainers.trl_config import build_trl_config

    assert PIPELINES["sft_then_dpo_then_grpo"] == ("sft", "dpo", "grpo") and STAGES[-1] == "sft_then_dpo_then_grpo"
    config = parse_config(["--config", str(PROJECT_ROOT / "configs" / "sft_dpo_grpo.yaml"), "--dpo.max_steps", "7",
                           "--results_dir", str(tmp_path)])
    plans = stage_plans(config, World(), Devices("cpu", 0, []))
    built = {name: build_trl_config(name, staged, plan, tmp_path / name, False, 10) for name, staged, plan in plans}
    assert [(name, type(args).__name__) for name, args in built.items()] == [
        ("sft", "SFTConfig"), ("dpo", "DPOConfig"), ("grpo", "GRPOConfig")]
    staged = {name: stage for name, stage, _ in plans}
    assert (staged["sft"].training.max_steps, built["sft"].learning_rate) == (400, 2e-3)
    assert (staged["dpo"].training.max_steps, built["dpo"].learning_rate, built["dpo"].beta, built["dpo"].loss_type,
            built["dpo"].loss_weights) == (7, 8e-5, 0.3, ["sigmoid", "sft"], [1.0, 0.4])
    assert (staged["grpo"].training.max_steps, built["grpo"].beta, built["grpo"].loss_type,
            built["grpo"].num_generations) == (20, 0.04, "dapo", 8)
    assert staged["sft"].sources["max_steps"] == "configs/sft_dpo_grpo.yaml (sft block)"
    assert staged["dpo"].sources["max_steps"] == "--dpo.max_steps"
    assert [Path(source_location(stage.data, name)).name for name, stage in staged.items()] == ["sft", "dpo",
                                                                                              "prompts"]
    stages = plan_stages(config, World(), Devices("cpu", 0, []))
    assert [(stage.name, stage.run_dir.relative_to(tmp_path).as_posix(), stage.feeds_next) for stage in stages] == [
        ("sft", "sft_dpo_grpo/sft", True), ("dpo", "sft_dpo_grpo/dpo", True), ("grpo", "sft_dpo_grpo", False)]

    # GRPO's loss at the top level is not the DPO stage's: without a dpo block, DPO keeps its defaults
    flags = ["--stage", "sft_then_dpo_then_grpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--judge",
             JUDGE, "--beta", "0.04", "--loss_type", "dapo"]
    dpo = dict((name, stage) for name, stage, _ in stage_plans(parse_config(flags), World(), Devices("cpu", 0, [])))
    assert (dpo["dpo"].dpo.beta, dpo["dpo"].dpo.loss_type, dpo["grpo"].dpo.beta) == (0.1, ["sigmoid"], 0.04)
    with pytest.raises(ConfigError, match=r"--dpo\.\* overrides apply only to --stage sft_then_dpo_then_grpo"):
        parse_config(flags[:1] + ["sft_then_grpo"] + flags[2:] + ["--dpo.max_steps", "3"])

def test_check_gpu_plans_the_kv_cache_of_sampling_and_a_reference_only_with_the_kl_term():
    """check_gpu's memory plan for --stage grpo: a sequence is a prompt and its answer (max_length + max_new_tokens);
    the KV cache of the sampled answers (per-device batch x accumulation sequences, each layers x 2 x kv_size per
    token, plus one row of fp32 logits) is the peak when larger than the step's activations; a reference copy only
    with --beta > 0 (full fine-tuning); --beta 0 is a setting."""
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.diagnostics.inputs import parse_launch_arguments, training_setup, with_plan
    from src.diagnostics.memory_plan import GIB, LOGITS_FP32_BYTES, plan_memory
    from src.diagnostics.model_shape import shape_from_param_count

    shape = shape_from_param_count(1_500_000_000)

    def plan(*flags: str):
        config = parse_launch_arguments(["--stage", "grpo", "--batch_size", "16", "--gradient_accumulation_steps", "2",
                                         "--max_length", "256", "--max_new_tokens", "768", *flags], size_given=True)
        setup = with_plan(training_setup(config), resolve_plan(config, World(), Devices("cpu", 0, [])))
        return setup, plan_memory(shape, setup, num_devices=1, device_kind="gpu", budget_bytes=80 * GIB,
                                  budget_source="test", deepspeed_installed=True)

    setup, without_kl = plan("--beta", "0")
    weight_bytes = 4 if without_kl.precision == "fp32" else 2
    assert (setup.max_length, setup.generation_tokens, setup.per_device_batch_size, setup.generation_steps) == (
        1024, 1024, 8, 2)
    per_sequence = 2 * (1024 * shape.num_layers * 2 * shape.kv_size * weight_bytes
                        + shape.vocab_size * LOGITS_FP32_BYTES)
    assert without_kl.generation_bytes_per_sample == per_sequence
    full = {estimate.method: estimate for estimate in without_kl.estimates}["full"]
    assert full.reference_bytes == 0 and full.activation_bytes == 8 * max(per_sequence,
                                                                         without_kl.activation_bytes_per_sample)
    _, with_kl = plan("--beta", "0.04")
    estimates = {estimate.method: estimate for estimate in with_kl.estimates}
    assert estimates["full"].reference_bytes == shape.total_params * weight_bytes
    assert estimates["lora"].reference_bytes == 0  # the base with its adapters off


MISTAKES = [
    (["--num_generations", "3"], "--num_generations 3 does not divide the batch of 16 answers",
     "use --batch_size 15 or 18"),
    (["--judge", "auto"], "--stage grpo learns from rewards, and", "has no judge to give them"),
    (["--loss_type", "sigmoid"], "--loss_type sigmoid: GRPO takes one of", "dapo"),
    (["--rewards", JUDGE, JUDGE, "--reward_weights", "1.0"], "--reward_weights has 1 weight(s) for 2 judge(s)", ""),
    (["--use_vllm", "true"], "--use_vllm: the toolkit's GRPO generates through transformers", ""),
]


def test_mistakes_are_one_line_before_anything_runs(tiny_model, tmp_path):
    """A batch that num_generations does not divide (with the nearest sizes that do), a prompts file and no judge,
    a DPO loss, weights that do not match the judges, vLLM: one line each, exit 2, no traceback, nothing trained. And
    pairs given to GRPO: refused when the data is read."""
    from contextlib import redirect_stderr
    from io import StringIO

    from src.main_distributed import run
    from src.pipeline.exits import exit_status

    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    cases = MISTAKES + [(["--dataset_name", str(pairs)], "--stage grpo trains on prompts alone and samples its own "
                         "answers, and the data holds chosen and rejected answers", "--stage dpo")]
    for extra, start, then in cases:
        errors = StringIO()
        with redirect_stderr(errors):
            code = exit_status(run, grpo_args(tiny_model, data, tmp_path / "r", "m") + extra + ["--dry_run"])
        stderr = errors.getvalue()
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and start in lines[0] and then in lines[0], (extra, stderr[-2000:])
        assert "Traceback" not in stderr


@pytest.mark.parametrize("judge, expected", [
    ("raising", "judge tests.round_judges:raising, prompt 'what color is the sun 3': raised ValueError: cannot "
                "parse the answer"),
    ("not_a_number", "judge tests.round_judges:not_a_number, prompt 'what color is the sea 1': returned 'yes'"),
])
def test_a_judge_that_fails_stops_the_step_naming_the_judge_and_the_prompt(tiny_model, tmp_path, judge, expected):
    """The judge's error is raised on every process after the rewards' gather (so none waits in a collective), with
    the judge and the prompt; main_distributed prints it as one line (JudgeError is a user error)."""
    from src.judges import JudgeError

    # 32 answers per step: all 8 prompts are asked in step 1
    trainer = toolkit_trainer(tiny_model, tmp_path, "--judge", f"tests.round_judges:{judge}", "--batch_size", "32")
    with pytest.raises(JudgeError) as raised:
        trainer.train()
    assert str(raised.value).startswith("step 1: ") and expected in str(raised.value)



def test_a_judge_that_fails_on_one_process_stops_every_process_in_one_line(tiny_model, tmp_path):
    """2 processes as one job (forked, tests/forked.py), one GRPO step: the judge ends rank 1's process (sys.exit, not
    an exception) as it scores that rank's answers, while rank 0 goes on to the rewards' gather. Every process stops
    with the one line naming the judge and the prompt: exit 2 from each, no traceback (without the agreement, rank 0
    would wait in the gather until the job is stopped from outside)."""
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    args = grpo_args(tiny_model, data, tmp_path / "results", "judge", "--max_steps", "1", "--val_size", "0",
                     "--test_size", "0", "--judge", "tests.round_judges:gives_up_on_rank_1")
    job = forked.Running(args, env=os.environ | {"OMP_NUM_THREADS": "1"}, nproc=2)
    stdout, stderr = job.communicate(timeout=300)
    result = subprocess.CompletedProcess(args, job.returncode, stdout, stderr)
    assert all(code == 2 for code in job.codes()), job.codes()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert errors[0].startswith("error: step 1: judge tests.round_judges:gives_up_on_rank_1, prompt '")
    assert errors[0].endswith("': raised SystemExit: no checker on this host")
    assert "Traceback" not in result.stderr + result.stdout


def test_a_hub_math_set_maps_its_columns_into_meta_and_the_final_number_judge_reads_it(tiny_model, tmp_path):
    """configs/grpo_qwen2.5-0.5b_gsm8k.yaml's data and judge on a local file shaped like openai/gsm8k (question, answer:
    a worked solution ending "#### N"): --prompt_column question and --meta_columns answer prepare prompts whose meta
    holds the solution (with --chat_prompts each question a user message); src.answer_checks:final_number scores an answer 1 when its last number (or \\boxed{}) is N. A
    column the data lacks is one line naming the flag."""
    from transformers import AutoTokenizer

    from src.config import DataArguments, SFTArguments
    from src.config_parse import parse_config
    from src.data import DataError, prepare_data, source_columns
    from src.judges import judge_for

    rows = [{"question": f"Ann has {n} apples and buys 2 more. How many now?",
             "answer": f"She has {n} + 2 = <<{n}+2={n + 2}>>{n + 2} apples.\n#### {n + 2:,}"} for n in range(1000, 1012)]
    data = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    recipe = parse_config(["--config", str(PROJECT_ROOT / "configs" / "grpo_qwen2.5-0.5b_gsm8k.yaml")])
    assert (recipe.data.prompt_column, recipe.data.meta_columns, recipe.training.judge) == (
        "question", ["answer"], "src.answer_checks:final_number")
    arguments = DataArguments(dataset_name=str(data), prompt_column="question", meta_columns=["answer"], val_size=2,
                              test_size=2, max_length=64)
    assert source_columns(arguments, "grpo") == ["prompt", "meta"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prepared = prepare_data(arguments, SFTArguments(), "grpo", 5, tokenizer, tmp_path / "cache")
    train = prepared.train
    assert {"prompt", "meta", "prompt_ids"} <= set(train.column_names) and "answer" not in train.column_names
    row = train[0]
    number = int(row["prompt"].split()[2])
    assert row["meta"] == {"answer": rows[number - 1000]["answer"]}

    # --chat_prompts (the recipe's): each question a chat of one user message, rendered by the model's chat template
    assert recipe.data.chat_prompts
    chats = prepare_data(DataArguments(dataset_name=str(data), prompt_column="question", meta_columns=["answer"],
                                       chat_prompts=True, val_size=2, test_size=2, max_length=64),
                         SFTArguments(), "grpo", 5, tokenizer, tmp_path / "cache").train[0]
    assert chats["prompt"] == [{"role": "user", "content": row["prompt"]}] and chats["meta"] == row["meta"]
    assert list(chats["prompt_ids"]) == tokenizer.apply_chat_template(chats["prompt"], add_generation_prompt=True,
                                                                      tokenize=True, return_dict=True)["input_ids"]

    judge = judge_for(recipe.training.judge, None)
    answers = [f"So {number} + 2 = {number + 2:,}.", f"The answer is \\boxed{{{number + 2}}}, not 7.",
               f"It is {number + 3}.", "I do not know."]
    assert judge.scores([row] * 4, answers) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(DataError, match=r"^--meta_columns solution: no such column in .*gsm8k.jsonl; the data has "
                                         r"question, answer$"):
        prepare_data(DataArguments(dataset_name=str(data), prompt_column="question", meta_columns=["solution"],
                                   val_size=2, test_size=2), SFTArguments(), "grpo", 5, tokenizer, tmp_path / "cache")

def toolkit_trainer(tiny_model, tmp_path, *extra: str):
    """The trainer main_distributed builds for --stage grpo on 8 prompts (one process), ready to train."""
    from transformers import AutoTokenizer

    from src.config_parse import parse_config
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.data import prepare_data
    from src.models import load_model
    from src.objectives import objective
    from src.trainers.build import build_trainer
    from src.trainers.trl_config import build_trl_config

    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(8))
    config = parse_config(grpo_args(tiny_model, data, tmp_path / "results", "t", "--batch_size", "8", "--val_size",
                                    "0", "--test_size", "0", *extra))
    plan = resolve_plan(config, World(), Devices("cpu", 0, []))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prepared = prepare_data(config.data, config.sft, "grpo", 5, tokenizer, tmp_path / "cache")
    trl_config = build_trl_config("grpo", config, plan, tmp_path / "out", False, 2)
    model = load_model(str(tiny_model), config.model, plan, World())
    return build_trainer("grpo", model, tokenizer, trl_config, prepared, None, tmp_path / "metrics.jsonl", plan,
                         trainer_inputs=objective("grpo").training.trainer_inputs(config))


def test_judges_are_reward_functions_logged_apart(tiny_model, tmp_path):
    """Two judges with weights: each one's curves under rewards/<judge>/, the reward their weighted sum; the answers
    are the same as one judge's (the sampling does not depend on the judges), and the plots draw a curve per judge."""
    from matplotlib.image import imread

    from src.objectives import objective
    from src.reporting.plots import panel_curves, plot_chart

    trainer = toolkit_trainer(tiny_model, tmp_path, "--rewards", JUDGE, "tests.round_judges:always_one",
                              "--reward_weights", "1.0", "0.5", "--max_steps", "1")
    trainer.train()
    record = next(line for line in run_files.read_jsonl(tmp_path / "metrics.jsonl") if "reward" in line)
    by_length = record["rewards/tests.round_judges.by_length/mean"]
    assert record["rewards/tests.round_judges.always_one/mean"] == 1.0
    assert record["rewards/tests.round_judges.always_one/std"] == 0.0
    assert record["reward"] == pytest.approx(by_length + 0.5, abs=1e-5)
    for key in ("kl", "entropy", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                "clip_ratio/region_mean"):
        assert math.isfinite(record[key]), key
    # where the step's time went: its sampling and judging inside TRL's whole step
    assert 0 < record["time/generation_s"] + record["time/judging_s"] < record["step_time"]
    panel = next(panel for panel in objective("grpo").report.charts[1].panels if panel.per_logged_key == ("rewards/*/mean",
                                                                                                     "mean"))
    assert [curve.label for curve in panel_curves([record], panel)] == ["tests.round_judges.by_length mean",
                                                                         "tests.round_judges.always_one mean"]
    # A panel that would repeat another's one curve is left out: per judge with one judge, held-out with none judged
    one_judge = {key: value for key, value in record.items() if "always_one" not in key}
    for records, panels in (([record], 3), ([one_judge], 1), ([one_judge, {"step": 1, "judged_reward": 0.5}], 2)):
        assert plot_chart(records, objective("grpo").report.charts[1], tmp_path / "rewards.png")
        assert abs(imread(tmp_path / "rewards.png").shape[0] - (0.75 + 3.75 * panels) * 110) <= 1, panels


def grpo_history(steps: int = 40, entropy_end: float = 0.5, tied_end: float = 0.3, length_end: float = 20.0,
                 cut_end: float = 0.0) -> list[dict]:
    """A GRPO run's records as TRL logs them, each curve moving linearly from a healthy start to its given end."""
    def at(step: int, start: float, end: float) -> float:
        return start + (end - start) * (step - 1) / (steps - 1)

    return [{"step": step, "loss": 0.1, "reward": 0.5, "entropy": at(step, 0.5, entropy_end),
             "frac_reward_zero_std": at(step, 0.3, tied_end), "completions/mean_length": at(step, 20.0, length_end),
             "completions/clipped_ratio": at(step, 0.0, cut_end)} for step in range(1, steps + 1)]


@pytest.mark.parametrize("history, alerted", [
    (grpo_history(), set()),
    (grpo_history(entropy_end=0.01), {"grpo_entropy_collapse"}),
    (grpo_history(entropy_end=0.2), set()),  # 40%: lower, not collapsed
    (grpo_history(tied_end=0.95), {"grpo_groups_tied"}),
    (grpo_history(length_end=60.0, cut_end=0.5), {"grpo_length_runaway"}),
    (grpo_history(length_end=60.0), set()),  # longer within the limit: a habit forming, not a runaway
])
def test_health_alerts_for_entropy_collapse_tied_groups_and_runaway_length(history, alerted):
    from src.reporting.alerts import detect_alerts

    assert {alert.code for alert in detect_alerts(history, "grpo")} == alerted


@pytest.mark.parametrize("reward_end, before, after, alerted", [
    (0.9, 0.50, 0.40, True),   # reward up, judged held-out score down 10 points: hacking
    (0.9, 0.50, 0.49, False),  # down 1 point: within the judge's noise
    (0.3, 0.50, 0.40, False),  # the reward fell too: not a reward the policy learned to get
    (0.9, 0.40, 0.50, False),
])
def test_reward_rising_while_the_judged_held_out_score_falls_is_reward_hacking(reward_end, before, after, alerted):
    from src.reporting.alerts import detect_alerts

    history = [record | {"reward": 0.5 + (reward_end - 0.5) * index / 39} for index, record in
               enumerate(grpo_history())]
    info = {"judge": {"metric": "correct_and_preferred", "split": "test", "n": 200, "before": before, "after": after}}
    codes = {alert.code for alert in detect_alerts(history, "grpo", info)}
    assert ("grpo_reward_hacking" in codes) == alerted
    assert "grpo_reward_hacking" not in {alert.code for alert in detect_alerts(history, "grpo")}  # no info: not run


@pytest.mark.parametrize("curve, sem, alerted", [
    ([0.50, 0.50, 0.45, 0.40, 0.38], 0.01, True),   # judged during training: down 0.12, past its noise (0.028)
    ([0.50, 0.52, 0.49, 0.47, 0.46], 0.02, False),  # down 0.04: within its noise (1.96 x the windows' errors: 0.055)
    ([0.50, 0.40, 0.38, 0.45, 0.38], 0.08, False),  # down 0.12 on a curve this noisy (0.22): noise
    ([0.40, 0.45, 0.50, 0.52, 0.55], 0.01, False),  # rising: the before/after fall (0.50 -> 0.40) does not count
])
def test_reward_hacking_reads_the_held_out_curve_judged_during_training(curve, sem, alerted):
    """With the held-out prompts judged at each evaluation (eval_judged_reward and its standard error), the alert
    compares the curve's start with its end, past its noise, rather than the judged result before and after."""
    from src.reporting.alerts import detect_alerts

    history = [record | {"reward": 0.5 + 0.4 * index / 39} for index, record in enumerate(grpo_history())]
    for index, value in enumerate(curve):
        history.append({"step": index * 10, "eval_judged_reward": value, "eval_judged_reward_sem": sem})
    history.sort(key=lambda record: record["step"])
    info = {"judge": {"metric": "mean_reward", "split": "test", "n": 200, "before": 0.50, "after": 0.40}}
    alerts = {alert.code: alert for alert in detect_alerts(history, "grpo", info)}
    assert ("grpo_reward_hacking" in alerts) == alerted
    if alerted:
        assert "held-out prompts judged during training" in alerts["grpo_reward_hacking"].evidence


def test_the_report_draws_a_curve_per_judge_and_audits_prompts(tmp_path):
    """report.md of a GRPO run: the charts of its row (a reward curve per judge, read from the logged keys), the data
    table of prompts (no pair rows), its loss settings and final numbers."""
    from report_fixtures import training_info, write_run_dir
    from src.reporting.report import build_report

    history = [record | {"rewards/embedded/mean": 0.5, "rewards/embedded/std": 0.4, "rewards/fmt.ok/mean": 1.0,
                         "rewards/fmt.ok/std": 0.0, "reward_std": 0.4, "kl": 0.001 * record["step"]}
               for record in grpo_history()]
    prompts = {"pairs": 24, "distinct_prompts": 24, "duplicate_pairs": 0, "duplicate_share": 0.0, "empty_answers": 0,
               "prompts_dropped": 0, "prompt_tokens": {"mean": 9.0, "median": 9, "p95": 10}}
    info = training_info("grpo", beta=0.04, loss_type="dapo", num_generations=8, rewards=["embedded", "fmt:ok"],
                         reward_weights=[1.0, 0.2], data_audit={"train": prompts, "test": prompts})
    report = build_report(write_run_dir(tmp_path / "run", history, info)).read_text(encoding="utf-8")
    assert "| prompts | 24 | 24 |" in report and "chosen tokens" not in report
    assert "embedded x 1, fmt:ok x 0.2" in report and "final share of tied groups" in report
    for chart in ("rewards.png", "groups.png", "policy.png", "answers.png"):
        assert (tmp_path / "run" / "plots" / chart).stat().st_size > 10_000, chart

    # the held-out prompts judged during training: drawn in rewards.png beside the train reward, from the evaluations
    import matplotlib.pyplot as plt

    from src.objectives import objective
    from src.reporting.plots import _draw_curve

    history += [{"step": step, "eval_judged_reward": 0.4 + step / 100} for step in (0, 20, 40)]
    panel = next(panel for chart in objective("grpo").report.charts if chart.filename == "rewards.png"
                 for panel in chart.panels if "judged_reward" in {curve.key for curve in panel.curves})
    figure, axes = plt.subplots()
    assert all(_draw_curve(axes, history, curve, False)[0] for curve in panel.curves)
    assert {line.get_label() for line in axes.get_lines()} >= {"train reward (train)",
                                                                "held-out prompts, greedy, --judge (eval)"}
    plt.close(figure)



def test_the_verdict_leads_with_the_judges_held_out_reward_not_a_dpo_measure(tmp_path):
    """configs/grpo.yaml's run as measured: the SFT model answers in the chatty style, so the embedded checker's metric
    (correct-and-preferred) is 0% before and after, while correctness, and so the reward GRPO is trained on (1 per
    right answer, 3 if also direct), rose 16% -> 17.5%. GRPO's row leads with the judge's held-out mean reward
    (`judged_headline`): report.md's verdict, training_info.json's `judge` (the index, the console, the alert) and the
    pipeline's earlier stage in the same measure; DPO keeps the judge's own metric."""
    from report_fixtures import training_info, write_run_dir
    from src.embedded.tasks import check
    from src.judges import ProgrammaticJudge
    from src.reporting.index import judged_cell
    from src.reporting.report import build_report, headline_judge, report_verdict

    # the embedded checker records its reward's held-out mean beside its metric: 4 prompts, 1 -> 2 right, all chatty
    rows = [{"prompt": f"what is {n} + 1?", "meta": {"answer": str(n + 1)}} for n in range(4)]
    result = ProgrammaticJudge(check, metric="correct_and_preferred").judge(
        rows, ["1 ok", "7 ok", "9 ok", "0 ok"], ["1 ok", "2 ok", "9 ok", "0 ok"]).to_dict()
    assert (result["before"], result["after"], result["details"]["mean_reward"]) == (0.0, 0.0, {"before": 0.25,
                                                                                                 "after": 0.5})

    def judged(before: float, after: float) -> dict:
        return {"metric": "correct_and_preferred", "n": 200, "before": 0.0, "after": 0.0, "judge": "programmatic",
                "details": {"correct": {"before": before, "after": after}, "preferred": {"before": 0.0, "after": 0.0},
                            "mean_reward": {"before": before, "after": after}}}

    grpo = {"test": judged(0.16, 0.175), "val": judged(0.2, 0.2)}
    assert headline_judge(grpo, "grpo") == {"metric": "mean_reward", "split": "test", "n": 200, "before": 0.16,
                                            "after": 0.175}
    assert headline_judge(grpo, "sft_then_dpo")["metric"] == "correct_and_preferred"
    history = [{"step": step, "loss": 0.1, "reward": 0.5} for step in range(1, 11)]
    info = training_info("grpo", judges=grpo, judge=headline_judge(grpo, "grpo"))
    run = write_run_dir(tmp_path / "grpo", history, info)
    build_report(run)
    assert report_verdict(run).startswith("GRPO moved the judge's mean reward from 0.16 to 0.175 on 200 held-out test")
    assert judged_cell(info) == "mean reward: 0.16 → 0.175 (n=200)"

    # sft_then_grpo: the SFT stage's judged results read in GRPO's measure
    sft = write_run_dir(tmp_path / "pipeline" / "sft", history, training_info(
        "sft", judges={"test": judged(0.0, 0.16)}, judge=headline_judge({"test": judged(0.0, 0.16)}, "sft")))
    info = training_info("grpo", judges=grpo, judge=headline_judge(grpo, "grpo"), previous_stage={
        "stage": "sft", "run_dir": "sft", "judge": headline_judge({"test": judged(0.0, 0.16)}, "grpo")})
    run = write_run_dir(tmp_path / "pipeline", history, info)
    assert sft.parent == run
    build_report(run)
    assert report_verdict(run).startswith("On 200 held-out test prompts, the judge's mean reward went from 0 "
                                          "(untrained) to 0.16 after SFT and 0.175 after GRPO.")
    assert judged_cell(info) == "mean reward: 0 → 0.16 → 0.175 (n=200)"

# ------------------------------------------------------------------------------- the same numbers on any split


def test_the_same_numbers_on_1x4_2x2_4x1_and_after_a_killed_worker_or_job(tiny_model, tmp_path):
    """16 answers per step (4 prompts x 4), 3 steps, the KL term on: 1 process x 4 accumulation steps, 2 x 2 and 4 x 1
    sample the same answers to the same prompts, gather the same rewards, give each answer the same advantage, and
    log the same loss, KL and entropy (1e-5), and judge 2 held-out prompts to the same curve (the start and every
    step; 4 x 1: two ranks with none to answer). One command for every split (--batch_size 16 in micro-batches of 4:
    the accumulation follows the processes). Two jobs are killed whole right after checkpoint-2 and the same command
    launched again: the 1 x 4 job (its one process SIGKILLed) on 1 process again, and the 2 x 2 job (both its
    processes SIGKILLed at once: the seam's rank "*") on 4 processes (issue 58: a job that gained processes goes on
    as 4 x 1). Each resumed step 3 samples the same answers as the uninterrupted 4 x 1 run, and the curves go on as if
    nothing happened. All forked (tests/forked.py); a launcher's restart of a killed worker, which resumes the same
    way, is test_resilience's test_lost_worker_restarts_..."""
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(24))
    runs = {}
    for processes, accumulation, resumed_on in ((1, 4, 1), (2, 2, 4), (4, 1, None)):
        name = f"{processes}x{accumulation}"
        probe = tmp_path / "probe" / name
        arguments = [str(probe), *grpo_args(tiny_model, data, tmp_path / "results", name, "--micro_batch_size", "4",
                                            "--max_steps", "3", "--save_steps", "1", "--eval_steps", "1",
                                            "--judged_eval_prompts", "2")]
        killed = tmp_path / f"killed-{name}"
        seam = seams.env({}, kill_at_checkpoint=f"after_complete:2:*:{killed}") if resumed_on else {}
        environment = os.environ | {"OMP_NUM_THREADS": "1"}
        result = forked.run_job(processes, arguments, env=environment | seam, entry=grpo_probe.entry)
        if resumed_on:  # the whole job killed (every process SIGKILLed): the same command again
            flags = [Path(f"{killed}.rank{rank}") for rank in range(processes)]
            assert all(flag.exists() for flag in flags) and result.returncode == -9, \
                f"{name}: the seam never fired on every rank: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            result = forked.run_job(resumed_on, arguments, env=environment, entry=grpo_probe.entry)
            assert "took over the hold of a job that is gone" in result.stdout, result.stdout[-3000:]
        assert result.returncode == 0, f"{name}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        last = resumed_on or processes
        ranks = [json.loads((probe / f"rank{rank}.json").read_text()) for rank in range(last)]
        assert {(rank["world_size"], rank["accumulation"]) for rank in ranks} == {(last, 4 // last)}
        answers = sorted((answer["step"], answer["prompt"], answer["answer"], answer["advantage"])
                         for rank in ranks for answer in rank["answers"])
        records = run_files.read_jsonl(tmp_path / "results" / name / run_files.METRICS)
        metrics = [record for record in records if "loss" in record]
        judged = [(record["step"], record["eval_judged_reward"]) for record in records
                  if "eval_judged_reward" in record]
        runs[name] = {"answers": answers, "rewards": ranks[0]["rewards"], "metrics": metrics, "judged": judged}
    for name, resumed_on in (("1x4", 1), ("2x2", 4)):
        info = run_files.read_json(tmp_path / "results" / name / run_files.TRAINING_INFO)
        assert [resume["from_step"] for resume in info["resumes"]] == [2], name
        assert (info["world_size"], info["resumes"][0]["saved_by"]["world_size"]) == (resumed_on, int(name[0]))
    reference = runs["4x1"]
    assert len(reference["answers"]) == 3 * 16 and len({answer[1] for answer in reference["answers"]}) == 12
    assert any(answer[3] != 0 for answer in reference["answers"]), "no advantage: the test would prove nothing"
    for name, run in runs.items():
        # a resumed run's workers sampled step 3 alone (steps 1-2 were before the kill)
        resumed = name != "4x1"
        expected = [answer for answer in reference["answers"] if answer[0] == 2] if resumed else reference["answers"]
        assert [answer[:3] for answer in run["answers"]] == [answer[:3] for answer in expected], name
        assert [answer[3] for answer in run["answers"]] == pytest.approx([answer[3] for answer in expected],
                                                                         abs=1e-5), name
        assert run["rewards"] == {step: rewards for step, rewards in reference["rewards"].items()
                                  if not resumed or step == "2"}, name
        assert [record["step"] for record in run["metrics"]] == [1, 2, 3], name
        for key in ("loss", "kl", "entropy", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"):
            assert [record[key] for record in run["metrics"]] == pytest.approx(
                [record[key] for record in reference["metrics"]], abs=1e-5), (name, key)
        # the held-out prompts judged at the start and each step: the same curve, a resumed launch adding no point
        assert [step for step, _ in run["judged"]] == [0, 1, 2, 3], name
        assert [value for _, value in run["judged"]] == pytest.approx(
            [value for _, value in reference["judged"]], abs=1e-5), name
    assert reference["metrics"][-1]["kl"] > 0  # the policy moved from the reference
