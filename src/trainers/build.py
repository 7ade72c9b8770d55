"""The stage's trainer, built from its TRL config and the prepared data, with the toolkit's callbacks.

The toolkit hands TRL tokenized, file-backed datasets (src/data/), so the trainers skip their own preparation. A
vision-language model's trainer gets its processor as its processing class (saved in each checkpoint) and its
collator adds each example's images (src/vision.py ImageCollator).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.trainer_callback import PrinterCallback

from src.engines import keep_sharding_from_load, whole_numel
from src.objectives import SEQUENCES, load, objective
from src.plan import Plan
from src.reporting.live import LiveReport
from src.throughput import ThroughputMeter
from src.vision import ImageCollator
from src.trainers.callbacks import GradientCompression, HangBeats, OneJobCheck, StopConditions
from src.trainers.metrics_log import ConsoleLog, MetricsRecorder


def build_trainer(stage: str, model, tokenizer, trl_config, prepared, peft_config, metrics_path: Path,
                  plan: Plan, truncate_to: int | None = None, packed_dpo: bool = True, ref_model=None,
                  trainer_inputs: dict | None = None, packed_attention: str = "auto"):
    """The stage's trainer with the toolkit's callbacks; for DPO the packed forward unless `packed_dpo` is False
    (`--padding_free false`, src/packed_dpo_support.padding_free_requested), and `ref_model` as the reference when given
    (otherwise TRL's: the starting model); `packed_attention`: --packed_attention (src/packed_attention.py).
    `trainer_inputs`: what the row's `trainer_inputs` gives its trainer (GRPO's: the judges its reward functions are
    made of)."""
    row = objective(stage)
    trainer_class = load(row.training.trainer)
    sequences = row.data_shape == SEQUENCES
    extra = {"truncate_to": truncate_to} if sequences else {"ref_model": ref_model} if ref_model is not None else {}
    reference_forward = row.training.needs_reference and not trl_config.precompute_ref_log_probs and peft_config is None
    # A trainer with its own forward (the packed one, src/packed_dpo.py) says how it is built: `forward_for(model, ...)`.
    forward_for = getattr(trainer_class, "forward_for", None)
    forward = forward_for(model, tokenizer, trl_config, peft_config, packed_dpo, packed_attention) if forward_for else {}
    processing = prepared.processing  # a vision-language model's (src/vision.py), else None
    if processing is not None and "data_collator" in forward:  # before TRL's __init__: its reference pass collates
        forward["data_collator"] = ImageCollator(forward["data_collator"], processing, forward.get("packed_forward"))
    meter = ThroughputMeter(plan.device, sum(whole_numel(p) for p in model.parameters()), reference_forward,
                            _device_name(plan.device), sequences_per_example=row.memory.sequences_per_example)
    trainer = trainer_class(
        model=model,
        args=trl_config,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation if trl_config.eval_strategy != "no" else None,
        processing_class=processing.processor if processing is not None else tokenizer,
        peft_config=peft_config,
        # The meter adds perf/* to each record before the recorder writes it.
        callbacks=[meter, MetricsRecorder(metrics_path), ConsoleLog(row.advice.console_keys), StopConditions(), HangBeats(),
                   OneJobCheck(),
                   LiveReport(metrics_path.parent, on_pause=meter.on_pause)] + (
            [GradientCompression(plan.ddp_comm_hook)] if plan.ddp_comm_hook != "none" else []),
        **extra,
        **forward,
        **(trainer_inputs or {}),
    )
    trainer.remove_callback(PrinterCallback)
    if processing is not None and not isinstance(trainer.data_collator, ImageCollator):  # TRL's own (SFT's)
        trainer.data_collator = ImageCollator(trainer.data_collator, processing)
    keep_sharding_from_load(trainer)
    if forward and forward["packed_forward"].enabled:
        meter.computed_tokens = forward["packed_forward"].computed_tokens
    return trainer


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else ""
