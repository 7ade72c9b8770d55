"""What the user asked `check_gpu.py` to check: the recipe YAML, the flags that override it, and their validation.

A recipe is the toolkit's YAML file (`configs/<name>.yaml`, keys are the training flags). Only the keys that decide
memory per GPU are read here; every other key is ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

STAGES = ("dpo", "sft", "sft_then_dpo")
MIXED_PRECISIONS = ("auto", "no", "fp16", "bf16")
ALL_LINEAR = "all-linear"


class InputError(Exception):
    """Bad user input. The message names the flag and says what to do; it is printed as one line (exit status 3)."""


@dataclass
class TrainingSetup:
    """The recipe settings that decide memory per GPU (recipe keys, overridden by flags)."""

    stage: str = field(default="dpo", metadata={"help": "dpo or sft; DPO holds chosen+rejected and maybe a reference"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "local directory or Hub id"})
    param_count: int | None = field(default=None, metadata={"help": "parameter count when no model is named"})
    use_lora: bool = field(default=False, metadata={"help": "train LoRA adapters on a frozen base"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_target_modules: list[str] | str = field(default=ALL_LINEAR, metadata={"help": "module names or all-linear"})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: NF4 base weights"})
    per_device_batch_size: int | None = field(default=None, metadata={"help": "sequences (pairs for DPO) per GPU"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "same as per_device_batch_size"})
    batch_size: int | None = field(default=None, metadata={"help": "global batch; per device = batch / processes"})
    max_length: int = field(default=1024, metadata={"help": "tokens of prompt + completion"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations (the toolkit's "
                                                                        "default: off)"})
    precompute_ref_log_probs: bool = field(
        default=True, metadata={"help": "no reference model during training (the toolkit's default, unless the recipe "
                                "sets sync_ref_model: TR-DPO moves the reference)"}
    )
    mixed_precision: str = field(default="auto", metadata={"help": "auto, no, fp16 or bf16"})
    recipe_path: str | None = field(default=None, metadata={"help": "the YAML these settings came from"})
    method_chosen: bool = field(
        default=False, metadata={"help": "the user picked full/LoRA/QLoRA (recipe or flag), so its fit is checked"}
    )

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise InputError(f"--stage {self.stage!r}: use one of {', '.join(STAGES)}")
        if self.stage == "sft_then_dpo":
            self.stage = "dpo"  # the pipeline's peak memory is its DPO stage (pairs, and a reference model)
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise InputError(f"mixed_precision {self.mixed_precision!r}: use one of {', '.join(MIXED_PRECISIONS)}")
        for name in ("lora_r", "max_length", "per_device_batch_size", "micro_batch_size", "batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.lora_target_modules, str) and self.lora_target_modules != ALL_LINEAR:
            self.lora_target_modules = [self.lora_target_modules]

    @property
    def method(self) -> str:
        if self.load_in_4bit:
            return "qlora"
        return "lora" if self.use_lora else "full"

    def per_device_batch(self, num_processes: int) -> tuple[int, str]:
        """The per-device batch and where it came from (the global batch is split over the processes)."""
        if self.per_device_batch_size is not None:
            return self.per_device_batch_size, "per_device_batch_size"
        if self.micro_batch_size is not None:
            return self.micro_batch_size, "micro_batch_size"
        if self.batch_size is not None:
            return max(1, math.ceil(self.batch_size / max(1, num_processes))), f"batch_size {self.batch_size} / {num_processes}"
        return 1, "default"


@dataclass
class CheckOptions:
    """Everything one run of check_gpu.py was asked to do."""

    as_json: bool = False
    bench: bool = False
    bench_timeout_s: float = 90.0
    num_procs: int | None = None
    training: TrainingSetup = field(default_factory=TrainingSetup)
    training_flags: dict[str, Any] = field(default_factory=dict)  # recipe keys given as flags, passed on to the launch

    @property
    def plan_requested(self) -> bool:
        return self.training.model_name_or_path is not None or self.training.param_count is not None


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


def _read_recipe(path: str) -> dict[str, Any]:
    recipe_file = Path(path)
    if not recipe_file.is_file():
        raise InputError(f"--config {path}: no such file; pass a recipe YAML such as configs/default.yaml")
    try:
        recipe = yaml.safe_load(recipe_file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        first_line = str(error).splitlines()[0]
        raise InputError(f"--config {path}: not valid YAML ({first_line})") from None
    if not isinstance(recipe, dict):
        raise InputError(f"--config {path}: expected a mapping of flag: value, got {type(recipe).__name__}")
    return recipe


def training_setup(recipe_path: str | None, overrides: dict[str, Any]) -> TrainingSetup:
    """The recipe's memory-relevant keys, then the flags that were given (None means 'not given')."""
    known = {item.name for item in fields(TrainingSetup)}
    settings: dict[str, Any] = {}
    if recipe_path is not None:
        recipe = _read_recipe(recipe_path)
        settings = {key: value for key, value in recipe.items() if key in known and value is not None}
        settings["recipe_path"] = recipe_path
        settings["method_chosen"] = "use_lora" in recipe or "load_in_4bit" in recipe
        if recipe.get("sync_ref_model") and recipe.get("precompute_ref_log_probs") is None:
            settings["precompute_ref_log_probs"] = False
    for key, value in overrides.items():
        if value is not None:
            settings[key] = value
    if settings.get("load_in_4bit"):
        settings["use_lora"] = True  # QLoRA trains LoRA adapters on the 4-bit base
    batch_keys = ("batch_size", "per_device_batch_size", "micro_batch_size")
    if recipe_path is not None and not any(settings.get(key) is not None for key in batch_keys):
        from src.config import TrainingArguments  # light: the dataclasses, no torch

        # A recipe that sets no batch trains with src/config.py's default global batch.
        settings["batch_size"] = TrainingArguments.__dataclass_fields__["batch_size"].default
    return TrainingSetup(**settings)
