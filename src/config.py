"""What a run is asked to do: the file a user reads and edits. One dataclass per concern; every field's help is its
documentation and becomes a `--flag`; every default is here.

    python -m src.main_distributed --config configs/<recipe>.yaml [--flag value ...]

A YAML recipe sets the same keys, flags override the recipe, and any other field of TRL's `DPOConfig` / `SFTConfig` /
`RewardConfig` (e.g. `--lr_scheduler_type cosine`) passes through to TRL untouched. Unknown keys are refused with the
closest known name. This file holds the schema and nothing else: the parser is src/config_parse.py, the checks
src/config_checks.py, the world a run runs in src/world.py, the numbers derived from both (batch split, learning
rate, precision) src/plan.py, secret redaction src/redaction.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig

from src.objectives import DEFAULT_STAGE, OBJECTIVES, PIPELINE_FIRST, PIPELINES, STAGES
from src.redaction import redact_secrets


PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = PROJECT_ROOT / "configs" / "default.yaml"
EMBEDDED = "embedded"  # model_name_or_path / dataset_name value that selects the shipped default
TRACKERS = ("tensorboard", "wandb", "trackio")  # --report_to values, each the name of the package it needs
# What a pipeline's blocks read (src/config_parse.py `block_reads`): a key of the run, not of one stage (its directory,
# watches and copies), is read from the top level only; so are the on-policy rounds' keys (they follow the run's final
# stage), read where that stage's row has on_policy_rounds. An objective's knob (DPOArguments, SFTArguments) is read by
# the rows its `read_by` names (a row field), else by the objectives whose TRL config has a field of its name.
RUN_KEY = {"run_level": True}
ROUNDS_KEY = {"run_level": True, "read_by": "on_policy_rounds"}


@dataclass
class ModelArguments(ModelConfig):
    """TRL's ModelConfig (model path, LoRA, bitsandbytes) plus what the toolkit adds."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={**RUN_KEY, "help": f"Hub id or local directory of the model to train; '{EMBEDDED}' builds the small "
                  "offline "
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
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on LoRA's input (TRL's default 0.05; here peft's own, 0): each process draws its "
                  "masks from its own random stream, so with dropout the same global batch gives other numbers on "
                  "another number of GPUs (docs/configuration.md, Dropout); it also keeps a dropped-out copy of "
                  "every adapted layer's input for the backward. DPO, KTO, SimPO, ORPO and reward turn dropout off "
                  "anyway."},
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
    train_vision_tower: bool = field(
        default=False,
        metadata={"help": "A vision-language model: train its vision tower and projector too (full fine-tuning: their "
                  "weights; LoRA: adapters on their linear layers). Off: the language model alone learns, the tower "
                  "stays as it was (docs/vision.md)."},
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
        metadata={**RUN_KEY, "help": "Results go to <results_dir>/<run_name>/. Default: the recipe's file name (with "
                  "-<stage> after it when --stage names another stage than the recipe's: `--stage dpo` alone on "
                  "the default recipe is results/default-dpo), else <stage>-<model name>."},
    )
    results_dir: str = field(default="results", metadata={**RUN_KEY, "help": "Parent directory of every run's "
            "results."})
    output_dir: str | None = field(
        default=None, metadata={"help": "Checkpoints and the final model. Default: <results_dir>/<run_name>/model."}
    )
    final_model_dir: str | None = field(
        default=None,
        metadata={**RUN_KEY, "help": "Also copy the final model (with its model card and plots; a --merge_adapter "
                  "copy in "
                  "merged/) into this directory at the end. Under SageMaker: SM_MODEL_DIR (uploaded as model.tar.gz)."},
    )
    overwrite: bool = field(
        default=False, metadata={**RUN_KEY, "help": "Replace the results of an earlier run with the same run name."}
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
    tools: str | None = field(
        default=None,
        metadata={"help": "Tools the model may call while GRPO samples and while any stage answers its held-out "
                  "prompts: module:registry, a module attribute holding a dict or list of plain Python functions (schemas "
                  "from their type hints and docstrings, or given: {'function': f, 'schema': {...}}; the prompt shows "
                  "the row's `tools` column). Each call runs in a worker process; its result is fed back in the "
                  "template's tool role and masked from the loss (docs/tools.md)."},
    )
    max_tool_turns: int = field(
        default=4, metadata={"help": "With --tools: rounds of tool calls an answer may make before it must answer."})
    tool_timeout: float = field(
        default=10.0,
        metadata={"help": "With --tools: seconds a call may run; past it the tool is killed and the model reads an "
                  "error result (counted, never a stop)."},
    )
    turn_credit: float = field(
        default=0.0,
        metadata={"help": "GRPO with --tools: the weight w of per-turn credit. Each token of an answer's turn t gets "
                  "its trajectory's advantage plus w x that turn's score (the judge's verdict's `turn_rewards`) "
                  "normalised over its prompt's group; 0 (the default): the trajectory's reward alone "
                  "(docs/tools.md)."},
    )
    audit_judge_pairs: int = field(
        default=2000,
        metadata={"help": "Training pairs (drawn with the seed) whose own chosen and rejected answers --judge scores "
                  "before training: the share it ranks the other way (swapped labels) and ties, and the inverted "
                  "pairs written to data_audit_inverted.jsonl (src/audit/judged.py). 0: off. With no judge: nothing."},
    )
    dry_run: bool = field(
        default=False,
        metadata={**RUN_KEY, "help": "Check the configuration and the data (tokenizing it into the cache), print the "
                  "plan, "
                  "and stop before loading a model or starting a process group."},
    )
    node_timeout: int = field(
        default=180,
        metadata={**RUN_KEY, "help": "With several nodes: seconds without a sign of life from another node's "
                  "processes before "
                  "this node stops with one line naming the silent node (src/run_safety/node_watch.py), instead of waiting on "
                  "a collective for the 60-minute process-group timeout. 0 turns the watch off."},
    )
    hang_timeout: int = field(
        default=600,
        metadata={**RUN_KEY, "help": "Seconds a rank may make no progress (no step, generation or judged batch, "
                  "preparation "
                  "chunk, save or evaluation batch) before every process stops with one line naming the stuck rank, "
                  "its phase and its Python stack (in <run dir>/hang/), exit 7 (src/run_safety/hang_watch.py), "
                  "instead of waiting on a collective for the 60-minute process-group timeout. At least 3x the longest "
                  "pause the run has measured so far (a first step's compile, a save): honest pauses never stop it. "
                  "Default 10 minutes: a first step's compile or a large save on a big model; 0 turns the watch off."},
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

    beta: float | None = field(
        default=None,
        metadata={"help": "Strength of the pull toward the reference model: higher stays closer (TRL's beta). Default: "
                  "the objective's own (its row's default_beta: " + ", ".join(
                      f"{row.display_name} {row.training.default_beta:g}" for row in OBJECTIVES.values()
                      if row.training.default_beta is not None) + ")."},
    )
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"read_by": "training.loss_types", "help": "TRL loss type(s): sigmoid, ipo, hinge, robust, bco_pair, "
                  "nca_pair, apo_zero, sft, ... "
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
        metadata={"read_by": "training.packed_forward", "help": "The attention of the packed, prefix-shared forward "
                  "(DPO, SimPO, ORPO, KTO; "
                  "docs/speed.md): auto (FlexAttention's block-sparse mask on a CUDA GPU where a packed row is at least "
                  "1,024 tokens wide, the dense 4D mask through sdpa/eager on shorter rows and on CPU; the choice and "
                  "its reason are printed and recorded), dense (always the 4D mask), flex (always FlexAttention: a "
                  "CUDA GPU only, it has no backward on CPU).", "choices": ["auto", "dense", "flex"]},
    )
    rounds: int = field(
        default=0,
        metadata={**ROUNDS_KEY, "help": "On-policy rounds after the DPO stage (iterative DPO, src/rounds.py): each "
                  "round the current "
                  "model answers the train prompts --round_samples times, --judge scores every answer, each prompt's "
                  "best and worst answers become a pair, and DPO trains on those pairs. 0: offline DPO only."},
    )
    round_samples: int = field(default=4, metadata={**ROUNDS_KEY, "help": "Answers sampled per prompt in a round (K, "
            "at least 2)."})
    round_prompts: int = field(
        default=0, metadata={**ROUNDS_KEY, "help": "Train prompts asked per round, drawn anew each round; 0: every "
                "train prompt."}
    )
    round_temperature: float = field(default=1.0, metadata={**ROUNDS_KEY, "help": "Sampling temperature of a round's "
            "answers."})
    round_top_p: float = field(default=1.0, metadata={**ROUNDS_KEY, "help": "Nucleus (top-p) of a round's sampling; "
            "1: off."})
    round_max_steps: int = field(
        default=-1,
        metadata={**ROUNDS_KEY, "help": "Optimizer steps per round; -1: one pass over the round's pairs (--num_epochs "
                "1)."},
    )
    round_reference: str = field(
        default="previous",
        metadata={**ROUNDS_KEY, "help": "The reference model of each round: previous (the model the round starts "
                  "from, i.e. the "
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
        metadata={**RUN_KEY, "help": "After the run, upload the final model (LoRA adapter or full weights) with its "
                  "model card "
                  "and plots to --hub_model_id, from rank 0; a --merge_adapter copy goes to <hub_model_id>-merged. "
                  "The token comes from HF_TOKEN or `hf auth login`; without one, or offline, the model stays local "
                  "and the message says how to push it later."},
    )
    hub_model_id: str | None = field(
        default=None, metadata={**RUN_KEY, "help": "Hub repository for --push_to_hub: ORG/NAME (created when missing)."}
    )
    hub_private_repo: bool | None = field(
        default=None, metadata={**RUN_KEY, "help": "Create the repository private (default: the Hub's default for its "
                "owner)."}
    )


CONCERNS = (ModelArguments, DataArguments, TrainingArguments, DPOArguments, SFTArguments, HubArguments)


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
    # The stage the recipe trains (its `stage:`, else the default stage): a run of another stage from the same recipe
    # is another run, with a directory of its own (the default run name).
    recipe_stage: str | None = None
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
