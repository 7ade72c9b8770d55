"""A parsed configuration checked before anything runs: flags that conflict or name nothing, a --dataset_mixture's
entries, a --judge and --rounds that need each other, and the sources a run cannot start without; each mistake a
ConfigError naming the flag (tests/test_user_mistakes.py)."""

from __future__ import annotations

import difflib
from pathlib import Path

from src.config import EMBEDDED, TRACKERS, Config, DataArguments, HubArguments, ModelArguments, TrainingArguments
from src.config_error import ConfigError
from src.objectives import STAGES, objective
from src.tool_calls import validate_config as validate_tools


def closest_name(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


MIXTURE_KEYS = ("name", "path", "weight", "fraction", "split", "config", "columns")
MIXTURE_COLUMNS = ("prompt", "chosen", "rejected", "messages", "completion", "text")


def validate_mixture(mixture: list[dict] | None) -> None:
    """Each --dataset_mixture entry names a source and a fraction in (0, 1]; the error names the entry."""
    for number, entry in enumerate(mixture or [], start=1):
        where = f"dataset_mixture entry {number}"
        unknown = [key for key in entry if key not in MIXTURE_KEYS]
        if unknown:
            raise ConfigError(f"{where}: unknown key '{unknown[0]}'{closest_name(unknown[0], MIXTURE_KEYS)}; an entry "
                              f"holds {', '.join(MIXTURE_KEYS)}")
        name = entry.get("name") or entry.get("path")
        if not name:
            raise ConfigError(f"{where}: 'name' (a Hub id, a file or a directory) is required")
        where = f"dataset_mixture entry {number} ({name})"
        fraction = entry.get("weight", entry.get("fraction", 1.0))
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigError(f"{where}: weight must be the fraction of its rows to take, in (0, 1]; got {fraction!r}")
        columns = entry.get("columns") or {}
        if not isinstance(columns, dict) or any(key not in MIXTURE_COLUMNS for key in columns):
            raise ConfigError(f"{where}: columns maps {', '.join(MIXTURE_COLUMNS)} to the source's column names; "
                              f"got {columns!r}")


def validate(config: Config) -> None:
    """Checks that need no data, model or process group; each names its flag and what to do."""
    validate_training_numbers(config.training)
    validate_data_settings(config.data)
    beta = config.dpo.beta  # None: the objective's own default (its row's default_beta)
    if beta is not None and (beta < 0 or (beta == 0 and not objective(config.training.stage).training.beta_may_be_zero)):
        raise ConfigError(f"--beta must be positive, got {beta}")
    validate_rounds(config)
    validate_judges(config)
    validate_tools(config)
    validate_model_settings(config.model)
    validate_outputs(config.training)
    validate_hub(config.hub)
    if config.model.lora_r < 1:
        raise ConfigError(f"--lora_r must be a positive whole number, got {config.model.lora_r}")
    validate_mixture(config.data.dataset_mixture)


def validate_training_numbers(training: TrainingArguments) -> None:
    """Batch sizes, steps, rates and counts of the training settings in their ranges."""
    for name in ("batch_size", "per_device_batch_size", "micro_batch_size", "gradient_accumulation_steps",
                 "base_batch_size", "eval_steps", "save_steps"):
        value = getattr(training, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be a positive whole number, got {value}")
    if training.learning_rate is not None and not training.learning_rate > 0:
        raise ConfigError(f"--learning_rate must be positive, got {training.learning_rate}")
    if training.max_steps == 0 or training.max_steps < -1:
        raise ConfigError(f"--max_steps must be positive (or -1 to train --num_epochs), got {training.max_steps}")
    if training.max_steps == -1 and not training.num_epochs > 0:
        raise ConfigError(f"--num_epochs must be positive, got {training.num_epochs}")
    if training.logging_steps < 1:
        raise ConfigError(f"--logging_steps must be at least 1, got {training.logging_steps}")
    if training.audit_judge_pairs < 0:
        raise ConfigError(f"--audit_judge_pairs must be 0 or more, got {training.audit_judge_pairs}")
    if training.num_samples < 0:
        raise ConfigError(f"--num_samples must be 0 or more, got {training.num_samples}")
    if training.judged_eval_prompts < 0:
        raise ConfigError(f"--judged_eval_prompts must be 0 or more, got {training.judged_eval_prompts}")


def validate_data_settings(data: DataArguments) -> None:
    """--max_length, --embedded_reasoning's data, and the held-out split sizes."""
    if data.max_length < 8:
        raise ConfigError(f"--max_length must be at least 8 tokens, got {data.max_length}")
    if data.embedded_reasoning and data.dataset_name not in (None, EMBEDDED):
        raise ConfigError(f"--embedded_reasoning answers the embedded tasks with reasoning: it takes --dataset_name "
                          f"{EMBEDDED}, not {data.dataset_name} (your own data's reasoning is in its answers)")
    for name in ("val_size", "test_size"):
        value = getattr(data, name)
        if value < 0 or (1 <= value and not float(value).is_integer()):
            raise ConfigError(f"--{name} is a fraction below 1 or a whole number of rows, got {value}")


def validate_model_settings(model: ModelArguments) -> None:
    """4-bit, merging and LoRA settings that cannot go together or are out of range."""
    if model.merge_adapter and model.load_in_4bit:
        raise ConfigError("--merge_adapter with --load_in_4bit would merge into quantized weights and lose precision: "
                          "merge the saved adapter into the 16-bit base afterwards (peft's merge_and_unload)")
    if model.load_in_4bit and not model.use_peft:
        raise ConfigError("--load_in_4bit trains adapters on a frozen 4-bit base: add --use_lora (QLoRA)")
    # PEFT refuses these only when the trainer is built, after the data was prepared and every rank loaded the model.
    if model.use_peft and model.lora_r < 1:
        raise ConfigError(f"--lora_r is the adapters' rank, a positive whole number (e.g. 16), got {model.lora_r}")
    if model.use_peft and not 0 <= model.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout is a probability in [0, 1), got {model.lora_dropout}")


def validate_outputs(training: TrainingArguments) -> None:
    """--run_name (a directory under the results) and --report_to (the trackers)."""
    if training.run_name is not None and (not training.run_name.strip() or ".." in Path(training.run_name).parts):
        raise ConfigError(f"--run_name must be a plain name, got {training.run_name!r}")
    unknown = [name for name in training.report_to if name not in ("none", *TRACKERS)]
    if unknown:
        raise ConfigError(f"--report_to {unknown[0]}: not a supported tracker; choose from none, {', '.join(TRACKERS)}")
    if "none" in training.report_to and len(training.report_to) > 1:
        raise ConfigError(f"--report_to {' '.join(training.report_to)}: 'none' cannot be combined with a tracker")


def validate_hub(hub: HubArguments) -> None:
    """--push_to_hub needs a --hub_model_id, and that id is one the Hub accepts."""
    if hub.push_to_hub and not hub.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id ORG/NAME (the Hub repository to create or update)")
    if hub.hub_model_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(hub.hub_model_id)
        except HFValidationError:
            raise ConfigError(f"--hub_model_id {hub.hub_model_id!r} is not a Hub repository id: use ORG/NAME "
                              "(letters, digits, '-', '_', '.')") from None


def has_judge(config: Config) -> bool:
    """Whether the run has a judge to score answers: --rewards, or a --judge that names one (auto: the embedded data)."""
    judge = config.training.judge
    return bool(config.training.rewards) or not (judge == "none" or (judge == "auto" and
                                                                     config.data.dataset_name != EMBEDDED))


def validate_judges(config: Config) -> None:
    """An objective whose rewards are the judges' scores, on data no judge knows and with none named: one line."""
    row = objective(config.training.stage)
    has_data = config.data.dataset_name or config.data.dataset_mixture  # check_gpu plans without any
    if row.training.rewards_from_judges and has_data and not has_judge(config):
        raise ConfigError(f"--stage {config.training.stage} learns from rewards, and {config.data.dataset_name or 'the data'} "
                          "has no judge to give them: name one with --judge (or several with --rewards): "
                          "module:function (your own check: function(row, answer) -> a number, row['meta'] holds the "
                          "prompt's meta), or the path or Hub id of a reward model")


def validate_rounds(config: Config) -> None:
    """--rounds and its round_* settings: each error names the flag."""
    dpo = config.dpo
    if dpo.rounds < 0:
        raise ConfigError(f"--rounds must be 0 (offline DPO) or more, got {dpo.rounds}")
    if not dpo.rounds:
        return
    if not objective(config.training.stage).on_policy_rounds:
        with_rounds = [name for name in STAGES if objective(name).on_policy_rounds]
        raise ConfigError(f"--rounds runs DPO rounds after the DPO stage: use --stage {' or '.join(with_rounds)}, not "
                          f"{config.training.stage}")
    if not has_judge(config):
        raise ConfigError("--rounds needs a judge to rank each prompt's answers: --judge module:function (your own "
                          "check), or the path or Hub id of a reward model (e.g. a --stage reward run's model)")
    if dpo.round_samples < 2:
        raise ConfigError(f"--round_samples must be at least 2 (a pair needs two answers), got {dpo.round_samples}")
    if dpo.round_prompts < 0:
        raise ConfigError(f"--round_prompts must be 0 (every train prompt) or more, got {dpo.round_prompts}")
    if not dpo.round_temperature > 0:
        raise ConfigError(f"--round_temperature must be positive, got {dpo.round_temperature}")
    if not 0 < dpo.round_top_p <= 1:
        raise ConfigError(f"--round_top_p is a probability in (0, 1], got {dpo.round_top_p}")
    if dpo.round_max_steps == 0 or dpo.round_max_steps < -1:
        raise ConfigError(f"--round_max_steps must be positive (or -1: one pass over the round's pairs), got "
                          f"{dpo.round_max_steps}")


def missing_sources(config: Config) -> list[str]:
    """What a launch still needs before it can start: the model and the data (one line each)."""
    missing = []
    if config.model.model_name_or_path is None:
        missing.append(f"--model_name_or_path is required (a Hub id or a local directory, or '{EMBEDDED}')")
    if config.data.dataset_name is None and not config.data.dataset_mixture:
        missing.append(f"--dataset_name is required (a Hub id, a directory or a data file, or '{EMBEDDED}')")
    return missing
