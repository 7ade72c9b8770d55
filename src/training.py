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
from src.throughput import ThroughputMeter


class ToolkitTrainerMixin(CompleteCheckpointsMixin):
    """What every toolkit trainer adds to TRL's: complete-only checkpoints, and each micro-batch shown to the
    callbacks that watch it (the non-finite guard sees the loss, the throughput meter the tokens)."""

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, StopConditions):
                callback.observe_loss(loss)
            elif isinstance(callback, ThroughputMeter):
                callback.count(inputs)
        return loss


class PreparedDPOTrainer(ToolkitTrainerMixin, DPOTrainer):
    """DPOTrainer that accepts data already tokenized by src/data.py (same ids as its own preparation).

    Reference log-probs: TRL precomputes them across all ranks and caches them next to the dataset, keyed by the
    dataset's fingerprint and a hash of the reference weights. Our datasets are file-backed and keyed by source,
    tokenizer and lengths (src/data.py), so that cache persists across runs; the key is widened here with what else
    changes the numbers, and the outcome (reused or computed, how long) is recorded."""

    reference_cache: dict | None = None

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.args.train_sampling_strategy == "group_by_length" and "length" not in self._signature_columns:
            self._signature_columns.append("length")  # what transformers' LengthGroupedSampler reads

    def _precompute_ref_logps(self, dataset, name, batch_size):
        from datasets.fingerprint import Hasher

        # Autocast precision, device kind, LD-DPO weighting and truncation change the log-probs, not the weights.
        how = (self.args.bf16, self.args.fp16, self.accelerator.device.type, self.ld_alpha, self.args.max_length,
               self.args.truncation_mode)
        original = dataset._fingerprint
        cache_dir = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
        before = set(cache_dir.glob("cache-*.arrow")) if cache_dir else set()
        started = time.monotonic()
        dataset._fingerprint = Hasher.hash((original, how))
        try:
            result = super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            dataset._fingerprint = original
        created = sorted(set(cache_dir.glob("cache-*.arrow")) - before) if cache_dir else []
        self.reference_cache = (self.reference_cache or {}) | {name: {
            "cache": "computed" if created else "reused",
            "seconds": round(time.monotonic() - started, 2),
            "rows": len(dataset),
            "file": str(created[0]) if created else None,
        }}
        return result


class ToolkitSFTTrainer(ToolkitTrainerMixin, SFTTrainer):
    """SFTTrainer with the toolkit's additions (it already skips tokenizing data that has input_ids)."""


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
            "mean_token_accuracy", "eval_mean_token_accuracy", "learning_rate", "grad_norm", "perf/tokens_per_second")

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
        precompute = dpo.precompute_ref_log_probs
        if precompute is None:
            precompute = not config.trl_overrides.get("sync_ref_model", False)
        specific = dict(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights,
                        label_smoothing=dpo.label_smoothing, precompute_ref_log_probs=precompute)
        config_class = DPOConfig
    else:
        sft = config.sft
        specific = dict(assistant_only_loss=sft.assistant_only_loss, completion_only_loss=sft.completion_only_loss,
                        packing=sft.packing)
        config_class = SFTConfig
    overrides = {key: value for key, value in config.trl_overrides.items()
                 if key in {item for item in config_class.__dataclass_fields__}}
    return config_class(**{**common, **specific, **overrides})


def build_trainer(stage: str, model, tokenizer, trl_config, prepared, peft_config, metrics_path: Path,
                  plan: Plan):
    trainer_class = PreparedDPOTrainer if stage == "dpo" else ToolkitSFTTrainer
    reference_forward = stage == "dpo" and not trl_config.precompute_ref_log_probs and peft_config is None
    meter = ThroughputMeter(plan.device, sum(p.numel() for p in model.parameters()), reference_forward,
                            _device_name(plan.device), sequences_per_example=2 if stage == "dpo" else 1)
    trainer = trainer_class(
        model=model,
        args=trl_config,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation if trl_config.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        # The meter adds perf/* to each record before the recorder writes it.
        callbacks=[meter, MetricsRecorder(metrics_path), ConsoleLog(), StopConditions()],
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else ""


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
