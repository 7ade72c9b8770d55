"""A run's request as a Config: the recipe (`--config x.yaml`), then SageMaker's variables as defaults, then the flags
over both; a pipeline's per-stage blocks (`sft:`, `--sft.KEY`) as each stage's own Config; TRL's config fields passed
through, typed from TRL's classes on first use; --help generated from the schema's help texts.

    python -m src.main_distributed --config configs/<recipe>.yaml [--flag value ...]

The schema is src/config.py; what is checked after parsing is src/config_checks.py.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml

from src.config import (CONCERNS, DEFAULT_RECIPE, PROJECT_ROOT, Config, DPOArguments, DataArguments, HubArguments,
                        ModelArguments, SFTArguments, TrainingArguments)
from src.config_checks import closest_name, missing_sources, validate
from src.config_error import ConfigError
from src.data_file_kinds import data_file_kind
from src.objectives import DEFAULT_STAGE, PIPELINE_BLOCKS, PIPELINES, STAGES, UNPAIRED, final_stage, objective
from src.objectives import trl_config_classes, trl_config_paths
from src.objectives.spec import TRL_CHOICES
from src.objectives.trl_field_names import Choice, declared_choices
from src.objectives.trl_field_names import field_names as trl_field_names


# Fields of TRL's configs that the toolkit derives itself: setting them directly would bypass the batch, learning-rate
# and precision resolution, so they are refused with the flag to use instead.
DERIVED_TRL_FIELDS = {
    "per_device_train_batch_size": "--batch_size (global) or --per_device_batch_size",
    "per_device_eval_batch_size": "--per_device_batch_size",
    "train_batch_size": "--batch_size",
    "num_train_epochs": "--num_epochs",
    "bf16": "--mixed_precision bf16",
    "fp16": "--mixed_precision fp16",
    "use_cpu": "nothing: the CPU is used when no GPU is visible",
    "ddp_backend": "nothing: NCCL on GPUs, gloo on CPU",
    "use_peft": "--use_lora",
    "activation_checkpointing": "--gradient_checkpointing",
    # A token given as a flag would be pickled into every checkpoint's training_args.bin and logged with the config.
    "hub_token": "the HF_TOKEN environment variable (tokens are never taken as flags or written to disk)",
    # The toolkit owns the push (one upload after the run, card included): Trainer's own push stays off.
    "hub_strategy": "nothing: --push_to_hub uploads the final model once, after the run",
    "hub_always_push": "nothing: --push_to_hub uploads the final model once, after the run",
    "hub_revision": "nothing: --push_to_hub uploads to the repository's main branch",
}


def _field_types(dataclass_type: type) -> dict[str, Any]:
    hints = typing.get_type_hints(dataclass_type)
    return {item.name: hints[item.name] for item in dataclasses.fields(dataclass_type) if item.init}


def toolkit_fields() -> dict[str, tuple[type, Any]]:
    """Every toolkit key → (its dataclass, its type). ModelConfig's fields count as the toolkit's."""
    return {name: (concern, kind) for concern in CONCERNS for name, kind in _field_types(concern).items()}


def trl_fields(stage: str) -> dict[str, Any]:
    """Fields (name → type) of the TRL config(s) a stage builds, which may pass through as overrides."""
    return {name: kind for config in trl_config_classes(stage) for name, kind in _field_types(config).items()}


class _LazyFields:
    """trl_fields(stage): the names from the table of TRL's field names (src/objectives/trl_field_names.py: no TRL
    import, so a key that is no field is refused in a second), the types from TRL's configs on first use."""

    def __init__(self, stage: str):
        self.stage = stage
        table = trl_field_names()
        self._names = frozenset().union(*(table[path] for path in trl_config_paths(stage)))
        self._fields: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._fields is None:
            self._fields = trl_fields(self.stage)
        return self._fields

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> Any:
        return self._load()[name]

    def names(self) -> list[str]:
        return sorted(self._names)

    def refuse_undeclared(self, name: str, value: Any, where: str) -> None:
        """A value TRL's config declares no choice for (`--truncation_mode keep_middle`; --train_sampling_strategy
        batch_rebalance to KTO, whose KTOConfig leaves it out): one line now, not TRL's error once the data is ready.
        Every config of the stage that has the field must take it (a pipeline's SFT stage gets it too)."""
        for path in trl_config_paths(self.stage):
            choice = declared_choices(path).get(name)
            if choice is not None and value not in choice.values:
                raise ConfigError(f"{where}: '{name}' must be one of {', '.join(choice.values)} for --stage "
                                  f"{self.stage}, got {value!r}")


def _convert(value: Any, annotation: Any, key: str, where: str) -> Any:
    """Convert a YAML or command-line value to a field's annotated type, or fail naming the key."""
    is_union = get_origin(annotation) in (types.UnionType, typing.Union)
    options = [option for option in get_args(annotation) if option is not type(None)] if is_union else [annotation]
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in get_args(annotation):
        return None
    # transformers types its choices as `SchedulerType | str` (optim, the strategies): the str admits any word, which
    # TRL's config refuses only when the trainer is built, after the data was prepared. Its enum's values are the set.
    choices = [member.value for option in options if isinstance(option, type) and issubclass(option, enum.Enum)
               for member in option]
    word = ("yes" if value else "no") if isinstance(value, bool) else value  # YAML reads `no` as False (see str)
    if choices and not isinstance(value, enum.Enum) and word not in choices:
        raise ConfigError(f"{where}: '{key}' must be one of {', '.join(map(str, choices))}, got {value!r}")
    errors = []
    for option in options:
        origin = get_origin(option) or option
        try:
            if origin is bool:
                if isinstance(value, bool):
                    return value
                if str(value).lower() in ("true", "yes", "1"):
                    return True
                if str(value).lower() in ("false", "no", "0"):
                    return False
                raise ValueError
            if origin is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                return int(value)
            if origin is float:
                if isinstance(value, bool):
                    raise ValueError
                return float(value)
            if origin is str:
                if isinstance(value, (dict, list)):
                    raise ValueError
                if isinstance(value, bool):  # YAML 1.1 reads `no` / `yes` as booleans: `eval_strategy: no`
                    return "yes" if value else "no"
                return str(value)
            if origin is list:
                (item_type,) = get_args(option) or (Any,)
                items = value if isinstance(value, list) else [value]
                return [_convert(item, item_type, key, where) for item in items]
            if origin is dict:
                if isinstance(value, str):
                    value = yaml.safe_load(value)
                if not isinstance(value, dict):
                    raise ValueError
                return value
            if origin is typing.Literal:
                if value in get_args(option):
                    return value
                raise ValueError
            if option is Any or (isinstance(option, type) and isinstance(value, option)):
                return value
        except (TypeError, ValueError):
            errors.append(getattr(option, "__name__", str(option)))
    raise ConfigError(f"{where}: '{key}' must be {' or '.join(errors) or annotation}, got {value!r}")


def _split_flags(argv: list[str]) -> list[tuple[str, Any, str]]:
    """['--lr', '1e-4', '--use_lora', '--x=y'] → [(key, raw value or True, '--flag'), ...]."""
    pairs = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument '{token}': flags look like --name value")
        name = token[2:]
        if "=" in name:
            name, raw = name.split("=", 1)
            pairs.append((name, raw, token))
            index += 1
            continue
        values = []
        index += 1
        while index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        if not values:
            pairs.append((name, True, token))  # a bare boolean flag
        else:
            pairs.append((name, values[0] if len(values) == 1 else values, token))
    return pairs


def _parse_flag_value(raw: Any) -> Any:
    """Command-line values stay strings (converted by each field's type later), except YAML lists and mappings
    written inline ("[q_proj, v_proj]", "{num_cycles: 2}")."""
    if isinstance(raw, str) and raw.strip().startswith(("[", "{")):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
    return raw


def _load_recipe(path: str) -> dict[str, Any]:
    recipe_path = Path(path)
    if not recipe_path.is_file():
        raise ConfigError(f"--config: {path} does not exist (recipes live in configs/, e.g. configs/default.yaml)")
    try:
        values = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(error, 'problem', error)})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of keys to values, got {type(values).__name__}")
    return values


class HelpRequested(Exception):
    """--help: the caller prints `format_help()` and exits 0."""


def format_help() -> str:
    """Every flag, grouped by concern, with its default and help text (the dataclass fields are the source)."""
    lines = ["usage: python -m src.main_distributed [--config RECIPE.yaml] [--flag value ...]",
             "       ./run_distributed.sh [NUM_PROCS] [--config RECIPE.yaml] [--flag value ...]", "",
             "Flags override the recipe; --sft.KEY VALUE overrides a key for the SFT stage of sft_then_<name> (and",
             "--dpo.KEY for the DPO stage of sft_then_dpo_then_grpo); any other field of TRL's DPOConfig / SFTConfig /",
             "RewardConfig / KTOConfig / GRPOConfig passes through by name.", ""]
    for concern in CONCERNS:
        lines.append(f"{concern.__name__}: {(concern.__doc__ or '').strip().splitlines()[0]}")
        for item in dataclasses.fields(concern):
            if not item.init or "help" not in item.metadata:
                continue
            default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
            choices = item.metadata.get("choices")
            shown = f"{{{','.join(choices)}}}" if choices else repr(default)
            lines.append(f"  --{item.name} {shown}")
            lines.append(f"      {item.metadata['help'].replace('%%', '%')}")
        lines.append("")
    return "\n".join(lines)


def parse_config(argv: list[str] | None = None, require_sources: bool = True, default_recipe: bool = True) -> Config:
    """Flags (and the recipe named by --config) → Config. Raises ConfigError with one readable line.

    For check_gpu.py, which plans memory from a model or from a size alone: `require_sources=False` lets the model and
    the dataset be left out (everything else is checked as for a launch); `default_recipe=False` keeps
    configs/default.yaml out when nothing names a recipe, model or data (a size stands in for the model)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        raise HelpRequested
    flags = _split_flags(argv)
    recipe_paths = [value for key, value, _ in flags if key == "config"]
    flags = [item for item in flags if item[0] != "config"]
    flag_keys = {key for key, _, _ in flags}
    if len(recipe_paths) > 1:
        raise ConfigError("--config given more than once: one recipe per run")
    sagemaker = sagemaker_defaults()
    if recipe_paths:
        recipe = str(recipe_paths[0])
    elif default_recipe and not {"model_name_or_path", "dataset_name"} & (flag_keys | set(sagemaker)):
        recipe = str(DEFAULT_RECIPE)  # no recipe, no model, no data: the embedded default
    else:
        recipe = None
    recipe_values = _load_recipe(recipe) if recipe else {}
    requested, sources = _requested_values(recipe, recipe_values, sagemaker, flags)
    stage = requested.get("stage", (DEFAULT_STAGE, ""))[0]
    if stage not in STAGES:
        raise ConfigError(f"{requested['stage'][1]}: stage must be one of {', '.join(STAGES)}, got {stage!r}")
    sources = _drop_blocks_the_stage_lacks(requested, sources, stage)
    config = _build_config(requested, stage)
    config.recipe = recipe
    config.recipe_stage = recipe_values.get("stage", DEFAULT_STAGE) if recipe else None
    config.sources = sources
    _check_for_objective(config, stage)
    resolve_loss_type(config, stage, given=_given_for_stage(config, "loss_type"))
    if require_sources:
        for problem in missing_sources(config):
            raise ConfigError(problem)
    return config


def _requested_values(recipe: str | None, recipe_values: dict[str, Any], sagemaker: dict[str, tuple[str, str]],
                      flags: list[tuple[str, Any, str]]) -> tuple[dict[str, tuple[Any, str]], dict[str, str]]:
    """(key → (value, where it was given), key → where the plan says it came from), by precedence: dataclass
    defaults < recipe < SageMaker's environment < flags; --sft.KEY / --dpo.KEY merged into their stage's block."""
    requested: dict[str, tuple[Any, str]] = {}
    sources: dict[str, str] = {}  # what the plan and training_info.json say each setting came from
    if recipe:
        label = recipe_label(recipe)
        for key, value in recipe_values.items():
            requested[key] = (value, Path(recipe).name)
            if key in PIPELINE_BLOCKS and isinstance(value, dict):
                sources.update({f"{key}.{block_key}": f"{label} ({key} block)" for block_key in value})
            else:
                sources[key] = label
    requested.update(sagemaker)
    sources.update({key: f"SageMaker {variable}" for key, (_, variable) in sagemaker.items()})
    for key, raw, token in flags:
        block = key.partition(".")[0]
        if "." in key and block in PIPELINE_BLOCKS:  # --sft.max_steps: a key of that stage of the pipeline
            overrides = dict(requested.get(block, ({}, ""))[0] or {})
            overrides[key.partition(".")[2]] = _parse_flag_value(raw)
            requested[block] = (overrides, token)
        else:
            requested[key] = (_parse_flag_value(raw), token)
        sources[key] = f"--{key}"
    return requested, sources


def _drop_blocks_the_stage_lacks(requested: dict[str, tuple[Any, str]], sources: dict[str, str],
                                 stage: str) -> dict[str, str]:
    """A pipeline block (`sft:`, `dpo:`) of a stage this run does not have: refused when given by flag, dropped (from
    `requested`, in place, and from the returned sources) when it comes with a pipeline recipe run as another stage."""
    for block in PIPELINE_BLOCKS:
        if block in requested and block not in PIPELINES.get(stage, ())[:-1]:
            if requested[block][1].startswith("--"):
                within = [name for name, stages in PIPELINES.items() if block in stages[:-1]]
                raise ConfigError(f"--{block}.* overrides apply only to --stage {' or '.join(within)}")
            del requested[block]
            sources = {key: where for key, where in sources.items() if not key.startswith(f"{block}.")}
    return sources


def _check_for_objective(config: Config, stage: str) -> None:
    """What only this stage's objective cannot take: its row's own check (KTO: a DPO loss type asked for by flag), and
    the unpaired-data flags on an objective that trains on pairs or sequences."""
    row = objective(stage)
    if row.training.validate:
        row.training.validate(config)
    if row.data_shape != UNPAIRED and (config.data.kto_from_pairs or config.data.label_column):
        flag = "--kto_from_pairs" if config.data.kto_from_pairs else "--label_column"
        unpaired = [name for name in STAGES if objective(name).data_shape == UNPAIRED]
        raise ConfigError(f"{flag} applies to --stage {' or '.join(unpaired)}, not {stage}")


def objective_reads(stage: str, key: str) -> bool:
    """Whether a stage's objective reads a toolkit key: every key of the run's concerns (model, data, training, hub);
    of an objective's own knobs (DPOArguments, SFTArguments), those its row names: the row field the key's `read_by`
    names (--packed_attention: the rows with the packed forward; --loss_type: the rows with loss types), else a field
    of the same name in its TRL config (--beta, --label_smoothing, --packing)."""
    concern, _ = toolkit_fields()[key]
    if concern not in (DPOArguments, SFTArguments):
        return True
    row = objective(stage)
    read_by = concern.__dataclass_fields__[key].metadata.get("read_by")
    return bool(operator.attrgetter(read_by)(row)) if read_by else key in trl_field_names()[row.training.trl_config]


def _run_level(key: str) -> bool:
    """A key of the run, not of one stage (its directory, watches, copies, the rounds after its final stage): src/config.py
    marks it `run_level`; a pipeline reads it from the top level only."""
    concern, _ = toolkit_fields()[key]
    return bool(concern.__dataclass_fields__[key].metadata.get("run_level"))


def block_reads(stage: str, key: str) -> bool:
    """Whether an earlier stage of a pipeline reads a toolkit key from its block (`sft:`, `dpo:`; --sft.KEY)."""
    return not _run_level(key) and objective_reads(stage, key)


def where_it_belongs(pipeline: str, key: str) -> str:
    """Where a key a pipeline's block does not read is read: the top level, another stage's block, or another stage."""
    stages = PIPELINES[pipeline]
    if _run_level(key):
        readers = [name for name in STAGES if objective_reads(name, key)]
        runs = "" if len(readers) == len(STAGES) else f" of --stage {' or '.join(readers)}"
        return f"it is the run's, not a stage's: a top-level key{runs}"
    earlier = [name for name in stages[:-1] if block_reads(name, key)]
    # the top level's objective knobs but the SFT stage's are the final stage's (stage_config)
    top_level = objective_reads(stages[-1], key) or (earlier and key not in DPOArguments.__dataclass_fields__)
    places = [f"the {name}: block" for name in earlier] + (["the top level"] if top_level else [])
    return f"it belongs in {' or '.join(places)}" if places else f"no stage of {pipeline} reads it"


def loss_type_choice(stage: str) -> Choice | None:
    """What --loss_type may name for a stage's objective (its row's `loss_types`): TRL's declared values, a loss the
    toolkit fixes, or None where it has no loss type to choose."""
    row = objective(stage)
    if row.training.loss_types == TRL_CHOICES:
        return declared_choices(row.training.trl_config)["loss_type"]
    fixed = row.training.loss_types
    return Choice(fixed, fixed[0], False) if fixed else None


def resolve_loss_type(config: Config, stage: str, given: bool) -> None:
    """--loss_type for a stage's objective, in place: one its row takes when given for it (a flag, its own recipe or
    block), refused in one line otherwise; not given for it (the default, or a recipe's loss of another stage:
    configs/default.yaml's DPO loss run with --stage kto), its objective's own default (TRL's: kto, dapo)."""
    choice = loss_type_choice(stage)
    asked = config.dpo.loss_type
    if not given:
        if choice is not None:
            config.dpo.loss_type = list(choice.default) if choice.several else [choice.default]
        config.sources.pop("loss_type", None)
        return
    where = config.sources["loss_type"]
    named = f"{where} {' '.join(asked)}" if where.startswith("--") else f"{where}: loss_type {' '.join(asked)}"
    title = objective(stage).display_name
    if choice is None:
        raise ConfigError(f"{named}: {title} has no loss type to choose; drop it")
    if len(asked) == 1 and len(choice.values) == 1 and asked[0] not in choice.values:
        raise ConfigError(f"{named}: {title}'s loss is fixed ({choice.values[0]})")
    if not asked or (len(asked) > 1 and not choice.several) or not set(asked) <= set(choice.values):
        several = "one or more (combined with --loss_weights)" if choice.several else "one"
        raise ConfigError(f"{named}: {title} takes {several} of {', '.join(choice.values)}")


def _given_for_stage(config: Config, key: str) -> bool:
    """Whether a key was given for this run's final stage: by flag or SageMaker, or by a recipe that trains the same
    objective (a recipe's key of another stage's objective, the default recipe's DPO loss under --stage kto, is not)."""
    where = config.sources.get(key)
    if where is None:
        return False
    from_recipe = config.recipe is not None and where == recipe_label(config.recipe)
    return not from_recipe or final_stage(config.recipe_stage) == final_stage(config.training.stage)


def recipe_label(path: str | os.PathLike) -> str:
    """A recipe as the plan names it: relative to the project when it lives there (configs/default.yaml)."""
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def sagemaker_defaults(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """SageMaker's training-toolkit conventions as defaults (key → (value, the variable it came from)), so a Hugging
    Face estimator runs src/main_distributed.py unchanged. Empty outside SageMaker; flags (SageMaker passes the
    estimator's hyperparameters as `--key value`) win over them.

    SM_OUTPUT_DATA_DIR → --results_dir (uploaded as output.tar.gz); SM_MODEL_DIR → --final_model_dir (model.tar.gz);
    SM_CHANNEL_TRAINING → --dataset_name: the channel's one data file, or the directory (split files, save_to_disk).
    """
    environ = os.environ if environ is None else environ
    defaults = {}
    for variable, key in (("SM_OUTPUT_DATA_DIR", "results_dir"), ("SM_MODEL_DIR", "final_model_dir"),
                          ("SM_CHANNEL_TRAINING", "dataset_name")):
        if environ.get(variable):
            defaults[key] = (environ[variable], variable)
    channel = Path(environ.get("SM_CHANNEL_TRAINING") or "")
    if "dataset_name" in defaults and channel.is_dir():
        files = [path for path in sorted(channel.iterdir()) if path.is_file() and data_file_kind(path)]
        if len(files) == 1:
            defaults["dataset_name"] = (str(files[0]), "SM_CHANNEL_TRAINING")
    return defaults


def _build_config(requested: dict[str, tuple[Any, str]], stage: str) -> Config:
    known = toolkit_fields()
    passthrough = _LazyFields(stage)  # TRL's configs import transformers and torch: only read them when needed
    values: dict[type, dict[str, Any]] = {concern: {} for concern in CONCERNS}
    trl_overrides: dict[str, Any] = {}
    stage_overrides: dict[str, dict[str, Any]] = {}
    for key, (value, where) in requested.items():
        if key in PIPELINE_BLOCKS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{key}' holds the {key.upper()} stage's overrides as a mapping, got "
                                  f"{value!r}")
            for block_key in value:
                if block_key not in known and block_key not in _LazyFields(key):
                    raise ConfigError(f"{where}: unknown key '{key}.{block_key}'{closest_name(block_key, known)}")
                if block_key in ("stage", *PIPELINE_BLOCKS):
                    raise ConfigError(f"{where}: '{key}.{block_key}' cannot be overridden per stage")
                if block_key in known and not block_reads(key, block_key):
                    raise ConfigError(f"{where}: '{key}.{block_key}': the {objective(key).display_name} stage of "
                                      f"{stage} does not read {block_key}; {where_it_belongs(stage, block_key)}")
            stage_overrides[key] = dict(value)
            continue
        if key in known:
            concern, kind = known[key]
            values[concern][key] = _convert(value, kind, key, where)
            choices = concern.__dataclass_fields__[key].metadata.get("choices")
            if choices and values[concern][key] not in choices:
                raise ConfigError(f"{where}: '{key}' must be one of {', '.join(choices)}, got {value!r}")
        elif key in DERIVED_TRL_FIELDS:
            raise ConfigError(f"{where}: '{key}' is derived by the toolkit; set {DERIVED_TRL_FIELDS[key]} instead")
        elif key in passthrough:
            trl_overrides[key] = _convert(value, passthrough[key], key, where)
            passthrough.refuse_undeclared(key, trl_overrides[key], where)
        else:
            raise ConfigError(f"{where}: unknown key '{key}'{closest_name(key, list(known) + passthrough.names())}")
    try:
        parts = {concern: concern(**values[concern]) for concern in CONCERNS}
    except ValueError as error:  # ModelConfig's own checks, e.g. 4-bit and 8-bit together
        raise ConfigError(str(error)) from None
    if "batch_size" not in requested and parts[TrainingArguments].per_device_batch_size is not None:
        parts[TrainingArguments].batch_size = None  # a per-device batch replaces the default global one
    config = Config(
        model=parts[ModelArguments],
        data=parts[DataArguments],
        training=parts[TrainingArguments],
        dpo=parts[DPOArguments],
        sft=parts[SFTArguments],
        hub=parts[HubArguments],
        trl_overrides=trl_overrides,
        stage_overrides=stage_overrides,
    )
    if config.dpo.beta is None:  # not given: the objective's own, a value in its row (SimPO 2.0, DPO 0.1, GRPO 0)
        config.dpo.beta = objective(stage).training.default_beta
    validate(config)
    return config


def stage_config(config: Config, stage: str) -> Config:
    """The config one stage of a pipeline runs with: for an earlier stage (the SFT stage of sft_then_<name>, the DPO
    stage of sft_then_dpo_then_grpo) its block's overrides (`sft:`, `dpo:`) apply, and a TRL field of the final
    stage's config that the stage's own has not (--undesirable_weight, --simpo_gamma, --num_generations) stays with
    the final stage."""
    pipeline = config.training.stage
    if pipeline not in PIPELINES:
        return config
    own_trl_fields = _LazyFields(stage)  # TRL's configs cost seconds to import: read only when there are overrides
    final = stage == PIPELINES[pipeline][-1]
    # The top level's loss settings (DPOArguments: beta, loss_type, ...) are the last stage's: an earlier stage's own
    # come from its block (GRPO's beta 0.04 and loss dapo are not the DPO stage's of sft_then_dpo_then_grpo)
    loss_keys = set() if final else {item.name for item in dataclasses.fields(DPOArguments)}
    requested = {key: (value, stage) for key, value in config.values().items()
                 if key not in PIPELINE_BLOCKS and key not in loss_keys}
    requested = {key: value for key, value in requested.items()
                 if key in toolkit_fields() or (key in config.trl_overrides and key in own_trl_fields)}
    sources = {key: where for key, where in config.sources.items()
               if not key.startswith(BLOCK_PREFIXES) and key not in loss_keys}
    for key, value in config.stage_overrides.get(stage, {}).items():
        requested[key] = (value, stage)
        sources[key] = config.sources.get(f"{stage}.{key}", f"the {stage} block")
    requested["stage"] = (stage, stage)
    if "stage" in sources:
        sources["stage"] = f"{pipeline} in {sources['stage']}"
    staged = _build_config(requested, stage)
    staged.recipe, staged.recipe_stage = config.recipe, config.recipe_stage
    staged.sources = sources
    if not final:  # the final stage's loss was resolved with the run's config; an earlier one's is its block's
        resolve_loss_type(staged, stage, given="loss_type" in config.stage_overrides.get(stage, {}))
    return staged


BLOCK_PREFIXES = tuple(f"{block}." for block in PIPELINE_BLOCKS)  # sources' keys of a pipeline stage's block
