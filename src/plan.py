"""What the toolkit derives from the request and the world it runs in (`resolve_plan`): per-device batch, gradient
accumulation, global batch, the learning rate scaled with the global batch, precision and backend. It is pure, computed
once, printed once (`format_plan`, with where each value came from) and written to training_info.json; nothing
recomputes it. A global batch the processes cannot share is a BatchSplitError carrying the launch command with the
nearest batch that splits.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from src.config import Config, TrainingArguments
from src.config_error import ConfigError
from src.config_parse import BLOCK_PREFIXES, stage_config
from src.engines import DDP, describe, requested, requested_source
from src.objectives import OBJECTIVES, PIPELINES, final_stage
from src.redaction import redact_secrets
from src.world import Devices, World


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
    flags = with_batch_size(arguments, error.batch_sizes[0], error.base_batch_size)
    return launch_command(flags, processes, 1, environ)


def launch_command(arguments: list[str], per_node: int, nodes: int = 1,
                   environ: Mapping[str, str] | None = None) -> str:
    """`[STRATEGY=...] [NNODES=...] ./run_distributed.sh N ARGS`: the launch of `per_node` processes on each of
    `nodes` machines (several: the command each runs, its NODE_RANK and the first one's address to fill in)."""
    environ = os.environ if environ is None else environ
    strategy = environ.get("STRATEGY", "torchrun")
    prefix = f"STRATEGY={shlex.quote(strategy)} " if strategy != "torchrun" else ""
    if nodes > 1:
        prefix += f"NNODES={nodes} NODE_RANK=<0-{nodes - 1}> MASTER_ADDR=<the first node's address> "
    elif environ.get("NNODES", "1") != "1":  # a launch of several nodes goes on with one
        prefix += "NNODES=1 "
    flags = [arg for arg in arguments if arg != "--dry_run"]
    return f"{prefix}{LAUNCHER} {per_node} {shlex.join(flags)}".rstrip()


def process_counts_that_split(config: Config, counts) -> list[int]:
    """The numbers of processes among `counts` over which every stage's batch splits (arithmetic only: each stage's
    batch settings read once)."""
    names = PIPELINES.get(config.training.stage, (config.training.stage,))
    trainings = [stage_config(config, name).training for name in names]

    def fits(count: int) -> bool:
        try:
            for training in trainings:
                resolve_batch(training, count)
        except ConfigError:
            return False
        return True

    return [count for count in counts if fits(count)]


def largest_split(config: Config, nodes: int, per_node: int) -> tuple[int, int] | None:
    """(nodes, processes per node), at most `nodes` x `per_node`, with the most processes over which every stage's
    batch splits (more nodes first on a tie: the same processes per node, as the machines have); None if none does."""
    fitting = set(process_counts_that_split(config, {count * each for count in range(1, nodes + 1)
                                                     for each in range(1, per_node + 1)}))
    found = [(count * each, count, each) for count in range(nodes, 0, -1) for each in range(per_node, 0, -1)
             if count * each in fitting]
    return max(found)[1:] if found else None


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
    engine: str = DDP  # the engine the launch asked for: ddp, or a STRATEGY (zero1-3, fsdp: src/engines.py)
    engine_from: str = ""  # where it was asked for: "STRATEGY=zero3", "accelerate launch config", or nothing (torchrun)
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
    if training.per_device_batch_size is not None:
        return _per_device_batch(training, world_size)
    if training.batch_size is None:
        raise ConfigError("no batch size: set --batch_size (global) or --per_device_batch_size")
    return _global_batch(training, world_size)


def _per_device_batch(training: TrainingArguments, world_size: int) -> tuple[str, int, int, int]:
    """Per-device mode: --per_device_batch_size x accumulation on each process, split under --micro_batch_size when
    it exceeds it and the accumulation is left to be derived."""
    per_device, accumulation = training.per_device_batch_size, training.gradient_accumulation_steps
    if training.micro_batch_size is not None and per_device > training.micro_batch_size:
        if accumulation is not None:
            raise ConfigError(
                f"--per_device_batch_size {per_device} exceeds --micro_batch_size {training.micro_batch_size}: "
                "lower it, or drop --gradient_accumulation_steps to have it derived"
            )
        per_device, accumulation = _split_under_cap(per_device, training.micro_batch_size)
    accumulation = accumulation or 1
    return "per_device", per_device, accumulation, per_device * accumulation * world_size


def _global_batch(training: TrainingArguments, world_size: int) -> tuple[str, int, int, int]:
    """Global mode: --batch_size split exactly over the processes and the accumulation steps (given, or derived under
    --micro_batch_size); a batch that does not split is a BatchSplitError proposing the nearest that does."""
    accumulation, global_batch = training.gradient_accumulation_steps, training.batch_size
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
    if accumulation is None:
        per_device, accumulation = _split_under_cap(per_process, training.micro_batch_size or per_process)
        return "global", per_device, accumulation, global_batch
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


# transformers' name of FlexAttention (--attn_implementation; what the packed forward's flex switches a model to:
# src/packed_attention.py)
FLEX_ATTENTION = "flex_attention"


def resolve_packed_attention(config: Config, stage: str, devices: Devices) -> str:
    """--packed_attention as asked, once no attention the stage trains through is FlexAttention where it cannot train.

    FlexAttention has no backward on CPU (torch 2.13: NotImplementedError at the first step, after the data was
    prepared and the model loaded), whichever flag asks for it: the model's own attention (--attn_implementation
    flex_attention, every stage trains through it), or the packed forward's (--packed_attention flex, on the stages with
    one: SFT does not read it). One line before any process starts; a CUDA launch keeps either."""
    asked = [("--attn_implementation flex_attention", "sdpa (transformers' default) or eager")
             ] if config.model.attn_implementation == FLEX_ATTENTION else []
    if config.dpo.packed_attention == "flex" and OBJECTIVES[final_stage(stage)].training.packed_forward:
        asked.append(("--packed_attention flex", "auto (the dense mask on CPU) or dense"))
    for flag, instead in asked if devices.kind != "cuda" else []:
        raise ConfigError(f"{flag} needs a CUDA GPU: FlexAttention has no backward on CPU; use {instead}")
    return config.dpo.packed_attention


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
TRL_DEFAULT_LEARNING_RATES = {name: row.training.default_learning_rate for name, row in OBJECTIVES.items()}


def default_learning_rate(stage: str) -> float:
    """TRL's default learning rate for the stage's trainer (a pipeline: its final stage)."""
    return TRL_DEFAULT_LEARNING_RATES[final_stage(stage)]


def resolve_plan(config: Config, world: World, devices: Devices, stage: str | None = None) -> Plan:
    training = config.training
    engine = requested()  # the launch's (src/engines.py): accelerate launch's environment, or STRATEGY in a preflight
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
        packed_attention=resolve_packed_attention(config, stage, devices),
        engine=engine.key if engine else DDP,
        engine_from=requested_source(),
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
             if not key.startswith(BLOCK_PREFIXES) and key != "dry_run"}  # --dry_run is what this launch does, not a setting
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
        ("engine", f"{describe(plan.engine, plan.world_size)}  {f'[{plan.engine_from}]' if plan.engine_from else ''}"
                   .rstrip()),
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
