"""What a stage's training will do, decided from the config alone, before the training stack is imported: the model
it starts from, the optimizer steps it plans, which SFT forward runs, and the options TRL (or the toolkit) would accept
and then ignore."""

from __future__ import annotations

import math

from src.config import EMBEDDED, Config
from src.plan import Plan
from src.objectives import objective
from src.objectives.spec import PROMPTS


# TRL's padding-free SFT batch is one row: the micro-batch's sequences end to end, positions restarting at 0, no
# attention mask. Flash-attention reads the boundaries TRL passes (cu_seq_lens) and attends within each sequence at
# linear cost. sdpa and eager get a block-diagonal causal mask that transformers builds from the restarting positions
# (masking_utils.find_packed_sequence_indices) -- only when no KV cache is passed, which TRL's SFTTrainer ensures
# (use_cache=False); tests/test_sft_padding_free.py checks each sequence's hidden states against the sequence alone.
# That mask is dense, so their attention costs (micro-batch tokens)^2 instead of sequences x length^2: on the embedded
# default (16 rows of 47 tokens on average) a step took 1.4x (sdpa) and 2.1x (eager) the CPU time of the padded one
# (bench/bench_sft_forward.py), so it is not their default.
PADDING_FREE_LINEAR = ("flash_attention_2", "flash_attention_3")
PADDING_FREE_EXACT = PADDING_FREE_LINEAR + ("sdpa", "eager")


def starting_model(stage: str, config: Config, model_path: str, previous_stage: str | None) -> tuple[str, str | None]:
    """The model a stage starts from, in words (the console's `starts from` line, training_info.json's
    `starts_from`), and a warning when it is the embedded default's untrained base model and the stage's objective is
    one that follows SFT (its row's `ends_pipeline`: DPO, KTO, SimPO, GRPO): on random weights it has nothing to
    adjust, and `--stage dpo` alone on the embedded default would otherwise say so nowhere."""
    if previous_stage:
        return f"the {previous_stage} stage's final model ({model_path})", None
    if config.model.model_name_or_path != EMBEDDED:
        return model_path, None
    described = f"the untrained embedded base model (randomly initialised: {model_path})"
    if not objective(stage).ends_pipeline:
        return described, None
    return described, (f"{stage.upper()} starts from the untrained embedded base model, which has learned nothing for "
                       f"it to adjust: run --stage sft_then_{stage} (SFT first, as the embedded default does), or give "
                       "--model_name_or_path a trained model")


def _exact_padding_free(attn_implementation: str) -> bool:
    return attn_implementation in PADDING_FREE_EXACT or "flash-attn" in attn_implementation  # Hub kernels


def resolve_sft_forward(config: Config, attn_implementation: str | None) -> dict:
    """How the SFT stage batches its sequences, decided once from the flags and the loaded model's attention:
    "packed" (TRL's packing, --packing), "padding_free" (TRL's padding_free: one row per micro-batch) or "padded".
    --padding_free unset means: on where it is exact and cheap (flash-attention), off elsewhere. Where the attention
    cannot keep packed sequences apart, packing and padding-free are turned off with a warning (never silently wrong).
    Returns what training_info.json records, with `warning` set when a request was not honoured."""
    attention = attn_implementation or "sdpa"
    requested = config.trl_overrides.get("padding_free")
    strategy = config.trl_overrides.get("packing_strategy", "bfd")
    packing = config.sft.packing
    exact = _exact_padding_free(attention)
    result = {"attn_implementation": attention, "padding_free_requested": requested, "packing_requested": packing,
              "warning": None}
    if packing and strategy == "wrapped":
        # Wrapped packing cuts sequences at row ends and lets them attend across: TRL's own documented trade-off.
        return result | {"forward": "packed", "packing_strategy": strategy, "padding_free": False,
                         "reason": "--packing_strategy wrapped (sequences attend across their boundaries, by design)"}
    if (packing or requested) and not exact:
        asked = "--packing" if packing else "--padding_free"
        return result | {"forward": "padded", "padding_free": False, "reason": f"{attention} attention",
                         "warning": f"{asked} is off: {attention} attention cannot keep packed sequences apart; "
                                    "training on padded batches (use sdpa, eager or flash-attention to pack)"}
    if packing:
        return result | {"forward": "packed", "packing_strategy": strategy, "padding_free": True,
                         "reason": f"--packing ({strategy}): rows of --max_length, exact with {attention}"}
    if requested is None:
        requested = attention in PADDING_FREE_LINEAR or "flash-attn" in attention
        reason = (f"default with {attention}: exact, attention within each sequence" if requested else
                  f"default with {attention}: padding-free is exact but its dense mask over the whole micro-batch "
                  "costs more than the padding it saves (--padding_free true to use it)")
    else:
        reason = f"--padding_free {str(requested).lower()}"
    return result | {"forward": "padding_free" if requested else "padded", "padding_free": bool(requested),
                     "reason": reason}


def trained_per_epoch(train_rows: int, global_batch: int) -> int:
    """The examples an epoch trains: whole global batches only, so that every optimizer step averages the same examples
    on any split of processes x accumulation. A last partial batch would be one micro-batch mean on one process with
    accumulation (transformers steps on fewer micro-batches) and padded with the epoch's first examples on several
    (accelerate's even_batches): other numbers. Each epoch drops the end of its own shuffled order (other examples
    each epoch). Fewer examples than one global batch fill one, some of them twice (as accelerate
    pads, but drawn by the epoch's shuffle alike on every split): a round of 3 pairs at a global batch of 4."""
    if train_rows < global_batch:
        return global_batch if train_rows else 0
    return train_rows - train_rows % global_batch


def drops_partial_batch(stage: str, config: Config) -> bool:
    """Whether the stage's trainer trains whole global batches only (src/trainers/base.py): with transformers' shuffle
    (the default `train_sampling_strategy`), for every objective but the one of prompts alone, whose sampler (TRL's
    GRPO repeats each prompt for its answers) is its own."""
    shuffled = config.trl_overrides.get("train_sampling_strategy", "random") == "random"
    return shuffled and objective(stage).data_shape != PROMPTS


def examples_per_epoch(stage: str, config: Config, plan: Plan, train_rows: int) -> int:
    """What one epoch of the stage trains (training_info.json's `trained_per_epoch`, the console's `per epoch`)."""
    return trained_per_epoch(train_rows, plan.global_batch_size) if drops_partial_batch(stage, config) else train_rows


def planned_steps(train_rows: int, plan: Plan, config: Config, stage: str) -> int:
    """Optimizer steps the run will take (what max_steps or the epochs amount to)."""
    if config.training.max_steps > 0:
        return config.training.max_steps
    if drops_partial_batch(stage, config):
        per_epoch = examples_per_epoch(stage, config, plan, train_rows) // plan.global_batch_size
    else:
        per_epoch = math.ceil(train_rows / (plan.per_device_batch_size * plan.world_size)) // plan.gradient_accumulation_steps
    return max(1, math.ceil(per_epoch * config.training.num_epochs))


def silent_no_op_warnings(stage: str, config: Config, plan: Plan) -> list[str]:
    """Options TRL (or the toolkit) accepts and then ignores: say so instead of letting them do nothing."""
    warnings = []
    if config.training.ddp_comm_hook != plan.ddp_comm_hook:
        warnings.append(f"--ddp_comm_hook {config.training.ddp_comm_hook} is ignored on one process: no gradients "
                        "are all-reduced")
    if objective(stage).advice.warnings:  # the objective's own (DPO: a label_smoothing its loss type ignores)
        warnings += objective(stage).advice.warnings(config)
    return warnings
