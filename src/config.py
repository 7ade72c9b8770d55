"""What a run is asked to do, and what the toolkit derives from it.

    python -m src.main_distributed --config configs/<recipe>.yaml [--flag value ...]

One dataclass per concern; every field's help is its documentation and becomes a `--flag`. A YAML recipe sets the
same keys, flags override the recipe, and any other field of TRL's `DPOConfig` / `SFTConfig` / `RewardConfig`
(e.g. `--lr_scheduler_type cosine`) passes through to TRL untouched. Unknown keys are refused with the closest known
name.

`resolve_plan` turns the request plus the world it runs in (processes, devices) into the numbers that are used:
per-device batch, gradient accumulation, global batch, the learning rate scaled with the global batch, precision and
backend. It is pure, computed once, printed once and written to `training_info.json`; nothing recomputes it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import glob
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from trl import ModelConfig

# The table of objectives (src/objectives/): --stage's choices, the sft_then_<name> pipelines, each one's row.
from src.objectives import (DEFAULT_STAGE, OBJECTIVES, PIPELINE_BLOCKS, PIPELINE_FIRST, PIPELINES, STAGES, UNPAIRED,
                             final_stage, objective)
from src.objectives import trl_config_classes, trl_config_paths
from src.objectives.trl_field_names import field_names as trl_field_names

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = PROJECT_ROOT / "configs" / "default.yaml"
EMBEDDED = "embedded"  # model_name_or_path / dataset_name value that selects the shipped default
TRACKERS = ("tensorboard", "wandb", "trackio")  # --report_to values, each the name of the package it needs


class ConfigError(ValueError):
    """A mistake in the user's configuration: reported as one line, no traceback."""


LAUNCHER = "./run_distributed.sh"


class BatchSplitError(ConfigError):
    """A global batch the processes (and fixed accumulation steps) cannot share evenly. `batch_sizes`: the nearest
    global batches that split, nearest first; `base_batch_size`: the batch the learning rate was tuned for, kept by
    the proposed command so the rate follows the new batch by --lr_scaling instead of silently changing its base."""

    def __init__(self, message: str, batch_sizes: list[int], base_batch_size: int | None):
        super().__init__(message)
        self.batch_sizes = batch_sizes
        self.base_batch_size = base_batch_size


def splitting_batch_sizes(batch: int, unit: int, fits=lambda size: True) -> list[int]:
    """The nearest global batch sizes below and above `batch` that are multiples of `unit` (and pass `fits`), nearest
    first, the smaller on a tie."""
    lower = batch - batch % unit
    below = next((size for size in range(lower, 0, -unit) if fits(size)), None)
    above = next((size for size in range(lower + unit, lower + unit * 64, unit) if fits(size)), None)
    # `unit` itself always splits (one sample per process and step): never an empty proposal
    return sorted((size for size in (below, above) if size), key=lambda size: (abs(size - batch), size)) or [unit]


def with_batch_size(arguments: list[str], batch: int, base: int | None) -> list[str]:
    """The launcher's arguments with --batch_size set to `batch` (replaced where given, else added) and, where the
    arguments do not set it, --base_batch_size `base`."""
    out, index, replaced = [], 0, False
    while index < len(arguments):
        argument = arguments[index]
        if argument == "--batch_size" and index + 1 < len(arguments):
            out += ["--batch_size", str(batch)]
            index, replaced = index + 2, True
            continue
        if argument.startswith("--batch_size="):
            out.append(f"--batch_size={batch}")
            index, replaced = index + 1, True
            continue
        out.append(argument)
        index += 1
    if not replaced:
        out += ["--batch_size", str(batch)]
    if base is not None and not any(arg == "--base_batch_size" or arg.startswith("--base_batch_size=") for arg in out):
        out += ["--base_batch_size", str(base)]
    return out


def batch_split_command(error: BatchSplitError, arguments: list[str], processes: int,
                        environ: Mapping[str, str] | None = None) -> str:
    """The launch command with the nearest batch that splits: what the launcher's preflight proposes."""
    import shlex

    environ = os.environ if environ is None else environ
    strategy = environ.get("STRATEGY", "torchrun")
    prefix = f"STRATEGY={shlex.quote(strategy)} " if strategy != "torchrun" else ""
    flags = with_batch_size([arg for arg in arguments if arg != "--dry_run"], error.batch_sizes[0],
                            error.base_batch_size)
    return f"{prefix}{LAUNCHER} {processes} {shlex.join(flags)}"


@dataclass
class ModelArguments(ModelConfig):
    """TRL's ModelConfig (model path, LoRA, bitsandbytes) plus what the toolkit adds."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": f"Hub id or local directory of the model to train; '{EMBEDDED}' builds the small offline "
                  "default model on first use (cached after)."},
    )
    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "Give a model without a chat template (a base model) one: a Jinja file (.jinja/.j2), or a "
                  "tokenizer directory or Hub id whose template, special tokens and EOS are copied (TRL's "
                  "clone_chat_template: the embeddings grow by the new tokens). Every stage tokenizes with it and "
                  "saves it with the model, so a DPO stage after SFT uses it."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models and tokenizers that ship their own Python code (runs that code: only for "
                  "sources you trust)."},
    )
    use_lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters through peft instead of all weights (same as TRL's --use_peft). "
                  "For DPO the reference model is then the base with adapters disabled: no second copy in memory."},
    )
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Module names to adapt with LoRA, or 'all-linear' (every linear layer but the output head)."},
    )
    use_bnb_nested_quant: bool = field(
        default=True,
        metadata={"help": "Double quantization of the 4-bit quantization constants (QLoRA): ~0.4 bit/param saved."},
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "Also save a copy of the final model with the LoRA adapter merged into the base weights."},
    )

    def __post_init__(self):
        self.use_peft = self.use_peft or self.use_lora
        self.use_lora = self.use_peft
        super().__post_init__()
        # TRL turns a one-name list into a string, which PEFT reads as a regular expression over the whole module name:
        # `--lora_target_modules q_proj` alone then matches nothing. A plain name stays a name (PEFT's suffix rule).
        if isinstance(self.lora_target_modules, str) and self.lora_target_modules != "all-linear" and \
                re.fullmatch(r"[\w.]+", self.lora_target_modules):
            self.lora_target_modules = [self.lora_target_modules]


# transformers 5.23's SchedulerType values, written out so that parsing a flag imports no trainer code
# (tests/test_user_mistakes.py checks them against the installed transformers).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay", "greedy")


# Data file types the toolkit reads, and the `datasets` builder for each (src/data.py loads them; the SageMaker
# channel lookup here recognises them): configuration owns the list so it depends on no other module.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv",
                      ".tsv": "tsv", ".arrow": "arrow"}  # tsv: datasets' csv builder with sep="\t", as datasets reads
# a .tsv; .arrow: Arrow IPC files as datasets writes them (its cache files, Dataset.from_file)
# The single-file compressions `datasets` undoes by a name's last suffix (datasets/filesystems/compression.py), and
# the module each needs beyond the standard library. Text formats only: Parquet compresses inside the file.
DATA_FILE_COMPRESSIONS = {".gz": None, ".gzip": None, ".bz2": None, ".xz": None, ".zst": "zstandard",
                          ".zstd": "zstandard", ".lz4": "lz4"}
TEXT_DATA_FORMATS = (".json", ".jsonl", ".ndjson", ".csv", ".tsv")


def data_file_kind(path: str | os.PathLike) -> tuple[str, str] | None:
    """(format suffix, compression suffix or "") of a data file the toolkit reads, from its name as `datasets` reads
    it: train.jsonl → (".jsonl", ""), pairs.jsonl.gz → (".jsonl", ".gz"); None for any other file."""
    name = os.path.basename(os.fspath(path)).lower()
    compression = next((suffix for suffix in DATA_FILE_COMPRESSIONS if name.endswith(suffix)), "")
    stem = name[:len(name) - len(compression)]
    form = os.path.splitext(stem)[1]
    if form not in DATA_FILE_BUILDERS or (compression and form not in TEXT_DATA_FORMATS):
        return None
    return form, compression


@dataclass
class DataArguments:
    """Where the data comes from and how its columns map onto TRL's shapes."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": f"Hub id, a `save_to_disk` directory, or a .json/.jsonl/.parquet/.csv file; '{EMBEDDED}' "
                  "uses the preference data shipped with the project."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration (subset) name."})
    dataset_split: str = field(
        default="train", metadata={"help": "Split of the source to train on when it has several."}
    )
    dataset_mixture: list[dict] | None = field(
        default=None,
        metadata={"help": "Several sources mixed into one training set (instead of --dataset_name), in a recipe: a "
                  "list of {name: Hub id, file or directory; weight: fraction of its training rows to take (0-1], "
                  "default 1; split; config; columns: {prompt: ..., chosen: ..., rejected: ..., messages: ...}}. "
                  "Each source is recognised in its own shape; validation/test are carved per source."},
    )
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the prompt (mapped to 'prompt')."})
    chosen_column: str | None = field(default=None, metadata={"help": "Column holding the preferred answer."})
    rejected_column: str | None = field(default=None, metadata={"help": "Column holding the dispreferred answer."})
    messages_column: str | None = field(default=None, metadata={"help": "SFT: column holding a chat (list of messages)."})
    completion_column: str | None = field(default=None, metadata={"help": "SFT: column holding the target completion."})
    text_column: str | None = field(default=None, metadata={"help": "SFT: column holding plain text to model."})
    meta_columns: list[str] | None = field(
        default=None,
        metadata={"help": "Columns gathered into each row's 'meta' (what a judge reads as row['meta'][name]), added to "
                  "a 'meta' the data already has: GSM8K's reference solution with --meta_columns answer. A column "
                  "that another --*_column maps (the prompt) stays where it is too."},
    )
    label_column: str | None = field(
        default=None,
        metadata={"help": "KTO: column holding each completion's thumbs up / down (mapped to 'label'): true/false, "
                  "1/0, or words like up/down, 👍/👎, good/bad, desirable/undesirable."},
    )
    kto_from_pairs: bool = field(
        default=False,
        metadata={"help": "KTO: train on preference pairs (prompt/chosen/rejected) as unpaired rows: each chosen "
                  "answer a desirable row, each rejected one an undesirable row. Off, a pair file given to --stage "
                  "kto is refused (pairs are usually better used by DPO). The embedded default converts its pairs."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System message prepended to every conversational prompt that has none."}
    )
    chat_prompts: bool = field(
        default=False,
        metadata={"help": "Prompts alone (GRPO, on-policy rounds): each text prompt becomes a chat of one user message, "
                  "so the model's chat template renders it (an instruct model on GSM8K's text questions). Off: a text "
                  "prompt is tokenized as text."},
    )
    reasoning: str = field(
        default="keep",
        metadata={"help": "What a reasoning model trains on when the answers reason first (<think>…</think> in the "
                  "content, or a reasoning_content / thinking field): keep = the reasoning and the final answer, as "
                  "the model writes them after its generation prompt; drop = the final answers alone (the model "
                  "learns to answer with an empty reasoning block where its template has one). The plan line says "
                  "which is in force.", "choices": ["keep", "drop"]},
    )
    chat_template_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={"help": "Arguments the chat template is rendered with, for training and generation alike, e.g. "
                  "'{\"enable_thinking\": false}' (Qwen3: answers without reasoning, after the empty <think></think> "
                  "its generation prompt then writes). A JSON/YAML mapping; part of the prepared data's key."},
    )
    embedded_reasoning: bool = field(
        default=False,
        metadata={"help": f"With --dataset_name {EMBEDDED}: its tasks answered with a short reasoning first "
                  "(<think>…</think>, then the answer), and with --model_name_or_path embedded a model whose chat "
                  "template behaves as DeepSeek-R1-Distill's (its generation prompt opens <think>): the reasoning "
                  "path offline (configs/embedded_reasoning.yaml)."},
    )
    val_size: float = field(
        default=0.05,
        metadata={"help": "Validation split carved from the training data when the source has none: a fraction (<1) "
                  "or a number of rows (>=1)."},
    )
    test_size: float = field(
        default=0.05,
        metadata={"help": "Test split carved from the training data when the source has none: a fraction or a count."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use at most this many training rows (after the split): quick experiments."}
    )
    max_length: int = field(
        default=1024,
        metadata={"help": "Maximum tokens of prompt + completion. Longer rows are truncated at the end; rows whose "
                  "prompt alone fills it are dropped (both counted and reported before training)."},
    )
    dataset_num_proc: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the data in parallel (datasets.map). Default: the cores this "
                  "process may run on (its CPU affinity); preparation runs once per machine, before training."},
    )


@dataclass
class TrainingArguments:
    """The run: stage, batch and learning-rate semantics, precision, schedule, checkpoints, outputs."""

    stage: str = field(
        default=DEFAULT_STAGE,
        metadata={"help": "; ".join(f"{row.name}: {row.help}" for row in OBJECTIVES.values()) + "; "
                  + ", ".join(PIPELINES) + ": SFT (then the middle objective), then the last objective, each from the "
                  "model before (`sft:` and `dpo:` in the recipe hold those stages' overrides).", "choices": list(STAGES)},
    )
    run_name: str | None = field(
        default=None,
        metadata={"help": "Results go to <results_dir>/<run_name>/. Default: the recipe's file name, else "
                  "<stage>-<model name>."},
    )
    results_dir: str = field(default="results", metadata={"help": "Parent directory of every run's results."})
    output_dir: str | None = field(
        default=None, metadata={"help": "Checkpoints and the final model. Default: <results_dir>/<run_name>/model."}
    )
    final_model_dir: str | None = field(
        default=None,
        metadata={"help": "Also copy the final model (with its model card and plots; a --merge_adapter copy in "
                  "merged/) into this directory at the end. Under SageMaker: SM_MODEL_DIR (uploaded as model.tar.gz)."},
    )
    overwrite: bool = field(
        default=False, metadata={"help": "Replace the results of an earlier run with the same run name."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for initialisation, data order, splits and sampling."})

    # Batch semantics. Either a global batch (divided across processes and accumulation steps) or a per-device batch
    # (the global batch then grows with the number of processes).
    batch_size: int | None = field(
        default=32,
        metadata={"help": "Global batch per optimizer step (sequences, or preference pairs for DPO), divided across "
                  "processes and, when --micro_batch_size caps the per-device batch, accumulation steps. Fixed "
                  "global batch = the same run on any number of GPUs. Setting --per_device_batch_size (and not "
                  "this) switches to per-device mode."},
    )
    per_device_batch_size: int | None = field(
        default=None,
        metadata={"help": "Alternative to --batch_size: fix the batch each device sees; global batch = per-device x "
                  "accumulation x processes, so it grows with the world size."},
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Largest batch one device may take at once (memory cap); with --batch_size the rest of the "
                  "global batch comes from gradient accumulation."},
    )
    gradient_accumulation_steps: int | None = field(
        default=None,
        metadata={"help": "Micro-batches per optimizer step. Default: 1, or what --micro_batch_size requires."},
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate, tuned for --base_batch_size (scaled per --lr_scaling). Default: TRL's "
                  "default for the stage (DPO 1e-6, SFT 2e-5)."},
    )
    base_batch_size: int | None = field(
        default=None,
        metadata={"help": "Global batch --learning_rate was tuned for. Default: --batch_size, or with "
                  "--per_device_batch_size the global batch of a single process."},
    )
    lr_scaling: str = field(
        default="sqrt",
        metadata={"help": "How the learning rate follows global batch / base batch: sqrt (the rule for Adam-type "
                  "optimizers), linear (Goyal et al., for SGD), or none.", "choices": ["none", "linear", "sqrt"]},
    )
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps to train; -1 trains --num_epochs epochs."})
    num_epochs: float = field(default=1.0, metadata={"help": "Epochs over the training split when --max_steps is -1."})
    warmup_steps: float = field(
        default=0.0, metadata={"help": "Learning-rate warmup: steps (>=1) or a fraction of all steps (<1)."}
    )
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Schedule after warmup (transformers' names).",
                                                               "choices": list(LR_SCHEDULERS)})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})

    mixed_precision: str = field(
        default="auto",
        metadata={"help": "auto: bf16 where every GPU supports it (compute capability >= 8.0), fp16 on older GPUs, "
                  "fp32 on CPU. Or no, fp16, bf16.", "choices": ["auto", "no", "fp16", "bf16"]},
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in the backward pass: much less activation memory, ~20-30%% "
                  "slower. Turn on for large models or long sequences."},
    )

    ddp_comm_hook: str = field(
        default="none",
        metadata={"help": "Compress gradients for DDP's all-reduce: fp16 or bf16 sends each gradient bucket as 16-bit "
                  "values, half the bytes of fp32 (torch's fp16_compress_hook / bf16_compress_hook); none sends "
                  "fp32. Worth it where the network, not compute, limits the step (several nodes, slow links). "
                  "fp16 runs on gloo (CPU) and NCCL; bf16 needs CUDA GPUs (NCCL 2.10+). Plain DDP only: refused "
                  "under DeepSpeed/FSDP, ignored on one process. The bytes sent per step are recorded.",
                  "choices": ["none", "fp16", "bf16"]},
    )

    logging_steps: int = field(default=10, metadata={"help": "Optimizer steps between logged metrics."})
    eval_strategy: str = field(
        default="steps", metadata={"help": "When to evaluate on the validation split.", "choices": ["no", "steps", "epoch"]}
    )
    eval_steps: int | None = field(
        default=None, metadata={"help": "Steps between evaluations. Default: about 10 evaluations per run."}
    )
    save_strategy: str = field(
        default="steps", metadata={"help": "When to checkpoint.", "choices": ["no", "steps", "epoch", "best"]}
    )
    save_steps: int | None = field(default=None, metadata={"help": "Steps between checkpoints. Default: --eval_steps."})
    save_total_limit: int | None = field(
        default=2, metadata={"help": "Checkpoints kept on disk (the best by eval loss is always kept as well)."}
    )
    num_samples: int = field(
        default=64,
        metadata={"help": "Held-out prompts per split (val, test) answered by the starting and the trained model "
                  "and written to the sample files; judged where a judge exists."},
    )
    judged_eval_prompts: int = field(
        default=32,
        metadata={"help": "GRPO: validation prompts answered greedily and judged by --judge at the start and at each "
                  "evaluation (--eval_steps), the judged held-out curve the reward-hacking alert reads; 0: none. "
                  "Each evaluation costs generating that many answers (docs/grpo.md)."},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Generation length cap for the sample answers."})
    judge: str = field(
        default="auto",
        metadata={"help": f"How held-out answers are judged: auto (the embedded tasks are checked by code, other data "
                  f"is not judged), none, {EMBEDDED}, or the path/Hub id of a reward model (sequence classifier) "
                  "that scores the starting model's answers against the trained model's (win rate)."},
    )
    rewards: list[str] = field(
        default_factory=list,
        metadata={"help": "GRPO's rewards: one or more judges as --judge names them (embedded, module:function, a "
                  "reward model's path or Hub id), each a reward function logged apart (rewards/<judge>/mean), summed "
                  "with --reward_weights (one per judge; default all 1). Empty: --judge. docs/grpo.md."},
    )
    audit_judge_pairs: int = field(
        default=2000,
        metadata={"help": "Training pairs (drawn with the seed) whose own chosen and rejected answers --judge scores "
                  "before training: the share it ranks the other way (swapped labels) and ties, and the inverted "
                  "pairs written to data_audit_inverted.jsonl (src/audit/judged.py). 0: off. With no judge: nothing."},
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Check the configuration and the data (tokenizing it into the cache), print the plan, "
                  "and stop before loading a model or starting a process group."},
    )
    node_timeout: int = field(
        default=180,
        metadata={"help": "With several nodes: seconds without a sign of life from another node's processes before "
                  "this node stops with one line naming the silent node (src/run_safety/node_watch.py), instead of waiting on "
                  "a collective for the 60-minute process-group timeout. 0 turns the watch off."},
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={"help": "Experiment trackers, one or several: tensorboard (event files in <run dir>/tensorboard), "
                  "wandb (offline into <run dir>/wandb when no API key is set up), trackio (a local database), or "
                  "none. Each gets the resolved plan and configuration at the start and the final numbers at the end."},
    )


@dataclass
class DPOArguments:
    """DPO's own knobs (the rest of TRL's DPOConfig passes through by name)."""

    beta: float = field(
        default=0.1,
        metadata={"help": "Strength of the pull toward the reference model: higher stays closer (TRL's beta)."},
    )
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "TRL loss type(s): sigmoid, ipo, hinge, robust, bco_pair, nca_pair, apo_zero, sft, ... "
                  "(several are combined with --loss_weights)."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "Weights when combining loss types."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Label-flip probability for robust / eps for exo_pair (no effect on sigmoid)."}
    )
    precompute_ref_log_probs: bool | None = field(
        default=None,
        metadata={"help": "Compute the reference model's log-probs once, before training, across all ranks, and "
                  "cache them on disk for later runs on the same data and reference (another beta, loss type, "
                  "learning rate or world size reuses them): no reference model in memory, no reference forward "
                  "per step. Default: on, unless TRL's sync_ref_model (TR-DPO) moves the reference."},
    )
    packed_attention: str = field(
        default="auto",
        metadata={"help": "The attention of the packed, prefix-shared forward (DPO, SimPO, ORPO, KTO; "
                  "docs/speed.md): auto (FlexAttention's block-sparse mask on a CUDA GPU where a packed row is at least "
                  "1,024 tokens wide, the dense 4D mask through sdpa/eager on shorter rows and on CPU; the choice and "
                  "its reason are printed and recorded), dense (always the 4D mask), flex (always FlexAttention: a "
                  "CUDA GPU only, it has no backward on CPU).", "choices": ["auto", "dense", "flex"]},
    )
    rounds: int = field(
        default=0,
        metadata={"help": "On-policy rounds after the DPO stage (iterative DPO, src/rounds.py): each round the current "
                  "model answers the train prompts --round_samples times, --judge scores every answer, each prompt's "
                  "best and worst answers become a pair, and DPO trains on those pairs. 0: offline DPO only."},
    )
    round_samples: int = field(default=4, metadata={"help": "Answers sampled per prompt in a round (K, at least 2)."})
    round_prompts: int = field(
        default=0, metadata={"help": "Train prompts asked per round, drawn anew each round; 0: every train prompt."}
    )
    round_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of a round's answers."})
    round_top_p: float = field(default=1.0, metadata={"help": "Nucleus (top-p) of a round's sampling; 1: off."})
    round_max_steps: int = field(
        default=-1,
        metadata={"help": "Optimizer steps per round; -1: one pass over the round's pairs (--num_epochs 1)."},
    )
    round_reference: str = field(
        default="previous",
        metadata={"help": "The reference model of each round: previous (the model the round starts from, i.e. the "
                  "previous round's result: the reference moves with the policy) or start (the model the DPO stage "
                  "started from, for every round).", "choices": ["previous", "start"]},
    )


@dataclass
class SFTArguments:
    """SFT's own knobs (the rest of TRL's SFTConfig passes through by name)."""

    assistant_only_loss: bool = field(
        default=False,
        metadata={"help": "Chat data: train only on assistant turns (needs {% generation %} in the chat template)."},
    )
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Prompt/completion data: train only on the completion (TRL's default: yes)."}
    )
    packing: bool = field(default=False, metadata={"help": "Pack several short sequences into one of --max_length."})


@dataclass
class HubArguments:
    """Publishing the final model on the Hugging Face Hub: the toolkit pushes once, after the run
    (see docs/trackers-hub-sagemaker.md)."""

    push_to_hub: bool = field(
        default=False,
        metadata={"help": "After the run, upload the final model (LoRA adapter or full weights) with its model card "
                  "and plots to --hub_model_id, from rank 0; a --merge_adapter copy goes to <hub_model_id>-merged. "
                  "The token comes from HF_TOKEN or `hf auth login`; without one, or offline, the model stays local "
                  "and the message says how to push it later."},
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Hub repository for --push_to_hub: ORG/NAME (created when missing)."}
    )
    hub_private_repo: bool | None = field(
        default=None, metadata={"help": "Create the repository private (default: the Hub's default for its owner)."}
    )


CONCERNS = (ModelArguments, DataArguments, TrainingArguments, DPOArguments, SFTArguments, HubArguments)

# Fields of TRL's configs that the toolkit derives itself: setting them directly would bypass the batch, learning-rate
# and precision resolution, so they are refused with the flag to use instead.
DERIVED_TRL_FIELDS = {
    "per_device_train_batch_size": "--batch_size (global) or --per_device_batch_size",
    "per_device_eval_batch_size": "--per_device_batch_size",
    "train_batch_size": "--batch_size",
    "num_train_epochs": "--num_epochs",
    "bf16": "--mixed_precision bf16",
    "fp16": "--mixed_precision fp16",
    "use_cpu": "nothing: the CPU is used when no GPU is visible",
    "ddp_backend": "nothing: NCCL on GPUs, gloo on CPU",
    "use_peft": "--use_lora",
    "activation_checkpointing": "--gradient_checkpointing",
    # A token given as a flag would be pickled into every checkpoint's training_args.bin and logged with the config.
    "hub_token": "the HF_TOKEN environment variable (tokens are never taken as flags or written to disk)",
    # The toolkit owns the push (one upload after the run, card included): Trainer's own push stays off.
    "hub_strategy": "nothing: --push_to_hub uploads the final model once, after the run",
    "hub_always_push": "nothing: --push_to_hub uploads the final model once, after the run",
    "hub_revision": "nothing: --push_to_hub uploads to the repository's main branch",
}
SECRET_NAME = re.compile(r"token|secret|password|passwd|api_?key|credential", re.IGNORECASE)
NOT_SECRETS = {"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token",
               "include_num_input_tokens_seen", "max_new_tokens", "eval_do_concat_batches"}


def redact_secrets(value: Any) -> Any:
    """A copy with every value under a key named like a secret (token, key, password, ...) replaced, recursively:
    what goes into training_info.json, reports and trackers."""
    if isinstance(value, dict):
        return {key: "<redacted>" if (SECRET_NAME.search(str(key)) and str(key) not in NOT_SECRETS
                                      and item not in (None, "", False)) else redact_secrets(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    return value


@dataclass
class Config:
    """Everything one run was asked for: the concerns above plus TRL pass-through fields."""

    model: ModelArguments
    data: DataArguments
    training: TrainingArguments
    dpo: DPOArguments
    sft: SFTArguments
    hub: HubArguments
    trl_overrides: dict[str, Any] = field(default_factory=dict)
    # A pipeline's earlier stages' own keys: {"sft": {...}, "dpo": {...}}, the recipe's `sft:` / `dpo:` blocks and the
    # --sft.KEY / --dpo.KEY flags (every stage but the last: PIPELINE_BLOCKS)
    stage_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    recipe: str | None = None
    # Where each value not at its src/config.py default was set: key -> the recipe file ("configs/default.yaml"; a
    # pipeline's SFT block under "sft.<key>": "configs/default.yaml (sft block)"), the flag ("--max_steps",
    # "--sft.max_steps"), or the SageMaker variable ("SageMaker SM_CHANNEL_TRAINING").
    sources: dict[str, str] = field(default_factory=dict)

    def flat(self) -> dict[str, Any]:
        """Every field as one flat dict (the shape of a recipe), secrets redacted, for training_info.json."""
        return redact_secrets(self.values())

    def values(self) -> dict[str, Any]:
        """Every field as one flat dict (the shape of a recipe)."""
        values = {}
        for part in (self.model, self.data, self.training, self.dpo, self.sft, self.hub):
            values.update(dataclasses.asdict(part))
        values.update(self.trl_overrides)
        values.update({stage: dict(overrides) for stage, overrides in self.stage_overrides.items() if overrides})
        return values

    @property
    def sft_stage_overrides(self) -> dict[str, Any]:
        """The SFT stage's own keys (the recipe's `sft:` block, --sft.KEY)."""
        return self.stage_overrides.get(PIPELINE_FIRST, {})


# --------------------------------------------------------------------------------------------------------------------
# Parsing: recipe + flags → Config
# --------------------------------------------------------------------------------------------------------------------


def _field_types(dataclass_type: type) -> dict[str, Any]:
    hints = typing.get_type_hints(dataclass_type)
    return {item.name: hints[item.name] for item in dataclasses.fields(dataclass_type) if item.init}


def toolkit_fields() -> dict[str, tuple[type, Any]]:
    """Every toolkit key → (its dataclass, its type). ModelConfig's fields count as the toolkit's."""
    return {name: (concern, kind) for concern in CONCERNS for name, kind in _field_types(concern).items()}


def trl_fields(stage: str) -> dict[str, Any]:
    """Fields (name → type) of the TRL config(s) a stage builds, which may pass through as overrides."""
    return {name: kind for config in trl_config_classes(stage) for name, kind in _field_types(config).items()}


class _LazyFields:
    """trl_fields(stage): the names from the table of TRL's field names (src/objectives/trl_field_names.py: no TRL
    import, so a key that is no field is refused in a second), the types from TRL's configs on first use."""

    def __init__(self, stage: str):
        self.stage = stage
        table = trl_field_names()
        self._names = frozenset().union(*(table[path] for path in trl_config_paths(stage)))
        self._fields: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._fields is None:
            self._fields = trl_fields(self.stage)
        return self._fields

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> Any:
        return self._load()[name]

    def names(self) -> list[str]:
        return sorted(self._names)


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _convert(value: Any, annotation: Any, key: str, where: str) -> Any:
    """Convert a YAML or command-line value to a field's annotated type, or fail naming the key."""
    is_union = get_origin(annotation) in (types.UnionType, typing.Union)
    options = [option for option in get_args(annotation) if option is not type(None)] if is_union else [annotation]
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in get_args(annotation):
        return None
    # transformers types its choices as `SchedulerType | str` (optim, the strategies): the str admits any word, which
    # TRL's config refuses only when the trainer is built, after the data was prepared. Its enum's values are the set.
    choices = [member.value for option in options if isinstance(option, type) and issubclass(option, enum.Enum)
               for member in option]
    word = ("yes" if value else "no") if isinstance(value, bool) else value  # YAML reads `no` as False (see str)
    if choices and not isinstance(value, enum.Enum) and word not in choices:
        raise ConfigError(f"{where}: '{key}' must be one of {', '.join(map(str, choices))}, got {value!r}")
    errors = []
    for option in options:
        origin = get_origin(option) or option
        try:
            if origin is bool:
                if isinstance(value, bool):
                    return value
                if str(value).lower() in ("true", "yes", "1"):
                    return True
                if str(value).lower() in ("false", "no", "0"):
                    return False
                raise ValueError
            if origin is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                return int(value)
            if origin is float:
                if isinstance(value, bool):
                    raise ValueError
                return float(value)
            if origin is str:
                if isinstance(value, (dict, list)):
                    raise ValueError
                if isinstance(value, bool):  # YAML 1.1 reads `no` / `yes` as booleans: `eval_strategy: no`
                    return "yes" if value else "no"
                return str(value)
            if origin is list:
                (item_type,) = get_args(option) or (Any,)
                items = value if isinstance(value, list) else [value]
                return [_convert(item, item_type, key, where) for item in items]
            if origin is dict:
                if isinstance(value, str):
                    value = yaml.safe_load(value)
                if not isinstance(value, dict):
                    raise ValueError
                return value
            if origin is typing.Literal:
                if value in get_args(option):
                    return value
                raise ValueError
            if option is Any or (isinstance(option, type) and isinstance(value, option)):
                return value
        except (TypeError, ValueError):
            errors.append(getattr(option, "__name__", str(option)))
    raise ConfigError(f"{where}: '{key}' must be {' or '.join(errors) or annotation}, got {value!r}")


def _split_flags(argv: list[str]) -> list[tuple[str, Any, str]]:
    """['--lr', '1e-4', '--use_lora', '--x=y'] → [(key, raw value or True, '--flag'), ...]."""
    pairs = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument '{token}': flags look like --name value")
        name = token[2:]
        if "=" in name:
            name, raw = name.split("=", 1)
            pairs.append((name, raw, token))
            index += 1
            continue
        values = []
        index += 1
        while index < len(argv) and not argv[index].startswith("--"):
            values.append(argv[index])
            index += 1
        if not values:
            pairs.append((name, True, token))  # a bare boolean flag
        else:
            pairs.append((name, values[0] if len(values) == 1 else values, token))
    return pairs


def _parse_flag_value(raw: Any) -> Any:
    """Command-line values stay strings (converted by each field's type later), except YAML lists and mappings
    written inline ("[q_proj, v_proj]", "{num_cycles: 2}")."""
    if isinstance(raw, str) and raw.strip().startswith(("[", "{")):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
    return raw


def _load_recipe(path: str) -> dict[str, Any]:
    recipe_path = Path(path)
    if not recipe_path.is_file():
        raise ConfigError(f"--config: {path} does not exist (recipes live in configs/, e.g. configs/default.yaml)")
    try:
        values = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(error, 'problem', error)})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of keys to values, got {type(values).__name__}")
    return values


class HelpRequested(Exception):
    """--help: the caller prints `format_help()` and exits 0."""


def format_help() -> str:
    """Every flag, grouped by concern, with its default and help text (the dataclass fields are the source)."""
    lines = ["usage: python -m src.main_distributed [--config RECIPE.yaml] [--flag value ...]",
             "       ./run_distributed.sh [NUM_PROCS] [--config RECIPE.yaml] [--flag value ...]", "",
             "Flags override the recipe; --sft.KEY VALUE overrides a key for the SFT stage of sft_then_<name> (and",
             "--dpo.KEY for the DPO stage of sft_then_dpo_then_grpo); any other field of TRL's DPOConfig / SFTConfig /",
             "RewardConfig / KTOConfig / GRPOConfig passes through by name.", ""]
    for concern in CONCERNS:
        lines.append(f"{concern.__name__}: {(concern.__doc__ or '').strip().splitlines()[0]}")
        for item in dataclasses.fields(concern):
            if not item.init or "help" not in item.metadata:
                continue
            default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
            choices = item.metadata.get("choices")
            shown = f"{{{','.join(choices)}}}" if choices else repr(default)
            lines.append(f"  --{item.name} {shown}")
            lines.append(f"      {item.metadata['help'].replace('%%', '%')}")
        lines.append("")
    return "\n".join(lines)


def parse_config(argv: list[str] | None = None, require_sources: bool = True, default_recipe: bool = True) -> Config:
    """Flags (and the recipe named by --config) → Config. Raises ConfigError with one readable line.

    For check_gpu.py, which plans memory from a model or from a size alone: `require_sources=False` lets the model and
    the dataset be left out (everything else is checked as for a launch); `default_recipe=False` keeps
    configs/default.yaml out when nothing names a recipe, model or data (a size stands in for the model)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        raise HelpRequested
    flags = _split_flags(argv)
    recipe_paths = [value for key, value, _ in flags if key == "config"]
    flags = [item for item in flags if item[0] != "config"]
    flag_keys = {key for key, _, _ in flags}
    if len(recipe_paths) > 1:
        raise ConfigError("--config given more than once: one recipe per run")
    sagemaker = sagemaker_defaults()
    if recipe_paths:
        recipe = str(recipe_paths[0])
    elif default_recipe and not {"model_name_or_path", "dataset_name"} & (flag_keys | set(sagemaker)):
        recipe = str(DEFAULT_RECIPE)  # no recipe, no model, no data: the embedded default
    else:
        recipe = None

    # Precedence: dataclass defaults < recipe < SageMaker's environment < flags.
    requested: dict[str, tuple[Any, str]] = {}
    sources: dict[str, str] = {}  # what the plan and training_info.json say each setting came from
    if recipe:
        label = recipe_label(recipe)
        for key, value in _load_recipe(recipe).items():
            requested[key] = (value, Path(recipe).name)
            if key in PIPELINE_BLOCKS and isinstance(value, dict):
                sources.update({f"{key}.{block_key}": f"{label} ({key} block)" for block_key in value})
            else:
                sources[key] = label
    requested.update(sagemaker)
    sources.update({key: f"SageMaker {variable}" for key, (_, variable) in sagemaker.items()})
    for key, raw, token in flags:
        block = key.partition(".")[0]
        if "." in key and block in PIPELINE_BLOCKS:  # --sft.max_steps: a key of that stage of the pipeline
            overrides = dict(requested.get(block, ({}, ""))[0] or {})
            overrides[key.partition(".")[2]] = _parse_flag_value(raw)
            requested[block] = (overrides, token)
        else:
            requested[key] = (_parse_flag_value(raw), token)
        sources[key] = f"--{key}"

    stage = requested.get("stage", (DEFAULT_STAGE, ""))[0]
    if stage not in STAGES:
        raise ConfigError(f"{requested['stage'][1]}: stage must be one of {', '.join(STAGES)}, got {stage!r}")
    for block in PIPELINE_BLOCKS:
        if block in requested and block not in PIPELINES.get(stage, ())[:-1]:
            if requested[block][1].startswith("--"):
                within = [name for name, stages in PIPELINES.items() if block in stages[:-1]]
                raise ConfigError(f"--{block}.* overrides apply only to --stage {' or '.join(within)}")
            del requested[block]  # a pipeline recipe run as another stage: the block of a stage it lacks does not apply
            sources = {key: where for key, where in sources.items() if not key.startswith(f"{block}.")}
    config = _build_config(requested, stage)
    config.recipe = recipe
    config.sources = sources
    row = objective(stage)
    if row.validate:  # what only this objective cannot take (KTO: a DPO loss type asked for by flag)
        row.validate(config)
    if row.data_shape != UNPAIRED and (config.data.kto_from_pairs or config.data.label_column):
        flag = "--kto_from_pairs" if config.data.kto_from_pairs else "--label_column"
        unpaired = [name for name in STAGES if objective(name).data_shape == UNPAIRED]
        raise ConfigError(f"{flag} applies to --stage {' or '.join(unpaired)}, not {stage}")
    if require_sources:
        for problem in missing_sources(config):
            raise ConfigError(problem)
    return config


def recipe_label(path: str | os.PathLike) -> str:
    """A recipe as the plan names it: relative to the project when it lives there (configs/default.yaml)."""
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def sagemaker_defaults(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """SageMaker's training-toolkit conventions as defaults (key → (value, the variable it came from)), so a Hugging
    Face estimator runs src/main_distributed.py unchanged. Empty outside SageMaker; flags (SageMaker passes the
    estimator's hyperparameters as `--key value`) win over them.

    SM_OUTPUT_DATA_DIR → --results_dir (uploaded as output.tar.gz); SM_MODEL_DIR → --final_model_dir (model.tar.gz);
    SM_CHANNEL_TRAINING → --dataset_name: the channel's one data file, or the directory (split files, save_to_disk).
    """
    environ = os.environ if environ is None else environ
    defaults = {}
    for variable, key in (("SM_OUTPUT_DATA_DIR", "results_dir"), ("SM_MODEL_DIR", "final_model_dir"),
                          ("SM_CHANNEL_TRAINING", "dataset_name")):
        if environ.get(variable):
            defaults[key] = (environ[variable], variable)
    channel = Path(environ.get("SM_CHANNEL_TRAINING") or "")
    if "dataset_name" in defaults and channel.is_dir():
        files = [path for path in sorted(channel.iterdir()) if path.is_file() and data_file_kind(path)]
        if len(files) == 1:
            defaults["dataset_name"] = (str(files[0]), "SM_CHANNEL_TRAINING")
    return defaults


def sagemaker_process_hint(world: World, environ: Mapping[str, str] | None = None) -> str | None:
    """SageMaker starts one process per machine unless the estimator asks for torchrun: say so when GPUs would idle."""
    environ = os.environ if environ is None else environ
    gpus = int(environ.get("SM_NUM_GPUS") or 0)
    if gpus > world.local_world_size:
        return (f"SageMaker gives this machine {gpus} GPUs (SM_NUM_GPUS) but started {world.local_world_size} "
                "process(es): pass distribution={'torch_distributed': {'enabled': True}} to the estimator to use all")
    return None


def _build_config(requested: dict[str, tuple[Any, str]], stage: str) -> Config:
    known = toolkit_fields()
    passthrough = _LazyFields(stage)  # TRL's configs import transformers and torch: only read them when needed
    values: dict[type, dict[str, Any]] = {concern: {} for concern in CONCERNS}
    trl_overrides: dict[str, Any] = {}
    stage_overrides: dict[str, dict[str, Any]] = {}
    for key, (value, where) in requested.items():
        if key in PIPELINE_BLOCKS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{key}' holds the {key.upper()} stage's overrides as a mapping, got "
                                  f"{value!r}")
            for block_key in value:
                if block_key not in known and block_key not in _LazyFields(key):
                    raise ConfigError(f"{where}: unknown key '{key}.{block_key}'{_closest(block_key, known)}")
                if block_key in ("stage", *PIPELINE_BLOCKS):
                    raise ConfigError(f"{where}: '{key}.{block_key}' cannot be overridden per stage")
            stage_overrides[key] = dict(value)
            continue
        if key in known:
            concern, kind = known[key]
            values[concern][key] = _convert(value, kind, key, where)
            choices = concern.__dataclass_fields__[key].metadata.get("choices")
            if choices and values[concern][key] not in choices:
                raise ConfigError(f"{where}: '{key}' must be one of {', '.join(choices)}, got {value!r}")
        elif key in DERIVED_TRL_FIELDS:
            raise ConfigError(f"{where}: '{key}' is derived by the toolkit; set {DERIVED_TRL_FIELDS[key]} instead")
        elif key in passthrough:
            trl_overrides[key] = _convert(value, passthrough[key], key, where)
        else:
            raise ConfigError(f"{where}: unknown key '{key}'{_closest(key, list(known) + passthrough.names())}")
    try:
        parts = {concern: concern(**values[concern]) for concern in CONCERNS}
    except ValueError as error:  # ModelConfig's own checks, e.g. 4-bit and 8-bit together
        raise ConfigError(str(error)) from None
    if "batch_size" not in requested and parts[TrainingArguments].per_device_batch_size is not None:
        parts[TrainingArguments].batch_size = None  # a per-device batch replaces the default global one
    config = Config(
        model=parts[ModelArguments],
        data=parts[DataArguments],
        training=parts[TrainingArguments],
        dpo=parts[DPOArguments],
        sft=parts[SFTArguments],
        hub=parts[HubArguments],
        trl_overrides=trl_overrides,
        stage_overrides=stage_overrides,
    )
    validate(config)
    return config


def stage_config(config: Config, stage: str) -> Config:
    """The config one stage of a pipeline runs with: for an earlier stage (the SFT stage of sft_then_<name>, the DPO
    stage of sft_then_dpo_then_grpo) its block's overrides (`sft:`, `dpo:`) apply, and a TRL field of the final
    stage's config that the stage's own has not (--undesirable_weight, --simpo_gamma, --num_generations) stays with
    the final stage."""
    pipeline = config.training.stage
    if pipeline not in PIPELINES:
        return config
    own_trl_fields = _LazyFields(stage)  # TRL's configs cost seconds to import: read only when there are overrides
    final = stage == PIPELINES[pipeline][-1]
    # The top level's loss settings (DPOArguments: beta, loss_type, ...) are the last stage's: an earlier stage's own
    # come from its block (GRPO's beta 0.04 and loss dapo are not the DPO stage's of sft_then_dpo_then_grpo)
    loss_keys = set() if final else {item.name for item in dataclasses.fields(DPOArguments)}
    requested = {key: (value, stage) for key, value in config.values().items()
                 if key not in PIPELINE_BLOCKS and key not in loss_keys}
    requested = {key: value for key, value in requested.items()
                 if key in toolkit_fields() or (key in config.trl_overrides and key in own_trl_fields)}
    sources = {key: where for key, where in config.sources.items()
               if not key.startswith(_BLOCK_PREFIXES) and key not in loss_keys}
    for key, value in config.stage_overrides.get(stage, {}).items():
        requested[key] = (value, stage)
        sources[key] = config.sources.get(f"{stage}.{key}", f"the {stage} block")
    requested["stage"] = (stage, stage)
    if "stage" in sources:
        sources["stage"] = f"{pipeline} in {sources['stage']}"
    staged = _build_config(requested, stage)
    staged.recipe = config.recipe
    staged.sources = sources
    return staged


_BLOCK_PREFIXES = tuple(f"{block}." for block in PIPELINE_BLOCKS)  # sources' keys of a pipeline stage's block
MIXTURE_KEYS = ("name", "path", "weight", "fraction", "split", "config", "columns")
MIXTURE_COLUMNS = ("prompt", "chosen", "rejected", "messages", "completion", "text")


def validate_mixture(mixture: list[dict] | None) -> None:
    """Each --dataset_mixture entry names a source and a fraction in (0, 1]; the error names the entry."""
    for number, entry in enumerate(mixture or [], start=1):
        where = f"dataset_mixture entry {number}"
        unknown = [key for key in entry if key not in MIXTURE_KEYS]
        if unknown:
            raise ConfigError(f"{where}: unknown key '{unknown[0]}'{_closest(unknown[0], MIXTURE_KEYS)}; an entry "
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
    training, data = config.training, config.data
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
    if data.max_length < 8:
        raise ConfigError(f"--max_length must be at least 8 tokens, got {data.max_length}")
    if data.embedded_reasoning and data.dataset_name not in (None, EMBEDDED):
        raise ConfigError(f"--embedded_reasoning answers the embedded tasks with reasoning: it takes --dataset_name "
                          f"{EMBEDDED}, not {data.dataset_name} (your own data's reasoning is in its answers)")
    for name in ("val_size", "test_size"):
        value = getattr(data, name)
        if value < 0 or (1 <= value and not float(value).is_integer()):
            raise ConfigError(f"--{name} is a fraction below 1 or a whole number of rows, got {value}")
    if config.dpo.beta < 0 or (config.dpo.beta == 0 and not objective(config.training.stage).beta_may_be_zero):
        raise ConfigError(f"--beta must be positive, got {config.dpo.beta}")
    validate_rounds(config)
    validate_judges(config)
    if config.model.merge_adapter and config.model.load_in_4bit:
        raise ConfigError("--merge_adapter with --load_in_4bit would merge into quantized weights and lose precision: "
                          "merge the saved adapter into the 16-bit base afterwards (peft's merge_and_unload)")
    if config.model.load_in_4bit and not config.model.use_peft:
        raise ConfigError("--load_in_4bit trains adapters on a frozen 4-bit base: add --use_lora (QLoRA)")
    # PEFT refuses these only when the trainer is built, after the data was prepared and every rank loaded the model.
    if config.model.use_peft and config.model.lora_r < 1:
        raise ConfigError(f"--lora_r is the adapters' rank, a positive whole number (e.g. 16), got "
                          f"{config.model.lora_r}")
    if config.model.use_peft and not 0 <= config.model.lora_dropout < 1:
        raise ConfigError(f"--lora_dropout is a probability in [0, 1), got {config.model.lora_dropout}")
    if config.training.run_name is not None and (
        not config.training.run_name.strip() or ".." in Path(config.training.run_name).parts
    ):
        raise ConfigError(f"--run_name must be a plain name, got {config.training.run_name!r}")
    unknown = [name for name in training.report_to if name not in ("none", *TRACKERS)]
    if unknown:
        raise ConfigError(f"--report_to {unknown[0]}: not a supported tracker; choose from none, {', '.join(TRACKERS)}")
    if "none" in training.report_to and len(training.report_to) > 1:
        raise ConfigError(f"--report_to {' '.join(training.report_to)}: 'none' cannot be combined with a tracker")
    if config.hub.push_to_hub and not config.hub.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id ORG/NAME (the Hub repository to create or update)")
    if config.hub.hub_model_id:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(config.hub.hub_model_id)
        except HFValidationError:
            raise ConfigError(f"--hub_model_id {config.hub.hub_model_id!r} is not a Hub repository id: use ORG/NAME "
                              "(letters, digits, '-', '_', '.')") from None
    if config.model.lora_r < 1:
        raise ConfigError(f"--lora_r must be a positive whole number, got {config.model.lora_r}")
    validate_mixture(config.data.dataset_mixture)


def has_judge(config: Config) -> bool:
    """Whether the run has a judge to score answers: --rewards, or a --judge that names one (auto: the embedded data)."""
    judge = config.training.judge
    return bool(config.training.rewards) or not (judge == "none" or (judge == "auto" and
                                                                     config.data.dataset_name != EMBEDDED))


def validate_judges(config: Config) -> None:
    """An objective whose rewards are the judges' scores, on data no judge knows and with none named: one line."""
    row = objective(config.training.stage)
    has_data = config.data.dataset_name or config.data.dataset_mixture  # check_gpu plans without any
    if row.rewards_from_judges and has_data and not has_judge(config):
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


# --------------------------------------------------------------------------------------------------------------------
# Resolution: request + world → the numbers that are used
# --------------------------------------------------------------------------------------------------------------------


def gpu_device_files() -> list[str]:
    """The device files a GPU driver makes on Linux (NVIDIA: /dev/nvidia*; ROCm: /dev/kfd; WSL 2: /dev/dxg), which
    torch.cuda needs to see any GPU. Elsewhere (macOS, Windows) the answer is left to torch: ["unknown"]."""
    if not sys.platform.startswith("linux"):
        return ["unknown"]
    return glob.glob("/dev/nvidia*") + [path for path in ("/dev/kfd", "/dev/dxg") if os.path.exists(path)]


@dataclass(frozen=True)
class Devices:
    """The accelerators one process can see (all processes of a job are assumed to see the same kind)."""

    kind: str  # "cuda" or "cpu"
    names: tuple[str, ...] = ()
    compute_capabilities: tuple[tuple[int, int], ...] = ()

    @classmethod
    def detect(cls) -> Devices:
        if not gpu_device_files():  # no GPU driver here: torch would say the same, after a ~2 s import
            return cls(kind="cpu")
        import torch

        if not torch.cuda.is_available():
            return cls(kind="cpu")
        count = torch.cuda.device_count()
        return cls(
            kind="cuda",
            names=tuple(torch.cuda.get_device_name(index) for index in range(count)),
            compute_capabilities=tuple(torch.cuda.get_device_capability(index) for index in range(count)),
        )


@dataclass(frozen=True)
class World:
    """The processes of the job, as torchrun (or a plain `python`) describes them."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> World:
        environ = os.environ if environ is None else environ
        world_size = int(environ.get("WORLD_SIZE", 1))
        return cls(
            world_size=world_size,
            rank=int(environ.get("RANK", 0)),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
        )

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


@dataclass(frozen=True)
class Plan:
    """The resolved values a run uses. Computed once by `resolve_plan`; everything else reads it."""

    stage: str
    world_size: int
    num_nodes: int
    backend: str
    device: str
    batch_mode: str  # "global" or "per_device"
    per_device_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    base_batch_size: int
    base_learning_rate: float
    lr_scaling: str
    lr_scale_factor: float
    learning_rate: float
    precision: str
    ddp_comm_hook: str = "none"  # gradient compression DDP uses: none on one process, where nothing is all-reduced
    packed_attention: str = "auto"  # --packed_attention as the packed forward takes it (src/packed_attention.py)
    # Where the settings came from: {key: {"value": ..., "from": ...}} for every setting not at its src/config.py
    # default (a recipe file, a --flag, a SageMaker variable) and for the settings the rows above are resolved from
    # ("src/config.py" for its default, or the built-in fallback when that default is None).
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_batch(training: TrainingArguments, world_size: int) -> tuple[str, int, int, int]:
    """(batch mode, per-device batch, accumulation steps, global batch) for `world_size` processes.

    Global mode: batch_size = per_device x accumulation x world_size exactly, so the optimizer sees the same batch on
    any number of GPUs. Per-device mode: per_device x accumulation is fixed and the global batch grows with the world.
    """
    if training.batch_size is not None and training.per_device_batch_size is not None:
        raise ConfigError(
            f"--batch_size {training.batch_size} (global) and --per_device_batch_size "
            f"{training.per_device_batch_size} both set: choose one batch mode"
        )
    accumulation = training.gradient_accumulation_steps
    if training.per_device_batch_size is not None:
        per_device = training.per_device_batch_size
        if training.micro_batch_size is not None and per_device > training.micro_batch_size:
            if accumulation is not None:
                raise ConfigError(
                    f"--per_device_batch_size {per_device} exceeds --micro_batch_size {training.micro_batch_size}: "
                    "lower it, or drop --gradient_accumulation_steps to have it derived"
                )
            per_device, accumulation = _split_under_cap(per_device, training.micro_batch_size)
        accumulation = accumulation or 1
        return "per_device", per_device, accumulation, per_device * accumulation * world_size

    if training.batch_size is None:
        raise ConfigError("no batch size: set --batch_size (global) or --per_device_batch_size")
    global_batch = training.batch_size
    base = training.base_batch_size if training.base_batch_size is not None else global_batch
    if global_batch % world_size:
        unit, cap = world_size * (accumulation or 1), training.micro_batch_size
        if accumulation and cap:
            fits = lambda size: size // unit <= cap  # noqa: E731
        elif cap:  # accumulation derived under the cap: a batch that leaves micro-batches of 1 is no proposal
            fits = lambda size: _splits_well(size // world_size, cap)  # noqa: E731
        else:
            fits = lambda size: True  # noqa: E731
        sizes = splitting_batch_sizes(global_batch, unit, fits)
        raise BatchSplitError(
            f"--batch_size {global_batch} cannot be split across {world_size} processes: use a multiple of {unit}, "
            f"the nearest {' or '.join(map(str, sizes))} (with --base_batch_size {base} to keep the learning rate tuned "
            f"for {base}), or set --per_device_batch_size instead", sizes, base)
    per_process = global_batch // world_size
    if accumulation is not None:
        if per_process % accumulation:
            unit = world_size * accumulation
            fits = (lambda size: size // unit <= training.micro_batch_size) if training.micro_batch_size else (
                lambda size: True)
            sizes = splitting_batch_sizes(global_batch, unit, fits)
            raise BatchSplitError(
                f"--batch_size {global_batch} over {world_size} processes is {per_process} per process, which "
                f"--gradient_accumulation_steps {accumulation} does not divide: use a batch size that is a multiple "
                f"of {unit}, the nearest {' or '.join(map(str, sizes))} (with --base_batch_size {base} to keep the "
                f"learning rate tuned for {base})", sizes, base)
        per_device = per_process // accumulation
        if training.micro_batch_size is not None and per_device > training.micro_batch_size:
            raise ConfigError(
                f"--batch_size {global_batch} with {accumulation} accumulation steps on {world_size} processes puts "
                f"{per_device} on each device, over --micro_batch_size {training.micro_batch_size}: raise "
                "--gradient_accumulation_steps or drop it to have it derived"
            )
        return "global", per_device, accumulation, global_batch
    per_device, accumulation = _split_under_cap(per_process, training.micro_batch_size or per_process)
    return "global", per_device, accumulation, global_batch


def _splits_well(batch: int, cap: int) -> bool:
    """Whether a per-process batch splits under the micro-batch cap into micro-batches over half the cap (11 under 8
    would be 11 steps of 1; 10 is 2 of 5)."""
    micro, _ = _split_under_cap(batch, cap)
    return micro == batch or micro * 2 > cap


def _split_under_cap(batch: int, cap: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) with micro-batch <= cap and micro-batch x steps == batch exactly: the
    fewest steps that split it evenly (12 under a cap of 5: 3 x 4, since 2 x 6 breaks the cap)."""
    accumulation = math.ceil(batch / cap)
    while batch % accumulation:
        accumulation += 1
    return batch // accumulation, accumulation


def scale_learning_rate(base_learning_rate: float, global_batch: int, base_batch: int, rule: str) -> tuple[float, float]:
    """(scaled learning rate, factor) for a global batch, given the batch the base rate was tuned for."""
    ratio = global_batch / base_batch
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]
    return base_learning_rate * factor, factor


def resolve_precision(requested: str, devices: Devices) -> str:
    """bf16 only where every GPU has compute capability >= 8.0 (T4/V100 emulate it slowly), fp16 on older GPUs."""
    if devices.kind == "cpu":
        if requested == "fp16":
            raise ConfigError("--mixed_precision fp16 needs a GPU; on CPU use no (fp32) or bf16")
        return "bf16" if requested == "bf16" else "fp32"
    all_bf16 = all(capability >= (8, 0) for capability in devices.compute_capabilities)
    if requested == "auto":
        return "bf16" if all_bf16 else "fp16"
    if requested == "bf16" and not all_bf16:
        older = sorted({name for name, cc in zip(devices.names, devices.compute_capabilities) if cc < (8, 0)})
        raise ConfigError(
            f"--mixed_precision bf16 needs compute capability 8.0+ on every GPU ({', '.join(older)} has less): "
            "use fp16 or auto"
        )
    return {"no": "fp32"}.get(requested, requested)


def resolve_packed_attention(requested: str, devices: Devices) -> str:
    """--packed_attention as asked; FlexAttention forced where it cannot train (no backward on CPU) is refused."""
    if requested == "flex" and devices.kind != "cuda":
        raise ConfigError("--packed_attention flex needs a CUDA GPU: FlexAttention has no backward on CPU; use auto "
                          "(the dense mask on CPU) or dense")
    return requested


def resolve_ddp_comm_hook(requested: str, world_size: int, devices: Devices) -> str:
    """The DDP communication hook to register: none on one process (no gradients are all-reduced)."""
    if requested == "bf16" and devices.kind != "cuda":
        raise ConfigError("--ddp_comm_hook bf16 needs CUDA GPUs (torch's DDP allows its bf16 hook only with NCCL "
                          "2.10+); on CPU (gloo) use fp16")
    return requested if world_size > 1 else "none"


# TRL 1.16's default learning rate per stage (each objective's row: src/objectives/). Kept in the table rather than read from
# the classes because importing one of them imports transformers' trainer stack: measured on the 2-core development
# machine, `trl.trainer.dpo_config` + `dataclasses.fields` took 4.5-4.9 s (3 runs) against 0.2 s for the whole
# `src.config` import, and the preflight (and check_gpu.py) needs the class for nothing else.
# tests/test_config.py compares this table with the installed TRL's classes, so a TRL upgrade that moves a default
# fails that test instead of silently changing the plan.
TRL_DEFAULT_LEARNING_RATES = {name: row.default_learning_rate for name, row in OBJECTIVES.items()}


def default_learning_rate(stage: str) -> float:
    """TRL's default learning rate for the stage's trainer (a pipeline: its final stage)."""
    return TRL_DEFAULT_LEARNING_RATES[final_stage(stage)]


def resolve_plan(config: Config, world: World, devices: Devices, stage: str | None = None) -> Plan:
    training = config.training
    stage = stage or training.stage
    batch_mode, per_device, accumulation, global_batch = resolve_batch(training, world.world_size)
    if training.base_batch_size is not None:
        base_batch = training.base_batch_size
    elif batch_mode == "global":
        base_batch = global_batch
    else:
        base_batch = per_device * accumulation  # the global batch of one process: the rate follows the world size
    base_learning_rate = training.learning_rate or default_learning_rate(stage)
    learning_rate, factor = scale_learning_rate(base_learning_rate, global_batch, base_batch, training.lr_scaling)
    fallbacks = {"learning_rate": f"TRL's {stage} default"}  # where a None default resolves to
    return Plan(
        stage=stage,
        world_size=world.world_size,
        num_nodes=world.num_nodes,
        backend="nccl" if devices.kind == "cuda" else "gloo",
        device=devices.kind,
        batch_mode=batch_mode,
        per_device_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        global_batch_size=global_batch,
        base_batch_size=base_batch,
        base_learning_rate=base_learning_rate,
        lr_scaling=training.lr_scaling,
        lr_scale_factor=factor,
        learning_rate=learning_rate,
        precision=resolve_precision(training.mixed_precision, devices),
        ddp_comm_hook=resolve_ddp_comm_hook(training.ddp_comm_hook, world.world_size, devices),
        packed_attention=resolve_packed_attention(config.dpo.packed_attention, devices),
        sources=value_sources(config, PLAN_ROW_KEYS, fallbacks),
    )


def stage_plans(config: Config, world: World, devices: Devices) -> list[tuple[str, Config, Plan]]:
    """(stage name, the stage's config, its plan) for every stage the run trains, in order: sft_then_dpo is an SFT
    stage (with the recipe's `sft:` overrides) and then DPO. The launcher and check_gpu.py both plan through this."""
    names = list(PIPELINES.get(config.training.stage, (config.training.stage,)))
    plans = []
    for name in names:
        staged = stage_config(config, name)
        plans.append((name, staged, resolve_plan(staged, world, devices, name)))
    return plans


# The settings each row of the printed plan is resolved from (a None value is left out of the row's note).
PLAN_ROW_KEYS = {
    "stage": ("stage",),
    "batch": ("batch_size", "per_device_batch_size", "micro_batch_size", "gradient_accumulation_steps"),
    "learning rate": ("learning_rate", "base_batch_size", "lr_scaling"),
    "precision": ("mixed_precision",),
}


def value_sources(config: Config, row_keys: Mapping[str, tuple[str, ...]], fallbacks: Mapping[str, str]
                  ) -> dict[str, dict[str, Any]]:
    """{key: {"value", "from"}} for every setting a recipe, flag or SageMaker variable set, and for the plan rows'
    settings, which otherwise come from src/config.py's default (or, where that is None, `fallbacks`)."""
    values = redact_secrets(config.values())
    found = {key: {"value": values.get(key), "from": where} for key, where in config.sources.items()
             if not key.startswith(_BLOCK_PREFIXES) and key != "dry_run"}  # --dry_run is what this launch does, not a setting
    for key in (key for keys in row_keys.values() for key in keys):
        if key in found:
            continue
        if values.get(key) is not None:
            found[key] = {"value": values[key], "from": "src/config.py"}
        elif key in fallbacks:
            found[key] = {"value": None, "from": fallbacks[key]}
    return found


def format_plan(plan: Plan) -> str:
    """The small table printed once on rank 0."""
    rule = f"x{plan.lr_scale_factor:.3g} ({plan.lr_scaling}, global {plan.global_batch_size} / base {plan.base_batch_size})"
    rows = [
        ("stage", plan.stage),
        ("processes", f"{plan.world_size} on {plan.num_nodes} node(s), {plan.device}, backend {plan.backend}"),
        ("batch", f"{plan.per_device_batch_size} per device x {plan.gradient_accumulation_steps} accumulation x "
                  f"{plan.world_size} processes = {plan.global_batch_size} global ({plan.batch_mode} mode)"),
        ("learning rate", f"{plan.learning_rate:.3g} = {plan.base_learning_rate:.3g} {rule}"),
        ("precision", plan.precision),
    ]
    if plan.ddp_comm_hook != "none":
        rows.append(("gradients", f"all-reduced in {plan.ddp_comm_hook} (--ddp_comm_hook: half the bytes of fp32)"))
    rows = [(name, f"{value}  {_row_sources(plan, name)}".rstrip()) for name, value in rows]
    rows += _other_sources(plan)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _shown(value: Any) -> str:
    return "+".join(map(str, value)) if isinstance(value, list) else str(value)


def _row_sources(plan: Plan, row: str) -> str:
    """'[batch_size 32 from src/config.py]': where a row's settings came from, so the user knows where to change it."""
    notes = []
    for key in PLAN_ROW_KEYS.get(row, ()):
        entry = plan.sources.get(key)
        if entry is None:
            continue
        value = "" if entry["value"] is None else f" {_shown(entry['value'])}"
        notes.append(f"{key}{value} from {entry['from']}")
    return f"[{'; '.join(notes)}]" if notes else ""


def _other_sources(plan: Plan, width: int = 100) -> list[tuple[str, str]]:
    """The other settings not at their src/config.py default, grouped by where they were set, wrapped."""
    shown_in_rows = {key for keys in PLAN_ROW_KEYS.values() for key in keys}
    groups: dict[str, list[str]] = {}
    for key, entry in plan.sources.items():
        if key not in shown_in_rows:
            if entry["from"].startswith("--"):  # the flag as given: --sft.max_steps 50
                groups.setdefault("flags", []).append(f"{entry['from']} {_shown(entry['value'])}")
            else:
                groups.setdefault(entry["from"], []).append(f"{key}={_shown(entry['value'])}")
    rows = []
    for where, items in groups.items():
        line = f"{where}:"
        for item in items:
            if len(line) + len(item) + 1 > width:
                rows.append(("set by" if not rows else "", line))
                line = "   "
            line += f" {item}"
        rows.append(("set by" if not rows else "", line))
    return rows
