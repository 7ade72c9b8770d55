"""The stage's TRL config (its objective's row names the class: src/objectives/) from the resolved plan
(src/config.py): the batch, learning rate, precision and backend come from the plan and nothing else sets them; the
objective's own fields (its row's trl_settings) next; TRL pass-through fields go last."""

from __future__ import annotations

from pathlib import Path

from src.config import Config
from src.engines import accelerate_cpu, size_buffers_by_model, trainer_accelerator_config
from src.plan import Plan
from src.objectives import load, objective
from src.objectives.spec import JUDGED_CURVE

# TrainingArguments fields the toolkit passes to TRL's config unchanged, under the same name.
SAME_NAME_FIELDS = ("run_name", "seed", "max_steps", "warmup_steps", "lr_scheduler_type", "weight_decay",
                    "max_grad_norm", "logging_steps", "save_total_limit")


def _eval_steps(config: Config, total_steps: int | None) -> int | None:
    if config.training.eval_steps is not None:
        return config.training.eval_steps
    return max(1, (total_steps or 1000) // 10)  # about ten evaluations per run


def build_trl_config(stage: str, config: Config, plan: Plan, output_dir: Path, has_validation: bool,
                     total_steps: int | None, sft_forward: dict | None = None, data_settings: dict | None = None):
    """The stage's TRL config from the plan; TRL pass-through fields go last and may set anything not derived. For
    SFT, `sft_forward` (resolve_sft_forward) decides packing and padding-free, whatever was passed; `data_settings`:
    what the objective's row resolved from the data (KTO: its weights, src/kto_weights.py)."""
    training = config.training
    eval_strategy = training.eval_strategy if has_validation else "no"
    judged = objective(stage).training.judged_eval  # evaluated by judging held-out answers (src/trainers/judged_eval.py)
    eval_steps = _eval_steps(config, total_steps)
    save_strategy = training.save_strategy
    if save_strategy == "best" and eval_strategy == "no":
        save_strategy = "steps"  # "best" needs evaluations; with no validation split, checkpoint on steps
    common = dict(
        **{name: getattr(training, name) for name in SAME_NAME_FIELDS},
        output_dir=str(output_dir),
        data_seed=training.seed,
        per_device_train_batch_size=plan.per_device_batch_size,
        per_device_eval_batch_size=plan.per_device_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        learning_rate=plan.learning_rate,
        num_train_epochs=training.num_epochs,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        use_cpu=accelerate_cpu(plan.device),  # not under DeepSpeed, which accelerate would then quietly drop
        accelerator_config=trainer_accelerator_config(plan.device, plan.world_size),  # FSDP on CPU: src/engines.py
        dataloader_pin_memory=plan.device != "cpu",
        ddp_backend=plan.backend if plan.world_size > 1 else None,
        ddp_find_unused_parameters=False,
        ddp_timeout=3600,
        activation_checkpointing=training.gradient_checkpointing,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN belongs in the curve, not replaced by the running mean
        eval_strategy=eval_strategy,
        eval_steps=eval_steps,
        save_strategy=save_strategy,
        save_steps=training.save_steps or eval_steps,
        metric_for_best_model=(JUDGED_CURVE if judged else "eval_loss") if eval_strategy != "no" else None,
        greater_is_better=judged if eval_strategy != "no" else None,
        eval_on_start=judged and eval_strategy != "no",  # the judged curve's first point: the starting model
        report_to=[] if training.report_to == ["none"] else training.report_to,
        max_length=config.data.max_length,
        dataset_num_proc=config.data.dataset_num_proc,
        disable_tqdm=True,
        trust_remote_code=config.model.trust_remote_code,
    )
    precompute = config.dpo.precompute_ref_log_probs
    if precompute is None:
        precompute = not config.trl_overrides.get("sync_ref_model", False)
    row = objective(stage)
    config_class = load(row.training.trl_config)
    overrides = {key: value for key, value in config.trl_overrides.items()
                 if key in {item for item in config_class.__dataclass_fields__}}
    extras = {"precompute": precompute, "sft_forward": sft_forward, **(data_settings or {})}
    specific, overrides = row.training.trl_settings(config, overrides, extras)
    # A field TRL's config for this objective does not have (GRPOConfig: max_length, dataset_num_proc) is not passed
    common = {key: value for key, value in common.items() if key in config_class.__dataclass_fields__}
    trl_config = config_class(**{**common, **specific, **overrides})
    size_buffers_by_model(trl_config)  # DeepSpeed only: its buffers by the model's size, not its 2 GB defaults
    return trl_config
