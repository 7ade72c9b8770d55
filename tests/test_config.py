"""Config: recipes parse, batch and learning-rate resolution across world sizes, clear errors."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from src.config import PROJECT_ROOT
from src.config_error import ConfigError
from src.config_parse import parse_config, stage_config
from src.objectives import PIPELINES
from src.plan import (BatchSplitError, batch_split_command, format_plan, resolve_batch, resolve_plan, resolve_precision,
                      with_batch_size)
from src.world import Devices, World

USER = ["--model_name_or_path", "some/model", "--dataset_name", "some/data"]


H100S = Devices("cuda", names=("NVIDIA H100",) * 8, compute_capabilities=((9, 0),) * 8)


def plan_for(argv, world_size, devices=Devices("cpu")):
    return resolve_plan(parse_config(USER + argv), World(world_size=world_size, local_world_size=world_size), devices)


@pytest.mark.parametrize("recipe", sorted((PROJECT_ROOT / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_recipe_parses_and_resolves(recipe: Path):
    config = parse_config(["--config", str(recipe)])
    for stage in PIPELINES.get(config.training.stage, (config.training.stage,)):  # every stage of a pipeline
        staged = stage_config(config, stage)
        for world_size in (1, 2, 4, 8):
            plan = resolve_plan(staged, World(world_size=world_size, local_world_size=world_size), H100S, stage)
            if staged.training.batch_size:  # a global batch is the same optimizer batch on any GPU count
                assert plan.global_batch_size == staged.training.batch_size
        resolve_plan(staged, World(), Devices("cpu"), stage)


def test_flexattention_is_refused_where_it_cannot_train_whichever_flag_asks_and_kept_on_a_gpu():
    """FlexAttention has no backward on CPU (torch's NotImplementedError at the first step, after the data and the
    model): the model's own attention (--attn_implementation flex_attention, every stage trains through it) and the
    packed forward's (--packed_attention flex, on a stage with one: SFT has none) are one rule, refused as the stage is
    planned on CPU and kept on CUDA."""
    flex_model = ["--attn_implementation", "flex_attention"]
    for stage in ("dpo", "sft", "kto", "reward", "grpo"):
        with pytest.raises(ConfigError, match=r"^--attn_implementation flex_attention needs a CUDA GPU: FlexAttention "
                                              r"has no backward on CPU; use sdpa \(transformers' default\) or eager$"):
            plan_for(["--stage", stage, "--judge", "embedded"] + flex_model, 1)
    with pytest.raises(ConfigError, match=r"^--packed_attention flex needs a CUDA GPU: .* use auto \(the dense"):
        plan_for(["--stage", "simpo", "--packed_attention", "flex"], 1)
    assert plan_for(["--stage", "sft", "--packed_attention", "flex"], 1).packed_attention == "flex"  # not SFT's
    assert plan_for(flex_model + ["--packed_attention", "flex"], 8, H100S).packed_attention == "flex"


def test_no_arguments_means_the_embedded_default():
    config = parse_config([])
    assert config.recipe.endswith("configs/default.yaml")
    assert config.model.model_name_or_path == "embedded" and config.training.stage == "sft_then_dpo"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batch_is_world_size_invariant(world_size):
    """batch_size 64, learning rate 1e-4 tuned for 64: every world size optimizes with the same batch and rate."""
    plan = plan_for(["--batch_size", "64", "--learning_rate", "1e-4"], world_size)
    assert plan.global_batch_size == 64
    assert plan.per_device_batch_size * plan.gradient_accumulation_steps * world_size == 64
    assert plan.gradient_accumulation_steps == 1 and plan.per_device_batch_size == 64 // world_size
    assert plan.learning_rate == pytest.approx(1e-4)


@pytest.mark.parametrize("world_size, per_device, accumulation", [(1, 8, 8), (2, 8, 4), (4, 8, 2), (8, 8, 1)])
def test_micro_batch_cap_moves_the_rest_into_accumulation(world_size, per_device, accumulation):
    """64 global, at most 8 per device: 64/(8 x world) accumulation steps."""
    plan = plan_for(["--batch_size", "64", "--micro_batch_size", "8"], world_size)
    assert (plan.per_device_batch_size, plan.gradient_accumulation_steps) == (per_device, accumulation)
    assert plan.global_batch_size == 64


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("rule, factor", [("linear", lambda n: n), ("sqrt", math.sqrt), ("none", lambda n: 1)])
def test_per_device_batch_grows_global_batch_and_scales_learning_rate(world_size, rule, factor):
    """per-device 4 x accumulation 2: global 8n; base batch = the single-process global batch (8), so the rate is
    1e-4 x (8n/8) under linear, x sqrt(n) under sqrt, unchanged under none."""
    plan = plan_for(["--per_device_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-4",
                     "--lr_scaling", rule], world_size)
    assert plan.global_batch_size == 8 * world_size
    assert plan.base_batch_size == 8
    assert plan.learning_rate == pytest.approx(1e-4 * factor(world_size))


def test_explicit_base_batch_scales_a_global_batch():
    plan = plan_for(["--batch_size", "128", "--base_batch_size", "32", "--learning_rate", "1e-5",
                     "--lr_scaling", "linear"], 4)
    assert plan.learning_rate == pytest.approx(4e-5) and plan.lr_scale_factor == pytest.approx(4)


@pytest.mark.parametrize("argv, world_size, message", [
    (["--batch_size", "6"], 4, "--batch_size 6 cannot be split across 4 processes: use a multiple of 4, the nearest "
                               "4 or 8 (with --base_batch_size 6 to keep the learning rate tuned for 6)"),
    (["--batch_size", "2"], 4, "use a multiple of 4, the nearest 4 (with"),
    (["--batch_size", "24", "--gradient_accumulation_steps", "4"], 4,
     "6 per process, which --gradient_accumulation_steps 4 does not divide: use a batch size that is a multiple of 16, "
     "the nearest 16 or 32"),
    (["--batch_size", "64", "--gradient_accumulation_steps", "1", "--micro_batch_size", "8"], 2,
     "puts 32 on each device, over --micro_batch_size 8"),
    (["--per_device_batch_size", "6", "--micro_batch_size", "4", "--gradient_accumulation_steps", "1"], 1,
     "--per_device_batch_size 6 exceeds --micro_batch_size 4"),
    (["--batch_size", "8", "--per_device_batch_size", "2"], 1, "both set: choose one batch mode"),
])
def test_impossible_splits_name_the_numbers_and_a_fix(argv, world_size, message):
    with pytest.raises(ConfigError) as error:
        plan_for(argv, world_size)
    assert message in str(error.value)


SPLITS = {  # (recipe, GPUs): the nearest batch that splits, proposed first
    "default 32": ([], {3: 33, 5: 30, 6: 30, 7: 35}),
    # micro-batches of at most 8, accumulation derived: 66 on 6 GPUs would be 11 steps of 1 per GPU, so 60 (2 of 5)
    "64, micro 8": (["--batch_size", "64", "--micro_batch_size", "8"], {3: 63, 5: 60, 6: 60, 7: 70}),
    "64, 2 accumulation": (["--batch_size=64", "--gradient_accumulation_steps", "2"], {3: 66, 5: 60, 6: 60, 7: 70}),
}


@pytest.mark.parametrize("gpus", [3, 5, 6, 7])
@pytest.mark.parametrize("recipe", list(SPLITS))
def test_a_batch_the_gpus_cannot_share_gets_the_nearest_that_split_and_the_command(gpus, recipe):
    """3, 5, 6 or 7 GPUs with a global batch of 32 or 64: the nearest batch sizes that split, the nearest first, each
    one the launcher then accepts on that many processes with the learning rate it was tuned for."""
    argv, nearest = SPLITS[recipe]
    batch = 64 if argv else 32
    with pytest.raises(BatchSplitError) as error:
        plan_for(argv, gpus)
    sizes = error.value.batch_sizes
    assert sizes[0] == nearest[gpus] and len(sizes) == 2
    base_lr = plan_for(argv, 1).learning_rate
    for size in sizes:
        plan = plan_for(with_batch_size(argv, size, error.value.base_batch_size), gpus)
        assert plan.global_batch_size == size and plan.base_batch_size == batch
        assert plan.learning_rate == pytest.approx(base_lr * math.sqrt(size / batch))
    command = batch_split_command(error.value, ["--dry_run"] + argv, gpus, {"STRATEGY": "zero2"})
    flags = " ".join(with_batch_size(argv, sizes[0], batch))
    assert command == f"STRATEGY=zero2 ./run_distributed.sh {gpus} {flags}" and "--dry_run" not in command
    assert command.count("--batch_size") == 1 and f"--base_batch_size {batch}" in command


def test_the_proposed_batch_respects_a_fixed_accumulation_and_the_micro_batch_cap():
    """64 pairs, 2 accumulation steps, at most 5 per device, on 6 GPUs: 72 would put 6 on a device; 60 is proposed."""
    with pytest.raises(BatchSplitError) as error:
        plan_for(["--batch_size", "64", "--gradient_accumulation_steps", "2", "--micro_batch_size", "5"], 6)
    assert error.value.batch_sizes == [60]


def test_odd_split_uses_the_smallest_even_accumulation():
    """12 per process, cap 5: 3 accumulation steps of 4 (2 steps of 6 would break the cap); per-device 7 under a
    cap of 4: 7 steps of 1, the only exact split."""
    assert resolve_batch(parse_config(USER + ["--batch_size", "12", "--micro_batch_size", "5"]).training, 1) == (
        "global", 4, 3, 12)
    assert resolve_batch(parse_config(USER + ["--per_device_batch_size", "7", "--micro_batch_size", "4"]).training,
                         2) == ("per_device", 1, 7, 14)


@pytest.mark.parametrize("requested, devices, expected", [
    ("auto", Devices("cpu"), "fp32"),
    ("auto", Devices("cuda", ("A100", "A100"), ((8, 0), (8, 0))), "bf16"),
    ("auto", Devices("cuda", ("T4", "A100"), ((7, 5), (8, 0))), "fp16"),
    ("no", Devices("cuda", ("H100",), ((9, 0),)), "fp32"),
    ("fp16", Devices("cuda", ("V100",), ((7, 0),)), "fp16"),
])
def test_precision(requested, devices, expected):
    assert resolve_precision(requested, devices) == expected


def test_bf16_refused_where_a_gpu_lacks_it():
    with pytest.raises(ConfigError, match="T4 has less"):
        resolve_precision("bf16", Devices("cuda", ("T4", "A100"), ((7, 5), (8, 0))))
    with pytest.raises(ConfigError, match="fp16 needs a GPU"):
        resolve_precision("fp16", Devices("cpu"))


def test_backend_follows_the_device():
    assert plan_for([], 2).backend == "gloo"
    assert plan_for([], 2, Devices("cuda", ("H100",) * 2, ((9, 0),) * 2)).backend == "nccl"


def test_stage_default_learning_rates_are_trls():
    """The table in src/config.py equals the installed TRL's class defaults: fails on a TRL upgrade that moves one."""
    import dataclasses

    import trl

    from src.plan import TRL_DEFAULT_LEARNING_RATES, default_learning_rate

    assert plan_for(["--stage", "dpo"], 1).learning_rate == pytest.approx(1e-6)
    assert plan_for(["--stage", "sft"], 1).learning_rate == pytest.approx(2e-5)
    from src.objectives import OBJECTIVES, load

    classes = {name: load(row.training.trl_config) for name, row in OBJECTIVES.items()}  # every row's TRL config
    assert classes["dpo"] is trl.DPOConfig and classes["kto"] is trl.KTOConfig
    trl_defaults = {stage: next(item.default for item in dataclasses.fields(config_class)
                                if item.name == "learning_rate") for stage, config_class in classes.items()}
    assert TRL_DEFAULT_LEARNING_RATES == trl_defaults
    assert {stage: default_learning_rate(stage) for stage in classes} == trl_defaults


def test_flags_override_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d\nbeta: 0.5\nlearning_rate: 1.0e-5\nuse_lora: true\n")
    config = parse_config(["--config", str(recipe), "--beta", "0.2"])
    assert config.dpo.beta == 0.2 and config.training.learning_rate == 1e-5 and config.model.use_peft


def test_trl_fields_pass_through_and_derived_ones_are_refused():
    config = parse_config(USER + ["--lr_scheduler_type", "cosine", "--use_weighting", "--ld_alpha", "0.5"])
    assert config.training.lr_scheduler_type == "cosine"
    assert config.trl_overrides == {"use_weighting": True, "ld_alpha": 0.5}
    with pytest.raises(ConfigError, match="'per_device_train_batch_size' is derived by the toolkit; set --batch_size"):
        parse_config(USER + ["--per_device_train_batch_size", "4"])
    with pytest.raises(ConfigError, match="'bf16' is derived.*--mixed_precision bf16"):
        parse_config(USER + ["--bf16", "true"])


def test_the_table_of_trl_field_names_is_the_installed_trls():
    """src/objectives/trl_field_names.json answers "is this key a TRL field?" without importing TRL: it must hold
    exactly the installed TRL's fields of every config an objective builds (a TRL upgrade that adds or renames one
    fails here; `python -m src.objectives.trl_field_names` writes the table again)."""
    from src.objectives import OBJECTIVES
    from src.objectives.trl_field_names import field_names, live_field_names

    table = field_names()
    assert set(table) == {row.training.trl_config for row in OBJECTIVES.values()}
    for path, names in table.items():
        live = live_field_names(path)
        assert names == live, (f"{path}: not in the table {sorted(live - names)}, gone from TRL {sorted(names - live)}:"
                               " run python -m src.objectives.trl_field_names")


def test_the_table_of_trl_choices_is_the_installed_trls():
    """The values TRL declares for its fields (a `choices` metadata, or the list its help text gives: DPOConfig's and
    GRPOConfig's loss_type) are the installed TRL's, so a value TRL would refuse at the first step is refused as the
    config is parsed; the loss types every row with TRL_CHOICES reads are there."""
    from src.objectives import OBJECTIVES
    from src.objectives.spec import TRL_CHOICES
    from src.objectives.trl_field_names import declared_choices, live_choices

    for path in {row.training.trl_config for row in OBJECTIVES.values()}:
        live = {name: (tuple(item["values"]), item["several"]) for name, item in live_choices(path).items()}
        assert {name: (choice.values, choice.several) for name, choice in declared_choices(path).items()} == live, (
            f"{path}: run python -m src.objectives.trl_field_names")
    for row in OBJECTIVES.values():
        if row.training.loss_types == TRL_CHOICES:
            assert len(declared_choices(row.training.trl_config)["loss_type"].values) > 1, row.name
    assert declared_choices("trl:DPOConfig")["loss_type"].several and "dapo" in \
        declared_choices("trl:GRPOConfig")["loss_type"].values


def test_each_stage_reads_its_rows_knobs_and_a_pipeline_block_no_other():
    """Which toolkit keys a stage reads, from its row and its TRL config's field names: every objective knob is read by
    some objective; a pipeline's block refuses the run's keys and the knobs its stage does not read, naming where they
    belong; a recipe's loss type for another stage's objective gives way to the objective's own default."""
    import dataclasses

    from src.config import DPOArguments, SFTArguments
    from src.config_parse import block_reads, objective_reads, where_it_belongs
    from src.objectives import STAGES

    for concern in (DPOArguments, SFTArguments):
        for item in dataclasses.fields(concern):
            assert any(objective_reads(stage, item.name) for stage in STAGES), item.name
    assert [block_reads("sft", key) for key in ("beta", "packing", "max_steps", "rounds", "results_dir")] == [
        False, True, True, False, False]
    assert [block_reads("dpo", key) for key in ("beta", "loss_weights", "packed_attention", "packing", "rounds")] == [
        True, True, True, False, False]
    assert [objective_reads(stage, "precompute_ref_log_probs") for stage in ("dpo", "kto", "simpo", "orpo", "grpo")] \
        == [True, True, False, False, False]
    assert where_it_belongs("sft_then_dpo_then_grpo", "rounds") == (
        "it is the run's, not a stage's: a top-level key of --stage dpo or sft_then_dpo")
    assert where_it_belongs("sft_then_dpo", "loss_weights") == "it belongs in the top level"
    with pytest.raises(ConfigError, match=r"--sft.packed_attention: 'sft.packed_attention': the SFT stage of "
                                          r"sft_then_dpo does not read packed_attention; it belongs in the top level"):
        parse_config(USER + ["--stage", "sft_then_dpo", "--sft.packed_attention", "dense"])
    kto = parse_config(["--config", str(PROJECT_ROOT / "configs" / "default.yaml"), "--stage", "kto"])
    assert kto.dpo.loss_type == ["kto"] and "loss_type" not in kto.sources
    with pytest.raises(ConfigError, match=r"--loss_type sigmoid sft: KTO takes one of kto, apo_zero_unpaired"):
        parse_config(USER + ["--stage", "kto", "--loss_type", "sigmoid", "sft"])


def test_a_mistyped_flag_is_one_line_without_importing_torch():
    """A key that is no toolkit or TRL field is refused from the names alone (a fresh interpreter: this one has torch)."""
    script = ("import sys\nfrom src.main_distributed import main\n"
              "code = main(['--model_name_or_path', 'm', '--dataset_name', 'd.jsonl', '--lerning_rate', '1e-4'])\n"
              "print('imported:', [name for name in ('torch', 'trl.trainer.dpo_config') if name in sys.modules])\n"
              "sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --lerning_rate: unknown key 'lerning_rate' (did you mean 'learning_rate'?)"), result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "imported: []", result.stdout[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--learnign_rate", "1e-4"], "unknown key 'learnign_rate' (did you mean 'learning_rate'?)"),
    (["--batch_size", "0"], "--batch_size must be a positive whole number, got 0"),
    (["--learning_rate", "-1e-5"], "--learning_rate must be positive"),
    (["--max_steps", "0"], "--max_steps must be positive"),
    (["--batch_size", "many"], "'batch_size' must be int, got 'many'"),
    (["--mixed_precision", "fp8"], "mixed_precision"),
    (["--load_in_4bit"], "--load_in_4bit trains adapters on a frozen 4-bit base: add --use_lora"),
    (["--stage", "ppo"], "stage must be one of dpo, sft, sft_then_dpo"),
    (["--sft.max_steps", "3"], "--sft.* overrides apply only to --stage sft_then_dpo"),
])
def test_bad_flags_get_one_clear_line(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_config(USER + argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_recipe_key_names_the_file_and_suggests(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model_name_or_path: m\ndataset_name: d\nper_device_batchsize: 4\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: unknown key 'per_device_batchsize' \(did you mean "
                                          r"'per_device_batch_size'\?\)"):
        parse_config(["--config", str(recipe)])


def test_a_pipeline_recipe_runs_as_one_stage_without_its_sft_block():
    config = parse_config(["--config", "configs/default.yaml", "--stage", "dpo"])
    assert config.sft_stage_overrides == {} and config.training.max_steps == 60


def test_a_stage_run_alone_from_a_recipe_gets_its_own_run_directory():
    """`./run_distributed.sh 2 --stage dpo` takes configs/default.yaml (SFT then DPO) for all but the stage: its results
    go to results/default-dpo, not into the default pipeline's results/default. The recipe's own stage, typed or not,
    keeps the recipe's name, and the same command names the same directory (it resumes)."""
    from src.pipeline.stages import plan_stages, run_name_for

    launches = [[], ["--stage", "sft_then_dpo"], ["--stage", "dpo"], ["--stage", "sft"],
                ["--stage", "dpo", "--run_name", "mine"], ["--config", "configs/kto.yaml"],
                ["--config", "configs/kto.yaml", "--stage", "dpo"], ["--config", "configs/orpo.yaml", "--stage", "orpo"],
                USER + ["--stage", "dpo"]]
    assert [run_name_for(parse_config(argv)) for argv in launches] == [
        "default", "default", "default-dpo", "default-sft", "mine", "kto", "kto-dpo", "orpo", "dpo-model"]
    assert run_name_for(parse_config(["--stage", "dpo"])) == run_name_for(parse_config(["--stage", "dpo"]))
    (stage,) = plan_stages(parse_config(["--stage", "dpo"]), World(), Devices("cpu"))
    assert stage.run_dir == Path("results") / "default-dpo"


def test_a_stage_says_what_it_starts_from_and_warns_on_the_untrained_embedded_model():
    """The console's `starts from` line and training_info.json's `starts_from`: the untrained embedded model (a
    warning for an objective that follows SFT: DPO on random weights), a model given by path, the stage before."""
    from src.trainers.stage_plan import starting_model

    embedded = parse_config(["--stage", "dpo"])
    described, warning = starting_model("dpo", embedded, "/cache/embedded/model", None)
    assert described == "the untrained embedded base model (randomly initialised: /cache/embedded/model)"
    assert warning.startswith("DPO starts from the untrained embedded base model") and \
        "--stage sft_then_dpo" in warning and "--model_name_or_path" in warning
    assert starting_model("sft", parse_config(["--stage", "sft"]), "/cache/embedded/model", None)[1] is None
    assert starting_model("dpo", embedded, "results/default/sft/model/final", "sft") == (
        "the sft stage's final model (results/default/sft/model/final)", None)
    assert starting_model("dpo", parse_config(USER + ["--stage", "dpo"]), "some/model", None) == ("some/model", None)


def test_sft_stage_overrides_apply_to_the_sft_stage_only():
    config = parse_config(["--max_steps", "7", "--sft.max_steps", "3", "--sft.learning_rate", "0.01"])
    assert stage_config(config, "sft").training.max_steps == 3
    assert stage_config(config, "sft").training.learning_rate == 0.01
    assert stage_config(config, "dpo").training.max_steps == 7


@pytest.mark.parametrize("entry, message", [
    ({"weight": 0.5}, "dataset_mixture entry 1: 'name'"),
    ({"name": "a.jsonl", "weight": 1.5}, "entry 1 (a.jsonl): weight must be the fraction"),
    ({"name": "a.jsonl", "wieght": 0.5}, "unknown key 'wieght' (did you mean 'weight'?)"),
    ({"name": "a.jsonl", "columns": {"question": "q"}}, "entry 1 (a.jsonl): columns maps prompt"),
])
def test_dataset_mixture_entries_are_checked_by_name(entry, message):
    from src.config_checks import validate_mixture

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_mixture([entry])


def test_a_recipe_with_a_mixture_needs_no_dataset_name(tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text("model_name_or_path: embedded\ndataset_mixture:\n  - name: a.jsonl\n    weight: 0.3\n"
                      "  - {name: dir/, columns: {prompt: question}}\n")
    config = parse_config(["--config", str(recipe)])
    assert config.data.dataset_mixture[1] == {"name": "dir/", "columns": {"prompt": "question"}}


def test_the_plan_names_where_each_setting_came_from(tmp_path, monkeypatch):
    """A src/config.py default, a recipe key, a flag and a SageMaker variable: each named in the plan and its record."""
    channel = tmp_path / "channel"
    channel.mkdir()
    (channel / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    monkeypatch.setenv("SM_CHANNEL_TRAINING", str(channel))
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model_name_or_path: m\nbeta: 0.3\nlearning_rate: 1.0e-5\n")
    config = parse_config(["--config", str(recipe), "--max_steps", "7"])
    plan = resolve_plan(config, World(world_size=2, local_world_size=2), Devices("cpu"))

    assert plan.sources["batch_size"] == {"value": 32, "from": "src/config.py"}
    assert plan.sources["mixed_precision"] == {"value": "auto", "from": "src/config.py"}
    assert plan.sources["learning_rate"] == {"value": 1e-5, "from": str(recipe)}
    assert plan.sources["beta"] == {"value": 0.3, "from": str(recipe)}
    assert plan.sources["max_steps"] == {"value": 7, "from": "--max_steps"}
    assert plan.sources["dataset_name"] == {"value": str(channel / "pairs.jsonl"),
                                            "from": "SageMaker SM_CHANNEL_TRAINING"}
    assert "seed" not in plan.sources  # at its src/config.py default and in no row of the plan

    text = " ".join(format_plan(plan).split())  # long temporary paths wrap the plan's lines differently
    assert "[batch_size 32 from src/config.py]" in text
    assert f"learning_rate 1e-05 from {recipe}" in text
    assert f"set by {recipe}: model_name_or_path=m" in text and "beta=0.3" in text
    assert "flags: --max_steps 7" in text
    assert "SageMaker SM_CHANNEL_TRAINING:" in text and f"dataset_name={channel / 'pairs.jsonl'}" in text


def test_the_default_run_names_its_recipe_and_the_sft_block(monkeypatch):
    config = parse_config(["--sft.max_steps", "50"])
    sft = resolve_plan(stage_config(config, "sft"), World(), Devices("cpu"), "sft")
    dpo = resolve_plan(stage_config(config, "dpo"), World(), Devices("cpu"), "dpo")
    assert dpo.sources["learning_rate"]["from"] == "configs/default.yaml"
    assert sft.sources["learning_rate"]["from"] == "configs/default.yaml (sft block)"
    assert sft.sources["max_steps"] == {"value": 50, "from": "--sft.max_steps"}
    assert dpo.sources["max_steps"] == {"value": 60, "from": "configs/default.yaml"}
    assert dpo.sources["stage"]["from"] == "sft_then_dpo in configs/default.yaml"
    without = resolve_plan(parse_config(USER + ["--stage", "dpo"]), World(), Devices("cpu"))
    assert without.sources["learning_rate"] == {"value": None, "from": "TRL's dpo default"}


def test_the_default_recipe_repeats_no_src_config_default():
    """configs/default.yaml keeps only what the demo needs differently: editing src/config.py reaches the default."""
    import dataclasses

    import yaml

    from src.config import CONCERNS

    defaults = {item.name: item.default for concern in CONCERNS for item in dataclasses.fields(concern)
                if item.default is not dataclasses.MISSING}
    recipe = yaml.safe_load((PROJECT_ROOT / "configs" / "default.yaml").read_text())
    repeated = {key: value for key, value in recipe.items() if key in defaults and defaults[key] == value}
    assert repeated == {}


def test_a_src_config_default_edit_reaches_the_default_run(tmp_path):
    """On a copy of the project: a default edited in src/config.py is what ./run_distributed.sh's plan uses, and a
    default the recipe overrides is named with the recipe."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "project"
    for part in ("src", "configs"):
        shutil.copytree(PROJECT_ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "data"))
    source = (copy / "src" / "config.py").read_text()
    for field_name, old, new in (("batch_size", "default=32,", "default=64,"),
                                 ("learning_rate", "default=None,", "default=3e-4,"),
                                 ("gradient_checkpointing", "default=False,", "default=True,")):
        start = source.index(f"    {field_name}: ")
        end = source.index(old, start) + len(old)
        source = source[:start] + source[start:end].replace(old, new) + source[end:]
    (copy / "src" / "config.py").write_text(source)
    script = ("from src.config_parse import parse_config, stage_config\n"
              "from src.plan import format_plan, resolve_plan\n"
              "from src.world import Devices, World\n"
              "config = parse_config([])\n"
              "staged = stage_config(config, 'dpo')\n"
              "print(staged.training.gradient_checkpointing)\n"
              "print(format_plan(resolve_plan(staged, World(world_size=2, local_world_size=2), Devices('cpu'), 'dpo')))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=copy, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("True\n")  # a default no recipe sets: taken as edited
    assert "32 per device x 1 accumulation x 2 processes = 64 global" in result.stdout
    assert "[batch_size 64 from src/config.py]" in result.stdout
    assert "learning_rate 8e-05 from configs/default.yaml" in result.stdout  # the recipe wins, and says so


def test_a_final_stage_trl_field_stays_with_the_final_stage_of_a_pipeline():
    """--undesirable_weight is KTOConfig's, not SFTConfig's: sft_then_kto's SFT stage runs without it (it refused it
    as an unknown key before)."""
    from src.config_parse import stage_config

    config = parse_config(["--stage", "sft_then_kto", "--model_name_or_path", "m", "--dataset_name", "d.jsonl",
                           "--undesirable_weight", "1.2", "--lr_scheduler_type", "cosine"])
    sft, kto = stage_config(config, "sft"), stage_config(config, "kto")
    assert "undesirable_weight" not in sft.trl_overrides and kto.trl_overrides["undesirable_weight"] == 1.2
    assert sft.training.lr_scheduler_type == kto.training.lr_scheduler_type == "cosine"

