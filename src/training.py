"""TRL trainers built from the resolved plan, and the callback that records every logged metric.

The toolkit hands TRL tokenized, file-backed datasets (src/data.py), so the trainers skip their own preparation; the
batch, learning rate, precision and backend come from the plan (src/config.py) and nothing else sets them.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from src import run_files
from src.config import Config, Plan
from src.resilience import CompleteCheckpointsMixin, StopConditions


class PreparedDPOTrainer(CompleteCheckpointsMixin, DPOTrainer):
    """DPOTrainer that accepts data already tokenized by src/data.py (same ids as its own preparation), with
    complete-only checkpoints."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


class ToolkitSFTTrainer(CompleteCheckpointsMixin, SFTTrainer):
    """SFTTrainer with complete-only checkpoints (it already skips tokenizing data that has input_ids)."""


class MetricsRecorder(TrainerCallback):
    """Appends every logged event to metrics.jsonl on rank 0, as it happens, so a crashed run keeps its curves."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = Path(metrics_path)
        self.started = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "epoch": state.epoch, "time_s": round(time.monotonic() - self.started, 3)}
            record.update(logs)
            run_files.append_jsonl(self.metrics_path, record)


class ConsoleLog(TrainerCallback):
    """One compact line per logged event on rank 0 (replaces Trainer's dict printer)."""

    KEYS = ("loss", "eval_loss", "rewards/margins", "rewards/accuracies", "eval_rewards/accuracies",
            "mean_token_accuracy", "eval_mean_token_accuracy", "learning_rate", "grad_norm")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            line = f"done in {logs['train_runtime']:.1f}s, {logs.get('train_samples_per_second', 0):.1f} samples/s"
        else:
            parts = [f"{key} {logs[key]:.4g}" for key in self.KEYS if isinstance(logs.get(key), (int, float))]
            line = "  ".join(parts)
        print(f"  step {state.global_step:>5}/{state.max_steps}  {line}", flush=True)


def _eval_steps(config: Config, total_steps: int | None) -> int | None:
    if config.training.eval_steps is not None:
        return config.training.eval_steps
    return max(1, (total_steps or 1000) // 10)  # about ten evaluations per run


def build_trl_config(stage: str, config: Config, plan: Plan, output_dir: Path, has_validation: bool,
                     total_steps: int | None):
    """DPOConfig / SFTConfig from the plan; TRL pass-through fields go last and may set anything not derived."""
    training = config.training
    eval_strategy = training.eval_strategy if has_validation else "no"
    eval_steps = _eval_steps(config, total_steps)
    save_strategy = training.save_strategy
    if save_strategy == "best" and eval_strategy == "no":
        save_strategy = "steps"  # "best" needs evaluations; with no validation split, checkpoint on steps
    common = dict(
        output_dir=str(output_dir),
        run_name=training.run_name,
        seed=training.seed,
        data_seed=training.seed,
        per_device_train_batch_size=plan.per_device_batch_size,
        per_device_eval_batch_size=plan.per_device_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        learning_rate=plan.learning_rate,
        max_steps=training.max_steps,
        num_train_epochs=training.num_epochs,
        warmup_steps=training.warmup_steps,
        lr_scheduler_type=training.lr_scheduler_type,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        use_cpu=plan.device == "cpu",
        ddp_backend=plan.backend if plan.world_size > 1 else None,
        ddp_find_unused_parameters=False,
        ddp_timeout=3600,
        activation_checkpointing=training.gradient_checkpointing,
        logging_steps=training.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN belongs in the curve, not replaced by the running mean
        eval_strategy=eval_strategy,
        eval_steps=eval_steps,
        save_strategy=save_strategy,
        save_steps=training.save_steps or eval_steps,
        save_total_limit=training.save_total_limit,
        metric_for_best_model="eval_loss" if eval_strategy != "no" else None,
        greater_is_better=False if eval_strategy != "no" else None,
        report_to=[] if training.report_to == ["none"] else training.report_to,
        max_length=config.data.max_length,
        dataset_num_proc=config.data.dataset_num_proc,
        disable_tqdm=True,
        trust_remote_code=config.model.trust_remote_code,
    )
    if stage == "dpo":
        dpo = config.dpo
        specific = dict(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights,
                        label_smoothing=dpo.label_smoothing, precompute_ref_log_probs=dpo.precompute_ref_log_probs)
        config_class = DPOConfig
    else:
        sft = config.sft
        specific = dict(assistant_only_loss=sft.assistant_only_loss, completion_only_loss=sft.completion_only_loss,
                        packing=sft.packing)
        config_class = SFTConfig
    overrides = {key: value for key, value in config.trl_overrides.items()
                 if key in {item for item in config_class.__dataclass_fields__}}
    return config_class(**{**common, **specific, **overrides})


def build_trainer(stage: str, model, tokenizer, trl_config, prepared, peft_config, metrics_path: Path):
    trainer_class = PreparedDPOTrainer if stage == "dpo" else ToolkitSFTTrainer
    trainer = trainer_class(
        model=model,
        args=trl_config,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation if trl_config.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[MetricsRecorder(metrics_path), ConsoleLog(), StopConditions()],
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def planned_steps(train_rows: int, plan: Plan, config: Config) -> int:
    """Optimizer steps the run will take (what max_steps or the epochs amount to)."""
    import math

    if config.training.max_steps > 0:
        return config.training.max_steps
    per_epoch = math.ceil(train_rows / (plan.per_device_batch_size * plan.world_size)) // plan.gradient_accumulation_steps
    return max(1, math.ceil(per_epoch * config.training.num_epochs))


def silent_no_op_warnings(stage: str, config: Config) -> list[str]:
    """Options TRL accepts and then ignores: say so instead of letting them do nothing."""
    warnings = []
    if stage == "dpo":
        if config.trl_overrides.get("padding_free"):
            warnings.append("padding_free is ignored by TRL 1.16's DPOTrainer (it falls back to padding)")
        if config.dpo.label_smoothing and set(config.dpo.loss_type) <= {"sigmoid", "ipo", "hinge"}:
            warnings.append(f"label_smoothing {config.dpo.label_smoothing} has no effect with loss_type "
                            f"{config.dpo.loss_type}: it applies to robust and exo_pair")
    return warnings
