"""What every rule reads and returns: the `Machine` (every fact check_gpu.py gathered, and what was derived from them),
a `Problem` (severity, what is wrong, its fix, the GPUs and environment variables it names), and the small readings
several rules share (a GPU's name, which GPUs a launch pins, why a GPU is excluded)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from src.diagnostics.bandwidth import BenchResult
from src.diagnostics.devices import CudaView
from src.diagnostics.inputs import CheckOptions
from src.diagnostics.memory_plan import GIB, MemoryPlan
from src.diagnostics.nvml_probe import GpuFacts, NvmlFacts, PairFacts
from src.diagnostics.software import SoftwareFacts
from src.diagnostics.system import SystemFacts
from src.diagnostics.topology import Transport


ERROR, WARNING = "error", "warning"
# NVML constants used below (pynvml's values), named here so the rules read without the module at hand.
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3


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


def gpu_name(gpu: GpuFacts) -> str:
    return f"GPU {gpu.index} ({gpu.name or 'unknown model'})"


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def gpu_indices(indices: list[int]) -> str:
    return ",".join(str(index) for index in indices)


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", text or "")
    return tuple(int(number) for number in numbers) if numbers else None


def pci_positions(machine: Machine, nvml_indices: list[int]) -> list[int]:
    """Positions in PCI bus order: the GPU numbers of CUDA_VISIBLE_DEVICES under CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    order = [gpu.index for gpu in sorted(machine.nvml.gpus, key=lambda gpu: gpu.bus_id or "")]
    return [order.index(index) for index in nvml_indices]


def pinned_gpus_prefix(machine: Machine, nvml_indices: list[int]) -> str:
    return f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={gpu_indices(pci_positions(machine, nvml_indices))}"


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
