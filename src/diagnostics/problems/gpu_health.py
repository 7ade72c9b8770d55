"""Each GPU's health and the set the launch uses: MIG, a lost GPU, memory errors, compute mode, other processes on it,
throttling, a narrowed PCIe link; mixed models, bf16 where a GPU lacks it, more processes than GPUs.
"""

from __future__ import annotations

from src.diagnostics.memory_plan import GIB
from src.diagnostics.nvml_probe import GpuFacts
from src.diagnostics.problems.machine import (COMPUTE_MODE_EXCLUSIVE_PROCESS, COMPUTE_MODE_PROHIBITED, ERROR, WARNING,
                                              Machine, Problem, gib, gpu_name, pinned_gpus_prefix)


CLOCK_EVENT_REASONS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
HOT_GPU_CELSIUS = 85
UNSEEN_MEMORY_BYTES = GIB  # more used memory than this with no process listed: someone NVML cannot show us


def _gpu_left_out(machine: Machine, gpu: GpuFacts, code: str, what: str, fix: str) -> Problem:
    """An error on one GPU (exclusion_reason): the launch command leaves the GPU out while another is usable."""
    left_out = ("The command below leaves it out." if machine.launch_gpus else
                "No GPU is left to run on until it is fixed.")
    return Problem(ERROR, code, what, f"{fix} {left_out}", gpus=[gpu.index], worked_around=bool(machine.launch_gpus))


def mig(machine: Machine) -> list[Problem]:
    return [
        _gpu_left_out(
            machine, gpu, "mig_enabled",
            f"{gpu_name(gpu)} has MIG enabled: CUDA shows its MIG instances, not the GPU, and NCCL cannot "
            "all-reduce across MIG instances",
            f"sudo nvidia-smi -i {gpu.index} -mig 0 with no process on it (then reset it: sudo nvidia-smi -r -i "
            f"{gpu.index}, or reboot).",
        )
        for gpu in machine.visible_gpus()
        if gpu.mig_enabled and not gpu.lost
    ]


def gpu_lost(machine: Machine) -> list[Problem]:
    return [
        _gpu_left_out(machine, gpu, "gpu_lost", f"GPU {gpu.index} fell off the bus (NVML: GPU is lost)",
                      "reboot; if it recurs check power and seating (dmesg | grep -i xid: Xid 79).")
        for gpu in machine.visible_gpus()
        if gpu.lost
    ]


def memory_errors(machine: Machine) -> list[Problem]:
    problems = []
    for gpu in machine.visible_gpus():
        findings = []
        if gpu.ecc_uncorrected_volatile:
            findings.append(f"{gpu.ecc_uncorrected_volatile} uncorrected ECC error(s) since its last reset")
        if gpu.remap_pending:
            findings.append("a pending row remap (applied at the next GPU reset)")
        if gpu.remap_failed:
            findings.append("a failed row remap (its memory is degraded)")
        if not findings:
            continue
        fix = (
            "replace the GPU (RMA)"
            if gpu.remap_failed
            else f"drain it and reset it (sudo nvidia-smi -r -i {gpu.index}, no process on it) or reboot; if errors recur, RMA it"
        )
        problems.append(_gpu_left_out(
            machine, gpu, "memory_errors",
            f"{gpu_name(gpu)} has {' and '.join(findings)}: results computed on it cannot be trusted", f"{fix}."))
    return problems


def compute_mode(machine: Machine) -> list[Problem]:
    problems = []
    for gpu in machine.visible_gpus():
        if gpu.compute_mode == COMPUTE_MODE_PROHIBITED:
            reason = "its compute mode is Prohibited"
        elif gpu.compute_mode == COMPUTE_MODE_EXCLUSIVE_PROCESS and gpu.processes:
            reason = "it is in exclusive-process mode and already in use"
        else:
            continue
        problems.append(_gpu_left_out(machine, gpu, "compute_mode",
                                      f"{gpu_name(gpu)}: {reason}, so a training process cannot open it",
                                      f"sudo nvidia-smi -i {gpu.index} -c DEFAULT."))
    return problems


def other_processes(machine: Machine) -> list[Problem]:
    held = []
    gpus = []
    for index in machine.launch_gpus:
        gpu = machine.gpu(index)
        if gpu.processes:
            listed = ", ".join(
                f"PID {process.pid} {process.name or '?'}"
                + (f" {gib(process.used_bytes)}" if process.used_bytes is not None else "")
                for process in gpu.processes
            )
            held.append(f"GPU {index}: {listed}")
            gpus.append(index)
        elif (gpu.memory_used_bytes or 0) > UNSEEN_MEMORY_BYTES:
            held.append(f"GPU {index}: {gib(gpu.memory_used_bytes)} used by processes NVML does not list (another container?)")
            gpus.append(index)
    if not held:
        return []
    return [
        Problem(
            WARNING,
            "memory_held",
            "memory is held by other processes: " + "; ".join(held),
            "stop them if they are stale (nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv, "
            "then kill PID); the memory plan counts only the free memory",
            gpus=gpus,
        )
    ]


def throttling(machine: Machine) -> list[Problem]:
    problems = []
    for index in machine.launch_gpus:
        gpu = machine.gpu(index)
        reasons = [text for bit, text in CLOCK_EVENT_REASONS.items() if (gpu.clocks_event_reasons or 0) & bit]
        if gpu.temperature_c is not None and gpu.temperature_c >= HOT_GPU_CELSIUS:
            reasons.append(f"{gpu.temperature_c} °C")
        if not reasons:
            continue
        fixes = []
        if any("thermal" in reason or "°C" in reason for reason in reasons):
            fixes.append("check cooling, airflow and fans")
        if any("power brake" in reason for reason in reasons):
            fixes.append("the chassis asserted its power brake: check the power supply")
        if any("power cap" in reason for reason in reasons):
            fixes.append(
                f"it hit its power limit ({gpu.power_limit_w:.0f} W): compare with the default in nvidia-smi -q -d POWER"
                if gpu.power_limit_w
                else "it hit its power limit: see nvidia-smi -q -d POWER"
            )
        fixes.append("nvidia-smi -q -d PERFORMANCE shows the live reasons")
        problems.append(
            Problem(WARNING, "throttling", f"{gpu_name(gpu)} is throttled: {', '.join(reasons)}", "; ".join(fixes), gpus=[index])
        )
    return problems


def pcie_width(machine: Machine) -> list[Problem]:
    problems = []
    for index in machine.launch_gpus:
        gpu = machine.gpu(index)
        if gpu.pcie_width and gpu.pcie_width_max and gpu.pcie_width < gpu.pcie_width_max:
            problems.append(
                Problem(
                    WARNING,
                    "pcie_width",
                    f"{gpu_name(gpu)} PCIe link runs at x{gpu.pcie_width} of x{gpu.pcie_width_max}: "
                    "host transfers and P2P over PCIe get that fraction of the bandwidth",
                    "reseat the card, check it sits in a full-width slot and the BIOS lane (bifurcation) settings",
                    gpus=[index],
                )
            )
    return problems


def _best_model_gpus(machine: Machine) -> list[int]:
    """The launch GPUs of the most capable model: highest compute capability, then most memory."""
    best = max(
        (machine.gpu(index) for index in machine.launch_gpus),
        key=lambda gpu: (gpu.compute_capability or (0, 0), gpu.memory_total_bytes or 0),
    )
    return [index for index in machine.launch_gpus if machine.gpu(index).name == best.name]


def mixed_models(machine: Machine) -> list[Problem]:
    gpus = [machine.gpu(index) for index in machine.launch_gpus]
    models = sorted({gpu.name for gpu in gpus})
    if len(models) < 2:
        return []
    counts = ", ".join(f"{sum(gpu.name == model for gpu in gpus)}x {model}" for model in models)
    smallest = min(gpus, key=lambda gpu: gpu.memory_total_bytes or 0)
    what = (
        f"GPUs of different models ({counts}): DDP runs every step at the slowest GPU's pace and memory is sized by "
        f"the smallest ({smallest.name}, {gib(smallest.memory_total_bytes or 0)})"
    )
    without_bf16 = [gpu for gpu in gpus if gpu.bf16 is False]
    if without_bf16:
        names = ", ".join(sorted({f"{gpu.name} (compute capability {'.'.join(map(str, gpu.compute_capability))})" for gpu in without_bf16}))
        what += f"; bf16 needs compute capability 8.0 and {names} lacks it, so training uses fp16"
    best = _best_model_gpus(machine)
    fix = (
        f"use GPUs of one model; the fastest alone may beat the mix: {pinned_gpus_prefix(machine, best)} "
        f"./run_distributed.sh {len(best)}"
    )
    return [Problem(WARNING, "mixed_models", what, fix, gpus=list(machine.launch_gpus))]


def bf16_unsupported(machine: Machine) -> list[Problem]:
    if machine.options.training.mixed_precision != "bf16":
        return []
    lacking = [machine.gpu(index) for index in machine.launch_gpus if machine.gpu(index).bf16 is False]
    if not lacking:
        return []
    return [
        Problem(
            ERROR,
            "bf16_unsupported",
            f"the recipe sets mixed_precision: bf16 but {', '.join(gpu_name(gpu) for gpu in lacking)} has no native bf16",
            "set mixed_precision: fp16 in the recipe (the command below passes --mixed_precision fp16)",
            gpus=[gpu.index for gpu in lacking],
            worked_around=True,
        )
    ]


def too_many_processes(machine: Machine) -> list[Problem]:
    requested = machine.requested_procs
    if requested is None:
        return []
    if machine.has_gpus:
        usable = len([index for index in machine.cuda.visible if index not in machine.excluded])
        if requested <= usable:
            return []
        return [
            Problem(
                ERROR,
                "too_many_processes",
                f"--num_procs {requested} asks for more processes than the {usable} usable visible GPU(s)",
                f"one process per GPU: ./run_distributed.sh {usable}" if usable else "fix the GPU errors first",
                worked_around=bool(usable),
            )
        ]
    cores = machine.system.usable_cpus
    if requested <= cores:
        return []
    return [
        Problem(
            WARNING,
            "too_many_processes",
            f"--num_procs {requested} on {cores} usable CPU core(s): each process needs at least one core",
            f"use at most {cores} processes (the command below does)",
        )
    ]
