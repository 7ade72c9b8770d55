"""What the user asked `check_gpu.py` to check: the launcher's own configuration and plan, seen as the settings that
decide memory per device.

`check_gpu.py` takes the launcher's flags and recipes: src/config.py parses them (`parse_config`, the same recipe
reader, fields and checks as `./run_distributed.sh`), and the launcher's `stage_plans` resolves the per-device batch,
accumulation, learning rate and precision once the check knows how many processes the launch starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from src.config import EMBEDDED, Config
from src.config_error import ConfigError
from src.config_parse import parse_config
from src.objectives import final_stage
from src.plan import Plan
from src.objectives import DEFAULT_STAGE, objective

from .data_lengths import DataLengths

ALL_LINEAR = "all-linear"


class InputError(Exception):
    """Bad user input. The message names the flag and says what to do; it is printed as one line (exit status 3)."""


@dataclass
class TrainingSetup:
    """The settings that decide memory per device, from the launcher's config and resolved plan of the stage that
    peaks (a pipeline's DPO stage: pairs, and maybe a reference model)."""

    stage: str = DEFAULT_STAGE  # an objective's name (src/objectives/)
    model_name_or_path: str | None = None
    param_count: int | None = None  # --params: a size instead of a model
    use_lora: bool = False
    lora_r: int = 16
    lora_dropout: float = 0.0  # PEFT keeps each adapted layer's dropped-out input for backward when > 0
    lora_target_modules: list[str] | str = ALL_LINEAR
    load_in_4bit: bool = False
    per_device_batch_size: int = 1  # the plan's micro-batch on one device
    batch_source: str = "default"  # how the plan got it, for the report
    max_length: int = 1024
    gradient_checkpointing: bool = False
    precompute_ref_log_probs: bool = True
    mixed_precision: str = "auto"  # as requested
    precision: str = "fp32"  # as the plan resolves it on the launch devices
    recipe_path: str | None = None
    method_chosen: bool = False  # the user picked full/LoRA/QLoRA (recipe or flag), so its fit is checked
    reference_kept: bool | None = None  # a reference copy by the run's settings; None: as the objective's row says
    # An objective that samples as it trains (its row's memory_setup): tokens of one sampled sequence (prompt +
    # answer; 0: it samples none) and the micro-batches sampled at once (None: the plan's accumulation steps, TRL's
    # steps_per_generation default)
    generation_tokens: int = 0
    generation_steps: int | None = None
    # ... and for its step-time estimate (src/diagnostics/time_plan.py): the answer's tokens within generation_tokens,
    # the judges that score the answers, and the plan's accumulation steps
    answer_tokens: int = 0
    judges: tuple[str, ...] = ()
    accumulation_steps: int = 1
    # The data's audited lengths (src/diagnostics/data_lengths.py), when its prepared data is in the cache
    data_lengths: DataLengths | None = None

    @property
    def sequence_tokens(self) -> int:
        """Tokens per sequence the memory plan counts: the longest the data reaches within --max_length when its
        audit is known, else --max_length (every batch may reach it)."""
        return self.data_lengths.planned_tokens(self.max_length) if self.data_lengths else self.max_length

    @property
    def method(self) -> str:
        if self.load_in_4bit:
            return "qlora"
        return "lora" if self.use_lora else "full"


@dataclass
class CheckOptions:
    """Everything one run of check_gpu.py was asked to do."""

    as_json: bool = False
    bench: bool = False
    bench_timeout_s: float = 90.0
    num_procs: int | None = None
    config: Config | None = None  # the launcher's parse of launch_arguments
    launch_arguments: list[str] = field(default_factory=list)  # the launcher's flags as given (old names translated)
    param_count: int | None = None
    # The settings before the plan is resolved (batch and precision are filled in by `with_plan`).
    training: TrainingSetup = field(default_factory=TrainingSetup)

    @property
    def plan_requested(self) -> bool:
        # The embedded default's model is built on first use, 4 layers x 128: nothing to plan for.
        return self.param_count is not None or self.training.model_name_or_path not in (None, EMBEDDED)


def training_setup(config: Config, param_count: int | None = None) -> TrainingSetup:
    """The memory-relevant settings of the run's final stage (a pipeline's peak is its DPO stage)."""
    stage = final_stage(config.training.stage)
    model, training = config.model, config.training
    precompute = config.dpo.precompute_ref_log_probs
    if precompute is None:  # the launcher's default: on, unless TR-DPO's sync_ref_model moves the reference
        precompute = not config.trl_overrides.get("sync_ref_model", False)
    setup = TrainingSetup(
        stage=stage,
        model_name_or_path=model.model_name_or_path,
        param_count=param_count,
        use_lora=model.use_peft,
        lora_r=model.lora_r,
        lora_dropout=model.lora_dropout,
        lora_target_modules=_targets(model.lora_target_modules),
        load_in_4bit=model.load_in_4bit,
        max_length=config.data.max_length,
        gradient_checkpointing=training.gradient_checkpointing,
        precompute_ref_log_probs=precompute,
        mixed_precision=training.mixed_precision,
        recipe_path=config.recipe,
        method_chosen=any(key in config.sources for key in ("use_lora", "use_peft", "load_in_4bit")),
    )
    row = objective(stage)
    return replace(setup, **row.memory.memory_setup(config)) if row.memory.memory_setup else setup


def _targets(targets: list[str] | str | None) -> list[str] | str:
    if not targets or targets == [ALL_LINEAR] or targets == ALL_LINEAR:
        return ALL_LINEAR
    return [targets] if isinstance(targets, str) else list(targets)


def with_plan(setup: TrainingSetup, plan: Plan) -> TrainingSetup:
    """The setup with the launcher's resolved per-device batch and precision."""
    if plan.batch_mode == "global":
        source = (f"batch_size {plan.global_batch_size} / {plan.world_size} processes"
                  + (f" / {plan.gradient_accumulation_steps} accumulation" if plan.gradient_accumulation_steps > 1
                     else ""))
    else:
        source = "per_device_batch_size" + (f" / {plan.gradient_accumulation_steps} accumulation"
                                            if plan.gradient_accumulation_steps > 1 else "")
    return replace(setup, per_device_batch_size=plan.per_device_batch_size, batch_source=source,
                   precision=plan.precision, accumulation_steps=plan.gradient_accumulation_steps,
                   generation_steps=setup.generation_steps or plan.gradient_accumulation_steps)


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_param_count(text: str) -> int:
    """'7e9', '7000000000', '1.5B', '350M', '70b' -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not match:
        raise InputError(f"--params {text!r}: write a count such as 7e9, 1.5B or 350M")
    count = float(match.group(1)) * _SUFFIXES.get(match.group(2), 1)
    if count < 1e5:
        raise InputError(f"--params {text!r}: that is {count:.0f} parameters; write e.g. 7e9 or 7B for seven billion")
    return int(count)


def parse_launch_arguments(arguments: list[str], size_given: bool = False) -> Config:
    """The launcher's parse of its flags and recipe, without requiring a model or data. With a size (--params) in
    place of a model, configs/default.yaml (the embedded model's recipe) is not read when nothing names a recipe:
    the plan is src/config.py's defaults and the flags."""
    try:
        return parse_config(list(arguments), require_sources=False, default_recipe=not size_given)
    except ConfigError as error:
        raise InputError(str(error)) from None
