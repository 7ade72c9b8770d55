"""The verdict, the exit status, and the exact launch command.

Exit status: 0 ready, 1 ready with warnings, 2 not ready, 3 bad input (nothing checked).

The command runs on what works now: GPUs the errors rule out are left out (named by CUDA_VISIBLE_DEVICES under
CUDA_DEVICE_ORDER=PCI_BUS_ID, so the numbers are nvidia-smi's), and the environment variables the problems call for
are set in front. Errors it cannot work around (the recipe does not fit, a driver too old) leave the command as
the one to run once they are fixed (`command_runs_now` false). When nothing can run (no usable GPU, a broken
driver, a CPU-only torch on a GPU machine) there is no command: fix the errors and run the check again.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from src.config_checks import missing_sources
from src.plan import LAUNCHER, with_batch_size

from .problems.machine import ERROR, WARNING, Machine, Problem, pinned_gpus_prefix

EXIT_READY, EXIT_WARNINGS, EXIT_NOT_READY, EXIT_BAD_INPUT = 0, 1, 2, 3
VERDICTS = {EXIT_READY: "READY", EXIT_WARNINGS: "READY WITH WARNINGS", EXIT_NOT_READY: "NOT READY"}
MULTI_NODE_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Verdict:
    verdict: str
    exit_code: int
    command: str | None
    command_runs_now: bool  # False while an error the command cannot work around (e.g. memory) remains
    command_notes: list[str] = field(default_factory=list)  # why each part of the command is there


def exit_code(problems: list[Problem]) -> int:
    severities = {problem.severity for problem in problems}
    if ERROR in severities:
        return EXIT_NOT_READY
    return EXIT_WARNINGS if WARNING in severities else EXIT_READY


def needs_fp16(machine: Machine) -> bool:
    """A recipe left at auto (or asking bf16) on a GPU without native bf16 must be told fp16."""
    return machine.options.training.mixed_precision in ("auto", "bf16") and any(
        machine.gpu(index).bf16 is False for index in machine.launch_gpus
    )


def _gpu_selection(machine: Machine) -> tuple[str | None, str | None]:
    """The CUDA_VISIBLE_DEVICES prefix when the launch GPUs are not simply the first visible ones, and why."""
    if not machine.has_gpus:
        return None, None
    first_visible = machine.launch_gpus == machine.cuda.visible[: len(machine.launch_gpus)]
    # Name the GPUs whenever one is left out for a fault: CUDA may still enumerate it (MIG instances, a sick GPU).
    if first_visible and not machine.excluded:
        return None, None
    left_out = [index for index in machine.cuda.visible if index not in machine.launch_gpus]
    reasons = ", ".join(f"GPU {index} ({machine.excluded.get(index, 'not needed')})" for index in left_out)
    return pinned_gpus_prefix(machine, machine.launch_gpus), f"CUDA_VISIBLE_DEVICES leaves out {reasons}"


def _environment(machine: Machine, problems: list[Problem]) -> tuple[list[str], list[str]]:
    assignments: dict[str, str] = {}
    notes = []
    if machine.multi_node:
        for name in MULTI_NODE_VARIABLES:
            if machine.environ.get(name):
                assignments[name] = machine.environ[name]
        notes.append("multi-node: run it on every node with its own NODE_RANK (0..NNODES-1)")
    for problem in problems:
        for name, value in problem.command_env.items():
            if assignments.get(name) != value:
                notes.append(f"{name}={value}: see [{problem.severity}] {problem.what.split(':')[0]}")
            assignments[name] = value
    return [f"{name}={shlex.quote(value)}" for name, value in assignments.items()], notes


def _arguments(machine: Machine) -> tuple[list[str], list[str]]:
    """The launcher's flags as the check was given them (old check_gpu names already translated), so the command
    round-trips: `./run_distributed.sh N ARGS` checks as `check_gpu.py --num_procs N ARGS`, and back."""
    arguments, notes = list(machine.options.launch_arguments), []
    if machine.batch_split is not None:
        split = machine.batch_split
        arguments = with_batch_size(arguments, split.batch_sizes[0], split.base_batch_size)
        notes.append(f"--batch_size {split.batch_sizes[0]}: the nearest global batch {machine.num_procs} processes "
                     "can share")
    if needs_fp16(machine):
        arguments += ["--mixed_precision", "fp16"]
        lacking = sorted({machine.gpu(index).name for index in machine.launch_gpus if machine.gpu(index).bf16 is False})
        notes.append(f"--mixed_precision fp16: {', '.join(lacking)} has no native bf16")
    config = machine.options.config
    if config is not None:
        notes += [f"{missing}: the launch needs it" for missing in missing_sources(config)]
    return [shlex.quote(argument) for argument in arguments], notes


def launch_command(machine: Machine, problems: list[Problem]) -> tuple[str | None, list[str]]:
    if machine.num_procs == 0:
        return None, []
    selection, selection_note = _gpu_selection(machine)
    environment, environment_notes = _environment(machine, problems)
    arguments, argument_notes = _arguments(machine)
    parts = environment + ([selection] if selection else []) + [LAUNCHER, str(machine.num_procs)] + arguments
    notes = ([selection_note] if selection_note else []) + environment_notes + argument_notes
    if not machine.has_gpus:
        notes.append(
            f"CPU: the toolkit picks gloo itself; each process needs at least one core ({machine.system.usable_cpus} usable)"
        )
    return " ".join(parts), notes


def decide(machine: Machine, problems: list[Problem]) -> Verdict:
    code = exit_code(problems)
    command, notes = launch_command(machine, problems)
    runs_now = all(problem.worked_around for problem in problems if problem.severity == ERROR)
    return Verdict(VERDICTS[code], code, command, command is not None and runs_now, notes)
