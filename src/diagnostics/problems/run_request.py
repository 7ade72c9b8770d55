"""What the user asked for against this machine: a batch the launcher refuses or cannot split, a --max_length past the
model's positions or cutting the data, a model that does not fit the GPUs' memory by any method, and the bandwidth
check's outcome.
"""

from __future__ import annotations

from src.audit.findings import TRUNCATED as TRUNCATED_SHARE
from src.diagnostics.problems.machine import ERROR, WARNING, Machine, Problem, gib


# How each method of the memory plan is asked for at launch.
HOW_TO_RUN = {"full": "the default", "lora": "--use_lora", "qlora": "--use_lora --load_in_4bit",
              "zero1": "STRATEGY=zero1 ./run_distributed.sh ..., with deepspeed installed",
              "zero2": "STRATEGY=zero2 ./run_distributed.sh ..., with deepspeed installed",
              "zero3": "STRATEGY=zero3 ./run_distributed.sh ..., with deepspeed installed",
              "fsdp": "STRATEGY=fsdp ./run_distributed.sh ..."}


def plan_refused(machine: Machine) -> list[Problem]:
    """The launcher resolves the batch for the processes it starts; one it cannot split stops the launch."""
    if machine.plan_refused is None:
        return []
    return [Problem(ERROR, "plan_refused",
                    f"the launcher would stop on {machine.num_procs} process(es) per node: {machine.plan_refused}",
                    "change what the message names (or --num_procs); the command below is the one to run then")]


def batch_does_not_split(machine: Machine) -> list[Problem]:
    """A global batch the launch's processes cannot share (32 on 3, 5, 6 or 7 GPUs): the launcher would stop; the
    command uses the nearest batch that splits."""
    error = machine.batch_split
    if error is None:
        return []
    sizes = error.batch_sizes
    return [Problem(ERROR, "batch_does_not_split",
                    f"the launcher would stop on {machine.num_procs} process(es) per node: {str(error).split(':')[0]}",
                    f"the command below uses --batch_size {sizes[0]} (the nearest that splits"
                    + (f"; or {', '.join(map(str, sizes[1:]))}" if sizes[1:] else "")
                    + f") with --base_batch_size {error.base_batch_size}, so the learning rate stays tuned for "
                    f"{error.base_batch_size}; or pick another --num_procs", worked_around=True)]


def past_context(machine: Machine) -> list[Problem]:
    """--max_length past a rotary model's context: it trains, on positions the model never saw (the launcher says the
    same at the stage's start)."""
    plan = machine.memory_plan
    context = plan.model.context_tokens if plan else None
    if context is None or plan.max_length <= context:
        return []
    return [Problem(WARNING, "past_context",
                    f"max_length {plan.max_length} is past {plan.model.name}'s context of {context} tokens "
                    f"({plan.model.context_source} in config.json): longer rows train on positions it never saw",
                    f"--max_length {context} (or less), or a model (or rope scaling) made for longer context")]


def _share(value: float) -> str:
    return f"{value:.0%}" if value >= 0.01 else f"{value:.1%}"


def _per_device(plan) -> str:
    return "GPU" if plan.device_kind == "gpu" else "process"


def _at_suggested(plan) -> str:
    """What the data audit's --max_length costs with the chosen method (else LoRA)."""
    estimate = plan.at_suggested_max_length
    fits = (f"fits, max batch {estimate.max_per_device_batch}" if estimate.fits else
            "does not fit" if estimate.runs_here else "cannot run here")
    return f"{estimate.label} needs about {gib(estimate.total_bytes)} per {_per_device(plan)} there ({fits})"


def max_length_cuts_data(machine: Machine) -> list[Problem]:
    """The data audit of the run's prepared data (src/diagnostics/data_lengths.py) says --max_length cuts the data
    audit's share (5%) or more of the training sequences (reasoning answers are long): the length that keeps 99% whole,
    and its memory."""
    plan = machine.memory_plan
    lengths = plan.data_lengths if plan else None
    if (lengths is None or lengths.packed or not lengths.truncated_share or lengths.truncated_share < TRUNCATED_SHARE
            or plan.at_suggested_max_length is None or lengths.suggested_max_length <= plan.max_length):
        return []
    reasoning = lengths.reasoning == "keep" and bool(lengths.reasoning_share)
    into = (f", into the reasoning of {_share(lengths.reasoning_cut_share)} of the answers"
            if reasoning and lengths.reasoning_cut_share else "")
    return [Problem(WARNING, "max_length_cuts_data",
                    f"max_length {plan.max_length} cuts {_share(lengths.truncated_share)} of the training sequences"
                    f"{into} ({lengths.source})",
                    f"--max_length {lengths.suggested_max_length} keeps 99% of them whole"
                    f"{', reasoning included' if reasoning else ''}: {_at_suggested(plan)}"
                    + ("; or train on the final answers alone (--reasoning drop)" if reasoning else ""))]


def memory_fit(machine: Machine) -> list[Problem]:
    plan = machine.memory_plan
    chosen = plan.chosen() if plan else None
    if chosen is None or chosen.fits:
        return []
    where = f"{gib(plan.budget_bytes)} ({plan.budget_source})"
    length = (f"{plan.sequence_tokens} tokens per sequence (the data audit's longest within max_length "
              f"{plan.max_length})" if plan.data_lengths else f"max_length {plan.max_length}")
    what = (
        f"{chosen.label} needs about {gib(chosen.total_bytes)} per {_per_device(plan)} at per-device batch "
        f"{plan.per_device_batch_size} and {length}, but {where} is available"
    )
    suggested = plan.at_suggested_max_length
    if (suggested is not None and suggested.fits and suggested.method == chosen.method
            and plan.data_lengths.suggested_max_length < plan.max_length):
        return [Problem(ERROR, "does_not_fit", what,
                        f"--max_length {plan.data_lengths.suggested_max_length} keeps 99% of the data whole "
                        f"({plan.data_lengths.source}): {_at_suggested(plan)}", gpus=list(machine.launch_gpus))]
    if chosen.max_per_device_batch >= 1:
        # The launcher's cap: it keeps the batch per optimizer step through accumulation, in either batch mode
        # (a --per_device_batch_size beside a recipe's global batch_size would be refused as two batch modes).
        fix = (
            f"add --micro_batch_size {chosen.max_per_device_batch} (or less): the launcher keeps the batch per "
            "optimizer step through gradient accumulation"
        )
    else:
        # Each with its model state per device, the number docs/configuration.md's engine table quotes
        others = [f"{estimate.label} ({gib(estimate.model_state_bytes)} of model state per {_per_device(plan)}, "
                  f"{gib(estimate.total_bytes)} in all: {HOW_TO_RUN[estimate.method]})" for estimate in plan.estimates
                  if estimate.fits and estimate.method != chosen.method]
        bigger = "use more or larger GPUs" if plan.device_kind == "gpu" else "use GPUs, a machine with more RAM, or a smaller model"
        fix = (f"use {' or '.join(others)}" if others else bigger) + (
            "" if plan.gradient_checkpointing else ", turn on gradient_checkpointing"
        ) + ", or shorten max_length"
    return [Problem(ERROR, "does_not_fit", what, fix, gpus=list(machine.launch_gpus))]


def bench_outcome(machine: Machine) -> list[Problem]:
    bench = machine.bench
    if bench is None or bench.outcome == "ok":
        return []
    first = bench.attempts[0]
    failure = {"timeout": "hung", "wrong_result": "gave a wrong sum", "failed": "failed"}[first.status]
    if bench.outcome == "ok_without_p2p":
        best = max((point.busbw_gbps for point in bench.best.points), default=0.0)
        return [
            Problem(
                WARNING,
                "p2p_broken",
                f"the all-reduce with P2P {failure}; with NCCL_P2P_DISABLE=1 it is correct ({best:.1f} GB/s bus bandwidth)",
                "keep NCCL_P2P_DISABLE=1 (the command sets it); to get P2P back boot with iommu=pt, disable PCIe ACS, "
                "or update the driver",
                gpus=list(machine.launch_gpus),
                command_env={"NCCL_P2P_DISABLE": "1"},
            )
        ]
    tried = " and again with NCCL_P2P_DISABLE=1" if len(bench.attempts) > 1 else ""
    fix = (
        "rerun with NCCL_DEBUG=INFO to see where it stops, and fix the problems above first"
        if bench.backend == "nccl"
        else "check that processes can reach each other on localhost (firewall, loopback interface)"
    )
    return [
        Problem(
            ERROR,
            "bench_failed",
            f"the {bench.backend} all-reduce across {bench.nprocs} processes {failure}{tried}: {first.error}",
            fix,
            gpus=list(machine.launch_gpus),
        )
    ]
