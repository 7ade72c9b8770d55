"""DPOConfig / SFTConfig / RewardConfig / KTOConfig from the resolved plan (src/config.py): the batch, learning rate, precision
and backend come from the plan and nothing else sets them; TRL pass-through fields go last."""

from __future__ import annotations

from pathlib import Path

from trl import DPOConfig, KTOConfig, RewardConfig, SFTConfig

from src.config import Config, Plan, kto_loss_type

# TrainingArguments fields the toolkit passes to TRL's config unchanged, under the same name.
SAME_NAME_FIELDS = ("run_name", "seed", "max_steps", "warmup_steps", "lr_scheduler_type", "weight_decay",
                    "max_grad_norm", "logging_steps", "save_total_limit")


def _eval_steps(config: Config, total_steps: int | None) -> int | None:
    if config.training.eval_steps is not None:
        return config.training.eval_steps
    return max(1, (total_steps or 1000) // 10)  # about ten evaluations per run


def build_trl_config(stage: str, config: Config, plan: Plan, output_dir: Path, has_validation: bool,
                     total_steps: int | None, sft_forward: dict | None = None, kto_weights: dict | None = None):
    """DPOConfig / SFTConfig / RewardConfig from the plan; TRL pass-through fields go last and may set anything not
    derived. For SFT, `sft_forward` (resolve_sft_forward) decides packing and padding-free, whatever was passed; for KTO,
    `kto_weights` (src/kto_weights.py: desirable_weight / undesirable_weight, from the flags or the data)."""
    training = config.training
    eval_strategy = training.eval_strategy if has_validation else "no"
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
        use_cpu=plan.device == "cpu",
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
        metric_for_best_model="eval_loss" if eval_strategy != "no" else None,
        greater_is_better=False if eval_strategy != "no" else None,
        report_to=[] if training.report_to == ["none"] else training.report_to,
        max_length=config.data.max_length,
        dataset_num_proc=config.data.dataset_num_proc,
        disable_tqdm=True,
        trust_remote_code=config.model.trust_remote_code,
    )
    precompute = config.dpo.precompute_ref_log_probs
    if precompute is None:
        precompute = not config.trl_overrides.get("sync_ref_model", False)
    if stage == "kto":
        # The rows' KL completions are fixed in the data (src/data.py), so KTO samples like the other stages (TRL's
        # KTOConfig defaults to sequential for its in-batch pairing: src/trainers/kto.py).
        specific = dict(beta=config.dpo.beta, loss_type=kto_loss_type(config), precompute_ref_log_probs=precompute,
                        train_sampling_strategy="random", **(kto_weights or {}))
        config_class = KTOConfig
    elif stage == "dpo":
        dpo = config.dpo
        specific = dict(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights,
                        label_smoothing=dpo.label_smoothing, precompute_ref_log_probs=precompute)
        config_class = DPOConfig
    elif stage == "reward":
        specific = {}
        config_class = RewardConfig
    else:
        sft = config.sft
        specific = dict(assistant_only_loss=sft.assistant_only_loss, completion_only_loss=sft.completion_only_loss,
                        packing=sft.packing)
        config_class = SFTConfig
    overrides = {key: value for key, value in config.trl_overrides.items()
                 if key in {item for item in config_class.__dataclass_fields__}}
    if stage == "sft" and sft_forward is not None:
        overrides |= {"packing": sft_forward["forward"] == "packed", "padding_free": sft_forward["padding_free"]}
        if sft_forward["forward"] == "padding_free":
            overrides["max_length"] = None  # TRL's rule without packing: the trainer truncates (ToolkitSFTTrainer)
    if stage == "kto":
        overrides = {key: value for key, value in overrides.items() if key not in (kto_weights or {})}
    if stage == "dpo":  # TRL 1.16's DPOTrainer ignores padding_free (it pads): build_trainer's packed_dpo answers to it
        overrides.pop("padding_free", None)
    return config_class(**{**common, **specific, **overrides})
