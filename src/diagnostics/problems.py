"""The problems check_gpu.py detects, one rule per problem, each with its fix.

A rule reads the `Machine` (every fact gathered, plus what was derived from them) and returns zero or more
`Problem`s. "error" means the launch as things stand would fail or give wrong results; "warning" means it runs,
but slower or at risk. A problem may name environment variables the launch command needs to work around it
(`command_env`); `verdict.py` puts them in the command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from src.audit.findings import TRUNCATED as TRUNCATED_SHARE  # the data audit's own threshold

from .bandwidth import BenchResult
from .devices import CudaView
from .inputs import CheckOptions
from .memory_plan import GIB, MemoryPlan
from .nvml_probe import GpuFacts, NvmlFacts, PairFacts
from .software import SoftwareFacts, is_truthy
from .system import SystemFacts
from .topology import (
    Transport,
    link_label,
    nccl_path,
    nccl_transport,
    p2p_level,
    p2p_ok,
    p2p_reason,
    within_p2p_level,
)

ERROR, WARNING = "error", "warning"

# NVML constants used below (pynvml's values), named here so the rules read without the module at hand.
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3
VIRTUALIZATION_PASSTHROUGH, VIRTUALIZATION_VGPU = 1, 2
CLOCK_EVENT_REASONS = {
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
HOT_GPU_CELSIUS = 85
# Consumer GPUs whose P2P over PCIe is unsupported or unreliable; NCCL has hung on them where the driver still
# reported P2P. accelerate refuses to start on the RTX 40 series with a driver older than 550.40.07 unless both
# NCCL_P2P_DISABLE and NCCL_IB_DISABLE are set (accelerate.utils.environment.check_cuda_p2p_ib_support).
CONSUMER_P2P_PATTERN = re.compile(r"RTX (40|50)\d\d")
ACCELERATE_RTX40_MIN_DRIVER = (550, 40, 7)
SHM_FAILS_BYTES = 256 * 1024**2
SHM_WARN_BYTES = GIB
UNSEEN_MEMORY_BYTES = GIB  # more used memory than this with no process listed: someone NVML cannot show us
# Oldest driver for each CUDA release (CUDA release notes, Linux), for the "driver too old" fix.
MIN_DRIVER_FOR_CUDA = {
    (11, 8): "520", (12, 0): "525", (12, 1): "530", (12, 2): "535", (12, 3): "545", (12, 4): "550",
    (12, 5): "555", (12, 6): "560", (12, 8): "570", (12, 9): "575", (13, 0): "580",
}  # fmt: skip


@dataclass
class Problem:
    severity: str  # "error" or "warning"
    code: str
    what: str
    fix: str
    gpus: list[int] = field(default_factory=list)  # NVML indices concerned
    command_env: dict[str, str] = field(default_factory=dict)  # variables the launch command sets to work around it
    worked_around: bool = False  # the launch command avoids it (leaves the GPU out, sets a variable, fewer processes)


@dataclass
class Machine:
    """Everything the rules look at: the facts, and what the launch would use."""

    options: CheckOptions
    environ: Mapping[str, str]
    software: SoftwareFacts
    system: SystemFacts
    nvml: NvmlFacts
    cuda: CudaView | None  # None without usable NVML
    nccl_settings: dict[str, str]
    excluded: dict[int, str]  # NVML index -> why the launch leaves this visible GPU out
    launch_gpus: list[int]  # NVML indices the launch uses, in CUDA order
    num_procs: int  # processes the launch starts; 0 when nothing can run
    requested_procs: int | None
    p2p_level: tuple[str, str]
    transports: dict[tuple[int, int], Transport]
    memory_plan: MemoryPlan | None = None
    bench: BenchResult | None = None
    plan_refused: str | None = None  # the launcher's own message when it would refuse the plan on this launch
    # A global batch this launch cannot split (src/config.BatchSplitError): planned, and launched, with the nearest
    # batch that splits
    batch_split: Exception | None = None

    @property
    def has_gpus(self) -> bool:
        return self.nvml.status == "ok" and bool(self.nvml.gpus)

    @property
    def multi_node(self) -> bool:
        return self.environ.get("NNODES", "1").strip() not in ("", "1")

    def gpu(self, index: int) -> GpuFacts:
        return self.nvml.gpus[index]

    def visible_gpus(self) -> list[GpuFacts]:
        return [self.gpu(index) for index in self.cuda.visible] if self.cuda else []

    def launch_pairs(self) -> list[PairFacts]:
        return [pair for pair in self.nvml.pairs if pair.gpu_a in self.launch_gpus and pair.gpu_b in self.launch_gpus]


def _gpu_name(gpu: GpuFacts) -> str:
    return f"GPU {gpu.index} ({gpu.name or 'unknown model'})"


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _indices(indices: list[int]) -> str:
    return ",".join(str(index) for index in indices)


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", text or "")
    return tuple(int(number) for number in numbers) if numbers else None


def pci_positions(machine: Machine, nvml_indices: list[int]) -> list[int]:
    """Positions in PCI bus order: the GPU numbers of CUDA_VISIBLE_DEVICES under CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    order = [gpu.index for gpu in sorted(machine.nvml.gpus, key=lambda gpu: gpu.bus_id or "")]
    return [order.index(index) for index in nvml_indices]


def pinned_gpus_prefix(machine: Machine, nvml_indices: list[int]) -> str:
    return f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={_indices(pci_positions(machine, nvml_indices))}"


def exclusion_reason(gpu: GpuFacts) -> str | None:
    """Why a launch must leave this GPU out, or None when it can use it."""
    if gpu.lost:
        return "GPU is lost"
    if gpu.mig_enabled:
        return "MIG enabled"
    if gpu.ecc_uncorrected_volatile:
        return "uncorrected ECC errors"
    if gpu.remap_pending:
        return "row remap pending"
    if gpu.remap_failed:
        return "row remapping failed"
    if gpu.compute_mode == COMPUTE_MODE_PROHIBITED:
        return "compute mode Prohibited"
    if gpu.compute_mode == COMPUTE_MODE_EXCLUSIVE_PROCESS and gpu.processes:
        return "exclusive-process mode, already in use"
    return None


# --- software and driver -------------------------------------------------------------------------------------


def torch_build(machine: Machine) -> list[Problem]:
    software = machine.software
    reinstall = "pip install -r requirements.txt (on a GPU machine install your CUDA build of torch first)"
    if software.torch is None:
        return [Problem(ERROR, "torch_missing", f"torch cannot be imported ({software.torch_error})", reinstall)]
    if not software.distributed:
        return [Problem(ERROR, "no_distributed", f"torch {software.torch} was built without torch.distributed", reinstall)]
    if not machine.has_gpus:
        if not software.gloo:
            return [Problem(ERROR, "no_gloo", f"torch {software.torch} has no gloo backend for CPU training", reinstall)]
        return []
    if software.torch_cuda is None:
        driver_cuda = ".".join(map(str, machine.nvml.cuda_driver_version or ()))
        return [
            Problem(
                ERROR,
                "torch_cpu_build",
                f"torch {software.torch} is a CPU-only build but this machine has {len(machine.nvml.gpus)} NVIDIA GPU(s)",
                "install torch's CUDA build for a CUDA version your driver supports"
                + (f" (at most {driver_cuda})" if driver_cuda else "")
                + ": see https://pytorch.org/get-started/locally/",
            )
        ]
    if not software.nccl_backend:
        return [Problem(ERROR, "no_nccl", f"torch {software.torch} has CUDA but no NCCL backend", reinstall)]
    return []


def driver(machine: Machine) -> list[Problem]:
    nvml, system = machine.nvml, machine.system
    on_bus = system.nvidia_pci_devices
    # /sys is not namespaced: a container sees the host's NVIDIA devices on the bus even when they are not passed in.
    container_hint = " In a container, start it with the NVIDIA container toolkit: docker run --gpus all ..." if system.in_container else ""
    if nvml.status == "ok" and nvml.gpus:
        return []
    if nvml.status == "ok" and on_bus:
        what = f"the NVIDIA driver is loaded but sees none of the {on_bus} NVIDIA GPU(s) on the PCI bus"
        return [Problem(ERROR, "driver_sees_no_gpu", what, "dmesg | grep -i nvrm says why; reboot, then reinstall the driver")]
    if nvml.status in ("ok", "no_library", "no_pynvml") and not on_bus:
        return [
            Problem(
                WARNING,
                "no_gpu",
                "no NVIDIA GPU on this machine: training runs on CPU with gloo, fine for tiny models and tests, "
                "far too slow for real ones",
                "nothing to do for CPU runs; for real training use a machine with NVIDIA GPUs",
            )
        ]
    if nvml.status == "no_pynvml":
        return [Problem(ERROR, "no_pynvml", f"nvidia-ml-py is not installed: cannot inspect the {on_bus} NVIDIA GPU(s)", "pip install nvidia-ml-py")]
    fixes = {
        "no_library": (
            f"{on_bus} NVIDIA GPU(s) on the PCI bus but no NVIDIA driver (libnvidia-ml.so not found)",
            "install the NVIDIA driver (e.g. sudo ubuntu-drivers install, or your distribution's nvidia-driver package) and reboot."
            + container_hint,
        ),
        "driver_not_loaded": (
            "the NVIDIA driver library is installed but its kernel module is not loaded",
            "sudo modprobe nvidia, or reboot; dmesg | grep -i nvidia says why it failed (Secure Boot blocks unsigned modules)",
        ),
        "version_mismatch": (
            "the NVIDIA driver library and kernel module versions differ (the driver was updated without a reboot)",
            "reboot, or unload and reload the nvidia kernel modules with no GPU process running",
        ),
        "no_permission": ("no permission to query the NVIDIA driver", "run as a user that can open /dev/nvidia* (e.g. the video group)"),
    }
    what, fix = fixes.get(nvml.status, (f"NVML failed: {nvml.error}", "check nvidia-smi; reinstall the driver if it fails too"))
    return [Problem(ERROR, nvml.status if nvml.status in fixes else "nvml_failed", what, fix)]


def driver_supports_torch(driver_cuda: tuple[int, int] | None, torch_cuda: str | None) -> bool | None:
    """Whether the driver's CUDA version is at least the one torch was built for; None when either is unknown."""
    wanted = _version_tuple(torch_cuda)
    if driver_cuda is None or wanted is None:
        return None
    return driver_cuda >= wanted[:2]


def driver_too_old(machine: Machine) -> list[Problem]:
    driver_cuda = machine.nvml.cuda_driver_version
    if not machine.has_gpus or driver_supports_torch(driver_cuda, machine.software.torch_cuda) in (None, True):
        return []
    torch_cuda = _version_tuple(machine.software.torch_cuda)
    wanted = ".".join(map(str, torch_cuda[:2]))
    have = ".".join(map(str, driver_cuda))
    minimum = MIN_DRIVER_FOR_CUDA.get(torch_cuda[:2])
    fix = (
        f"update the NVIDIA driver{f' to {minimum} or newer' if minimum else ''}, "
        f"or install a torch build for CUDA {have} or older"
    )
    if driver_cuda[0] < torch_cuda[0]:
        what = f"driver {machine.nvml.driver_version} supports CUDA {have} but torch was built for CUDA {wanted}: CUDA will not initialise"
        return [Problem(ERROR, "driver_too_old", what, fix)]
    what = (
        f"driver {machine.nvml.driver_version} supports CUDA {have}, older than torch's CUDA {wanted}: it runs through "
        "minor-version compatibility, but kernels that need PTX JIT or newer driver features fail"
    )
    return [Problem(WARNING, "driver_older_than_torch", what, fix)]


def no_visible_gpu(machine: Machine) -> list[Problem]:
    if not machine.has_gpus or machine.cuda.visible:
        return []
    setting = machine.environ.get("CUDA_VISIBLE_DEVICES")
    what = f"CUDA_VISIBLE_DEVICES={setting!r} hides all {len(machine.nvml.gpus)} GPUs"
    if machine.cuda.mig_devices:
        what += f" (it names MIG instances {', '.join(machine.cuda.mig_devices)}; NCCL cannot all-reduce across MIG instances)"
    return [Problem(ERROR, "no_visible_gpu", what, "unset CUDA_VISIBLE_DEVICES, or list whole GPUs (e.g. CUDA_VISIBLE_DEVICES=0,1)")]


# --- per-GPU health --------------------------------------------------------------------------------------------


def _gpu_left_out(machine: Machine, gpu: GpuFacts, code: str, what: str, fix: str) -> Problem:
    """An error on one GPU (exclusion_reason): the launch command leaves the GPU out while another is usable."""
    left_out = ("The command below leaves it out." if machine.launch_gpus else
                "No GPU is left to run on until it is fixed.")
    return Problem(ERROR, code, what, f"{fix} {left_out}", gpus=[gpu.index], worked_around=bool(machine.launch_gpus))


def mig(machine: Machine) -> list[Problem]:
    return [
        _gpu_left_out(
            machine, gpu, "mig_enabled",
            f"{_gpu_name(gpu)} has MIG enabled: CUDA shows its MIG instances, not the GPU, and NCCL cannot "
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
            f"{_gpu_name(gpu)} has {' and '.join(findings)}: results computed on it cannot be trusted", f"{fix}."))
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
                                      f"{_gpu_name(gpu)}: {reason}, so a training process cannot open it",
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
                + (f" {_gib(process.used_bytes)}" if process.used_bytes is not None else "")
                for process in gpu.processes
            )
            held.append(f"GPU {index}: {listed}")
            gpus.append(index)
        elif (gpu.memory_used_bytes or 0) > UNSEEN_MEMORY_BYTES:
            held.append(f"GPU {index}: {_gib(gpu.memory_used_bytes)} used by processes NVML does not list (another container?)")
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
            Problem(WARNING, "throttling", f"{_gpu_name(gpu)} is throttled: {', '.join(reasons)}", "; ".join(fixes), gpus=[index])
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
                    f"{_gpu_name(gpu)} PCIe link runs at x{gpu.pcie_width} of x{gpu.pcie_width_max}: "
                    "host transfers and P2P over PCIe get that fraction of the bandwidth",
                    "reseat the card, check it sits in a full-width slot and the BIOS lane (bifurcation) settings",
                    gpus=[index],
                )
            )
    return problems


# --- the set of GPUs ----------------------------------------------------------------------------------------------


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
        f"the smallest ({smallest.name}, {_gib(smallest.memory_total_bytes or 0)})"
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
            f"the recipe sets mixed_precision: bf16 but {', '.join(_gpu_name(gpu) for gpu in lacking)} has no native bf16",
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


# --- interconnect ---------------------------------------------------------------------------------------------


def _pairs_text(pairs: list[PairFacts]) -> str:
    return ", ".join(f"{pair.gpu_a}-{pair.gpu_b}" for pair in pairs)


def _consumer_launch(machine: Machine) -> bool:
    return len(machine.launch_gpus) > 1 and any(
        CONSUMER_P2P_PATTERN.search(machine.gpu(index).name or "") for index in machine.launch_gpus
    )


def nvlink_p2p_broken(machine: Machine) -> list[Problem]:
    broken = [pair for pair in machine.launch_pairs() if machine.transports[(pair.gpu_a, pair.gpu_b)].kind == "fails"]
    if not broken:
        return []
    return [
        Problem(
            ERROR,
            "nvlink_p2p_broken",
            f"GPU pairs {_pairs_text(broken)} are joined by NVLink but the driver reports P2P {p2p_reason(broken[0])}: "
            "NCCL aborts ('P2P is disabled between NVLINK connected GPUs')",
            "on NVSwitch systems start the fabric manager (sudo systemctl start nvidia-fabricmanager) and check "
            "nvidia-smi nvlink -s; to run without P2P meanwhile, NCCL_P2P_DISABLE=1 (the command sets it)",
            gpus=sorted({pair.gpu_a for pair in broken} | {pair.gpu_b for pair in broken}),
            command_env={"NCCL_P2P_DISABLE": "1"},
            worked_around=True,
        )
    ]


def p2p_unavailable(machine: Machine) -> list[Problem]:
    if _consumer_launch(machine):
        return []  # consumer_gpus says it, with the setting to use
    level = machine.p2p_level[0]
    unavailable = [
        pair
        for pair in machine.launch_pairs()
        if not pair.nvlinks and not p2p_ok(pair) and within_p2p_level(nccl_path(pair), level)
    ]
    if not unavailable:
        return []
    return [
        Problem(
            WARNING,
            "p2p_unavailable",
            f"P2P is unavailable between GPUs {_pairs_text(unavailable)} ({p2p_reason(unavailable[0])}) although their "
            f"PCIe path ({link_label(unavailable[0])}) allows it: NCCL goes through host memory (SHM), at lower bandwidth",
            "nothing is needed to run. To get P2P back: disable PCIe ACS on the switches, boot with iommu=pt, or in a "
            "VM pass the GPUs through with P2P enabled",
            gpus=sorted({pair.gpu_a for pair in unavailable} | {pair.gpu_b for pair in unavailable}),
        )
    ]


def _virtualised(machine: Machine) -> str | None:
    if machine.system.iommu == "translated":
        return "the IOMMU translating DMA (not iommu=pt)"
    modes = {machine.gpu(index).virtualization_mode for index in machine.launch_gpus}
    if modes & {VIRTUALIZATION_PASSTHROUGH, VIRTUALIZATION_VGPU} or machine.system.hypervisor:
        return "a virtual machine"
    return None


def p2p_unreliable(machine: Machine) -> list[Problem]:
    cause = _virtualised(machine)
    pcie_p2p = [pair for pair in machine.launch_pairs() if machine.transports[(pair.gpu_a, pair.gpu_b)].kind == "P2P/PCIe"]
    verified = machine.bench is not None and machine.bench.outcome == "ok" and not machine.bench.best.p2p_disabled
    if not cause or not pcie_p2p or verified or _consumer_launch(machine):
        return []
    return [
        Problem(
            WARNING,
            "p2p_unreliable",
            f"GPUs {_pairs_text(pcie_p2p)} will use P2P over PCIe under {cause}: there it often hangs or corrupts data",
            "run python check_gpu.py --bench: it catches a hang or a wrong sum and retries without P2P. If P2P fails, "
            "use NCCL_P2P_DISABLE=1, or boot with iommu=pt and disable PCIe ACS",
            gpus=sorted({pair.gpu_a for pair in pcie_p2p} | {pair.gpu_b for pair in pcie_p2p}),
        )
    ]


def consumer_gpus(machine: Machine) -> list[Problem]:
    if not _consumer_launch(machine):
        return []
    names = sorted({machine.gpu(index).name for index in machine.launch_gpus})
    env = {"NCCL_P2P_DISABLE": "1"}
    what = (
        f"consumer GPUs ({', '.join(names)}): P2P between them is unsupported or unreliable, and NCCL has hung on "
        "such machines even where the driver reported P2P"
    )
    driver_version = _version_tuple(machine.nvml.driver_version)
    if driver_version is not None and driver_version < ACCELERATE_RTX40_MIN_DRIVER and any("RTX 40" in name for name in names):
        env["NCCL_IB_DISABLE"] = "1"
        what += f"; with driver {machine.nvml.driver_version} (< 550.40.07) accelerate refuses to start unless NCCL_IB_DISABLE=1 is set too"
    settings = " ".join(f"{name}={value}" for name, value in env.items())
    return [
        Problem(
            WARNING,
            "consumer_gpus",
            what,
            f"run with {settings} (the command sets it): NCCL then uses host shared memory",
            gpus=list(machine.launch_gpus),
            command_env=env,
        )
    ]


def _numa_node(gpu: GpuFacts) -> int | None:
    return gpu.numa_nodes[0] if gpu.numa_nodes else None


def cross_socket(machine: Machine) -> list[Problem]:
    crossing = [
        pair
        for pair in machine.launch_pairs()
        if nccl_path(pair) == "SYS" and not machine.transports[(pair.gpu_a, pair.gpu_b)].kind.startswith("P2P")
    ]
    if not crossing:
        return []
    by_node: dict[int | None, list[int]] = {}
    for index in machine.launch_gpus:
        by_node.setdefault(_numa_node(machine.gpu(index)), []).append(index)
    groups = "; ".join(f"NUMA node {node}: GPUs {_indices(indices)}" for node, indices in by_node.items())
    largest_group = max(by_node.values(), key=len)
    return [
        Problem(
            WARNING,
            "cross_socket",
            f"GPU pairs {_pairs_text(crossing)} talk across CPU sockets (SYS): NCCL goes through host memory and the "
            f"socket interconnect, well below PCIe speed ({groups})",
            f"if the model fits on one socket's GPUs, {pinned_gpus_prefix(machine, largest_group)} ./run_distributed.sh "
            f"{len(largest_group)}; otherwise keep each process on its GPU's NUMA node (torchrun --numa-binding=node) "
            "and measure with --bench",
            gpus=sorted({pair.gpu_a for pair in crossing} | {pair.gpu_b for pair in crossing}),
        )
    ]


# --- host -----------------------------------------------------------------------------------------------------


def shared_memory(machine: Machine) -> list[Problem]:
    shm = machine.system.shm_bytes
    if shm is None or machine.num_procs < 2 or shm >= SHM_WARN_BYTES:
        return []
    fix = (
        "start the container with --shm-size=16g or --ipc=host (Kubernetes: an emptyDir with medium: Memory at /dev/shm)"
        if machine.system.in_container
        else "enlarge it: sudo mount -o remount,size=16G /dev/shm"
    )
    if machine.has_gpus and shm < SHM_FAILS_BYTES:
        what = f"/dev/shm is {shm / 1024**2:.0f} MiB: NCCL fails creating its shared-memory segments ('Error while creating shared memory segment')"
        return [Problem(ERROR, "shm_too_small", what, fix)]
    what = f"/dev/shm is {shm / 1024**2:.0f} MiB: NCCL's shared-memory transport and DataLoader workers may run out of it"
    return [Problem(WARNING, "shm_small", what, fix)]


def rendezvous_port(machine: Machine) -> list[Problem]:
    system = machine.system
    if system.rendezvous_port_free is not False:
        return []
    return [
        Problem(
            WARNING,
            "port_in_use",
            f"the rendezvous port {system.rendezvous_port} (MASTER_PORT) is in use: the launch would fail with "
            "'address already in use' (is an earlier run still alive?)",
            f"the command below uses the free port {system.free_port}; or stop what holds it (ss -ltnp | grep :{system.rendezvous_port})",
            command_env={"MASTER_PORT": str(system.free_port)},
        )
    ]


def infiniband(machine: Machine) -> list[Problem]:
    ports = [port for port in machine.system.infiniband_ports if port.link_layer.lower() == "infiniband"]
    if not ports or any(port.active for port in ports):
        return []
    devices = ", ".join(sorted({f"{port.device} port {port.port} {port.state}" for port in ports}))
    scope = "a multi-node run" if machine.multi_node else "multi-node runs (single-node runs are unaffected)"
    return [
        Problem(
            WARNING,
            "infiniband_down",
            f"InfiniBand adapters found but no port is ACTIVE ({devices}): NCCL falls back to TCP sockets for {scope}",
            "check cables and the subnet manager (ibstat; sudo systemctl start opensm where no switch runs one); "
            "NCCL_IB_DISABLE=1 stops NCCL trying the adapters",
        )
    ]


def memlock(machine: Machine) -> list[Problem]:
    limit = machine.system.memlock_bytes
    active_ib = [port for port in machine.system.infiniband_ports if port.active]
    if limit is None or not active_ib:
        return []
    return [
        Problem(
            WARNING,
            "memlock_limited",
            f"the memlock limit is {limit // 1024} KiB: InfiniBand (RDMA) pins NCCL's buffers and fails to register them",
            "ulimit -l unlimited (containers: --ulimit memlock=-1; systemd services: LimitMEMLOCK=infinity)",
        )
    ]


def multi_node(machine: Machine) -> list[Problem]:
    if not machine.multi_node:
        return []
    nodes = machine.environ.get("NNODES", "")
    if not nodes.isdigit():
        return [Problem(ERROR, "bad_nnodes", f"NNODES={nodes!r} is not a node count", "export NNODES=<number of nodes>")]
    if machine.environ.get("MASTER_ADDR"):
        return []
    return [
        Problem(
            ERROR,
            "no_master_addr",
            f"NNODES={nodes} but MASTER_ADDR is not set: the nodes cannot find each other",
            "export MASTER_ADDR=<address of node rank 0> on every node (and NODE_RANK=0..N-1)",
        )
    ]


def _where_set(machine: Machine, name: str) -> str:
    if name in machine.software.environment:
        return "in the environment"
    return f"in {', '.join(machine.software.nccl_conf_files) or 'nccl.conf'}"


def stale_settings(machine: Machine) -> list[Problem]:
    settings = {**machine.nccl_settings, **machine.software.environment}
    problems = []
    debug = [
        name
        for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "TORCH_DISTRIBUTED_DEBUG")
        if name in settings and settings[name].upper() not in ("", "WARN", "VERSION", "OFF")
    ]
    if debug:
        listed = ", ".join(f"{name}={settings[name]} ({_where_set(machine, name)})" for name in debug)
        problems.append(
            Problem(
                WARNING,
                "debug_settings",
                f"debug settings left on: {listed}: they flood the logs and slow start-up and collectives",
                f"unset {' '.join(debug)} (remove them from nccl.conf if set there)",
            )
        )
    if is_truthy(settings.get("CUDA_LAUNCH_BLOCKING")):
        problems.append(
            Problem(
                WARNING,
                "cuda_launch_blocking",
                "CUDA_LAUNCH_BLOCKING=1 makes every CUDA kernel synchronous: training runs several times slower",
                "unset CUDA_LAUNCH_BLOCKING",
            )
        )
    problems += _needless_p2p_disable(machine)
    if is_truthy(machine.nccl_settings.get("NCCL_SHM_DISABLE")) and machine.num_procs > 1 and machine.has_gpus:
        problems.append(
            Problem(
                WARNING,
                "shm_disabled",
                f"NCCL_SHM_DISABLE=1 ({_where_set(machine, 'NCCL_SHM_DISABLE')}): GPU pairs without P2P go through the "
                "network stack instead of shared memory",
                "unset NCCL_SHM_DISABLE",
            )
        )
    return problems


def _needless_p2p_disable(machine: Machine) -> list[Problem]:
    """NCCL_P2P_DISABLE=1 set by hand, where P2P would work and nothing here calls for disabling it."""
    if machine.nccl_settings.get("NCCL_P2P_DISABLE") != "1" or _consumer_launch(machine):
        return []
    if machine.bench is not None and machine.bench.outcome == "ok_without_p2p":
        return []
    without = {name: value for name, value in machine.nccl_settings.items() if name != "NCCL_P2P_DISABLE"}
    level = p2p_level(without, machine.system.cpu_vendor, len(machine.launch_gpus))[0]
    would_use_p2p = [pair for pair in machine.launch_pairs() if nccl_transport(pair, level, without).kind.startswith("P2P")]
    if not would_use_p2p:
        return []
    return [
        Problem(
            WARNING,
            "needless_p2p_disable",
            f"NCCL_P2P_DISABLE=1 ({_where_set(machine, 'NCCL_P2P_DISABLE')}) but P2P works between GPUs "
            f"{_pairs_text(would_use_p2p)}: the setting costs bandwidth",
            "unset NCCL_P2P_DISABLE (run --bench to confirm P2P is sound)",
        )
    ]


# --- what the user asked for --------------------------------------------------------------------------------------


# How each method of the memory plan is asked for at launch.
HOW_TO_RUN = {"full": "the default", "lora": "--use_lora", "qlora": "--use_lora --load_in_4bit",
              "zero2": "STRATEGY=zero2 ./run_distributed.sh ..., with deepspeed installed",
              "zero3": "STRATEGY=zero3 ./run_distributed.sh ..., with deepspeed installed"}


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
    return f"{estimate.label} needs about {_gib(estimate.total_bytes)} per {_per_device(plan)} there ({fits})"


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
    where = f"{_gib(plan.budget_bytes)} ({plan.budget_source})"
    length = (f"{plan.sequence_tokens} tokens per sequence (the data audit's longest within max_length "
              f"{plan.max_length})" if plan.data_lengths else f"max_length {plan.max_length}")
    what = (
        f"{chosen.label} needs about {_gib(chosen.total_bytes)} per {_per_device(plan)} at per-device batch "
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
        others = [f"{estimate.label} ({HOW_TO_RUN[estimate.method]})" for estimate in plan.estimates
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


RULES: tuple[Callable[[Machine], list[Problem]], ...] = (
    driver,
    torch_build,
    driver_too_old,
    no_visible_gpu,
    gpu_lost,
    mig,
    memory_errors,
    compute_mode,
    too_many_processes,
    multi_node,
    bf16_unsupported,
    nvlink_p2p_broken,
    plan_refused,
    batch_does_not_split,
    memory_fit,
    max_length_cuts_data,
    past_context,
    bench_outcome,
    shared_memory,
    other_processes,
    throttling,
    pcie_width,
    mixed_models,
    consumer_gpus,
    p2p_unavailable,
    p2p_unreliable,
    cross_socket,
    rendezvous_port,
    infiniband,
    memlock,
    stale_settings,
)


def find_problems(machine: Machine) -> list[Problem]:
    """Every problem, errors first, in the order of RULES within each severity."""
    problems = [problem for rule in RULES for problem in rule(machine)]
    return sorted(problems, key=lambda problem: problem.severity != ERROR)
