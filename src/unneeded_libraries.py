"""Libraries a training process will not use are not imported: bitsandbytes without 4/8-bit, trackers not asked for,
deepspeed without DeepSpeed.

peft imports bitsandbytes whenever it is installed (peft/helpers.py: `try: import bitsandbytes`), and transformers'
Trainer imports peft; TRL imports wandb whenever it is installed (`if is_wandb_available(): import wandb`), and trackio
at every checkpoint (its model card asks `get_trackio_space_url()`, which imports trackio and its web server). Measured
on the 2-core development machine: bitsandbytes ~1.6 s, wandb ~1.0 s and trackio ~0.2 s of every training process
(`python -X importtime`), for nothing unless the run quantizes or logs to that tracker. accelerate imports deepspeed
whenever it is installed, at the trainer's start (`extract_model_from_parallel`: `from deepspeed import
DeepSpeedEngine`): 0.4-1.0 CPU-s of every DDP or FSDP process here, measured, and deepspeed's "Setting accelerator
to CPU" lines on its console.

A library this run does not need is marked absent for the process (`sys.modules[name] = None`, Python's own way to
say "not importable"): every library asks `importlib.util.find_spec` or tries the import, gets "not installed", and
takes its path without it, consistently, for the whole process. A library already imported is left alone. A process
that needs transformers' tokenizer and no model loads it without torch (`without_torch`).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

# transformers' bitsandbytes optimizers (trainer_optimizer.py _BITSANDBYTES_OPTIMIZERS: adamw_bnb_8bit, adamw_8bit,
# paged_adamw*, ademamix*, lion*, paged_lion*, rmsprop_bnb*): an --optim naming one of these needs bitsandbytes.
BITSANDBYTES_OPTIMIZER_WORDS = ("bnb", "8bit", "paged", "ademamix", "lion")
# The trackers TRL and accelerate import whenever they are installed (TensorBoard is imported only when asked for).
TRACKERS_IMPORTED_UNASKED = ("wandb", "trackio")


def unneeded_libraries(config, model_names: list[str], engine_name: str | None = None) -> list[str]:
    """The installed-but-unused libraries of a run: bitsandbytes unless the run loads in 4 or 8 bits, names a
    bitsandbytes optimizer or starts from a bitsandbytes-quantized checkpoint (any of `model_names`: the model, a
    reward-model judge); wandb and trackio unless --report_to names them (the launch's or a pipeline stage's block's);
    deepspeed unless the launch's engine is DeepSpeed (`engine_name`: src/engines.py's name of it) or a TRL
    `--deepspeed` config passes through."""
    unneeded = []
    blocks = list(config.stage_overrides.values())  # a pipeline's earlier stages' own keys (`sft:`, `dpo:`)
    optimizers = [str(overrides.get("optim", "")) for overrides in (config.trl_overrides, *blocks)]
    quantized = config.model.load_in_4bit or config.model.load_in_8bit
    if not quantized and not any(word in optim for optim in optimizers for word in BITSANDBYTES_OPTIMIZER_WORDS) \
            and not any(bitsandbytes_checkpoint(name) for name in model_names):
        unneeded.append("bitsandbytes")
    asked = (config.training.report_to, *(block.get("report_to") for block in blocks))  # earlier stages': as written
    unneeded += [tracker for tracker in TRACKERS_IMPORTED_UNASKED if not any(tracker in str(trackers) for trackers in asked)]
    return unneeded + unneeded_engines(config, engine_name)


def unneeded_engines(config, engine_name: str | None) -> list[str]:
    """deepspeed, unless the launch's engine is DeepSpeed (`engine_name`: src/engines.py's name of it) or a TRL
    `--deepspeed` config passes through: known from the config alone, so a launch's first step can leave it out (the
    preflight, before it builds or reads a model: transformers imports deepspeed whenever it is installed)."""
    blocks = list(config.stage_overrides.values())
    if engine_name != "deepspeed" and not any(overrides.get("deepspeed") for overrides in (config.trl_overrides, *blocks)):
        return ["deepspeed"]
    return []


def bitsandbytes_checkpoint(name: str) -> bool:
    """Whether the model at `name` (a directory, or a Hub id in the local cache) was saved quantized by bitsandbytes.
    A Hub id not in the cache counts as quantized: keeping bitsandbytes costs a second, missing it fails the load."""
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError

        try:
            cached = try_to_load_from_cache(name, "config.json")
        except HFValidationError:  # not a Hub id either
            cached = None
        if not isinstance(cached, str):
            return not Path(name).expanduser().is_dir()
        path = Path(cached)
    try:
        quantization = json.loads(path.read_text(encoding="utf-8")).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return True
    return quantization.get("quant_method") == "bitsandbytes"


def skip_imports(names: list[str]) -> list[str]:
    """Mark `names` absent for this process (those not imported yet); returns the ones marked."""
    skipped = [name for name in names if name not in sys.modules]
    for name in skipped:
        sys.modules[name] = None
    return skipped


@contextlib.contextmanager
def without_torch():
    """Runs the block with torch marked absent (when it is not imported yet), then importable again.

    transformers imports torch whenever it is installed, a tokenizer's load included (its configuration classes import
    its activations, which import torch and torch._dynamo: ~3 s of CPU before anything is read). A process that needs
    a tokenizer and never a model (`python -m src.audit` without a model part) loads it here. Afterwards torch is
    importable again but not imported, and transformers keeps, for this process, that it found no torch: only for a
    process that uses no transformers model later. datasets, imported before, still hashes what it maps (it looks
    for torch among the imported modules only)."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
