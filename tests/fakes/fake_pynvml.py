"""A fake `pynvml` (nvidia-ml-py) module built from a described machine, for tests on machines without a GPU.

The module has the real one's constants, error classes and result structures (taken from the installed pynvml,
so NVML_P2P_CAPS_INDEX_READ is the same (0,) tuple) and, for every NVML function the check calls, a function with
the real name and signature that answers from the description. Real NVML functions it does not implement are
absent, so a new call in the code fails loudly in tests instead of being answered by accident. Errors are the
real classes, raised the real way: `pynvml.NVMLError(code)` picks the subclass.
"""

from __future__ import annotations

import ctypes
import inspect
import types
import uuid as uuid_module
from dataclasses import dataclass, field

import pynvml as real_pynvml

MIB = 1024**2
GIB = 1024**3


@dataclass
class FakeProcess:
    pid: int
    name: str
    used_gib: float


@dataclass
class FakeGpu:
    name: str
    bus_id: str  # "0000:18:00.0"
    memory_mib: int  # as NVML reports the total, e.g. 81559 for an H100 80GB
    compute_capability: tuple[int, int]
    # Where the GPU hangs in the PCIe tree, from the CPU socket down: ("cpu0", "hostbridge0", "switch0", ...).
    pcie_path: tuple[str, ...]
    numa_node: int = 0
    cpus: tuple[int, ...] = (0,)
    brand: int = real_pynvml.NVML_BRAND_NVIDIA
    used_mib: int = 512  # an idle GPU: memory the driver reserves
    processes: list[FakeProcess] = field(default_factory=list)
    ecc: bool = True
    ecc_uncorrected_volatile: int = 0
    ecc_uncorrected_aggregate: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    mig: bool = False
    compute_mode: int = real_pynvml.NVML_COMPUTEMODE_DEFAULT
    persistence: bool = True
    clocks_event_reasons: int = real_pynvml.nvmlClocksEventReasonGpuIdle
    temperature_c: int = 34
    power_w: float = 70.0
    power_limit_w: float = 700.0
    pcie: tuple[int, int, int, int] = (1, 5, 16, 16)  # current gen (drops at idle), max gen, current width, max width
    nvlinks: list[tuple[str, str]] = field(default_factory=list)  # per link: ("gpu" | "switch", remote bus id)
    p2p_capable: bool = True  # False: the driver reports "GPU not supported" (consumer GPUs)
    virtualization_mode: int = real_pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
    failing: dict[str, int] = field(default_factory=dict)  # NVML function name -> NVML_ERROR_* it raises
    lost: bool = False

    @property
    def uuid(self) -> str:
        return "GPU-" + str(uuid_module.uuid5(uuid_module.NAMESPACE_URL, f"{self.name}/{self.bus_id}"))


@dataclass
class FakeMachine:
    gpus: list[FakeGpu]
    driver_version: str = "570.124.06"
    cuda_driver_version: int = 12080
    init_error: int | None = None  # NVML_ERROR_* that nvmlInit raises
    p2p_overrides: dict[frozenset[int], int] = field(default_factory=dict)  # NVML index pair -> NVML_P2P_STATUS_*
    process_name_error: int | None = None  # e.g. NVML_ERROR_NO_PERMISSION for other users' processes


def common_ancestor(a: FakeGpu, b: FakeGpu) -> int:
    """The NVML_TOPOLOGY_* level of the closest common point of two PCIe paths."""
    if a.pcie_path[0] != b.pcie_path[0]:
        return real_pynvml.NVML_TOPOLOGY_SYSTEM
    shared = 0
    while shared < min(len(a.pcie_path), len(b.pcie_path)) and a.pcie_path[shared] == b.pcie_path[shared]:
        shared += 1
    if shared == 1:
        return real_pynvml.NVML_TOPOLOGY_NODE
    if shared == 2:
        return real_pynvml.NVML_TOPOLOGY_HOSTBRIDGE
    both_directly_below = shared == len(a.pcie_path) == len(b.pcie_path)
    return real_pynvml.NVML_TOPOLOGY_SINGLE if both_directly_below else real_pynvml.NVML_TOPOLOGY_MULTIPLE


def _nvlinked(a: FakeGpu, b: FakeGpu) -> bool:
    direct = any(kind == "gpu" and remote == b.bus_id for kind, remote in a.nvlinks)
    shared_switch = {remote for kind, remote in a.nvlinks if kind == "switch"} & {
        remote for kind, remote in b.nvlinks if kind == "switch"
    }
    return direct or bool(shared_switch)


def p2p_status(machine: FakeMachine, index_a: int, index_b: int) -> int:
    """What the driver would say: NVLink peers and GPUs within one socket can do P2P; across sockets they cannot."""
    override = machine.p2p_overrides.get(frozenset((index_a, index_b)))
    if override is not None:
        return override
    a, b = machine.gpus[index_a], machine.gpus[index_b]
    if not (a.p2p_capable and b.p2p_capable):
        return real_pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED
    if _nvlinked(a, b) or common_ancestor(a, b) != real_pynvml.NVML_TOPOLOGY_SYSTEM:
        return real_pynvml.NVML_P2P_STATUS_OK
    return real_pynvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED


def _mask(bits: list[int], words: int):
    array = (ctypes.c_ulonglong * words)()
    for bit in bits:
        if bit // 64 < words:
            array[bit // 64] |= 1 << (bit % 64)
    return array


def _pci_info(bus_id: str):
    domain, bus, device_function = bus_id.split(":")
    info = real_pynvml.nvmlPciInfo_t()
    info.busId = f"{int(domain, 16):08X}:{bus.upper()}:{device_function}".encode()
    info.busIdLegacy = bus_id.upper().encode()
    info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(device_function.split(".")[0], 16)
    return info


class FakeHandle:
    """Stands for an nvmlDevice_t."""

    def __init__(self, index: int):
        self.index = index


def make_fake_pynvml(machine: FakeMachine) -> types.ModuleType:
    """A module that answers like pynvml would on `machine`."""
    module = types.ModuleType("pynvml", "fake pynvml for tests")
    for name, value in vars(real_pynvml).items():
        if not (name.startswith("nvml") and inspect.isfunction(value)):
            module.__dict__[name] = value  # constants, error classes, structures
    state = {"initialized": False}

    def error(code: int) -> real_pynvml.NVMLError:
        return real_pynvml.NVMLError(code)

    def require_init() -> None:
        if not state["initialized"]:
            raise error(real_pynvml.NVML_ERROR_UNINITIALIZED)

    def gpu_of(handle: FakeHandle, function_name: str) -> FakeGpu:
        require_init()
        gpu = machine.gpus[handle.index]
        if gpu.lost:
            raise error(real_pynvml.NVML_ERROR_GPU_IS_LOST)
        if function_name in gpu.failing:
            raise error(gpu.failing[function_name])
        return gpu

    def nvmlInit():
        if machine.init_error is not None:
            raise error(machine.init_error)
        state["initialized"] = True

    def nvmlShutdown():
        require_init()
        state["initialized"] = False

    def nvmlSystemGetDriverVersion():
        require_init()
        return machine.driver_version

    def nvmlSystemGetCudaDriverVersion():
        require_init()
        return machine.cuda_driver_version

    def nvmlSystemGetProcessName(pid):
        require_init()
        if machine.process_name_error is not None:
            raise error(machine.process_name_error)
        for gpu in machine.gpus:
            for process in gpu.processes:
                if process.pid == pid:
                    return process.name
        raise error(real_pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetCount():
        require_init()
        return len(machine.gpus)

    def nvmlDeviceGetHandleByIndex(index):
        require_init()
        if not 0 <= index < len(machine.gpus):
            raise error(real_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetName(handle):
        return gpu_of(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(handle):
        return gpu_of(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(handle):
        return _pci_info(gpu_of(handle, "nvmlDeviceGetPciInfo").bus_id)

    def nvmlDeviceGetBrand(handle):
        return gpu_of(handle, "nvmlDeviceGetBrand").brand

    def nvmlDeviceGetCudaComputeCapability(handle):
        return gpu_of(handle, "nvmlDeviceGetCudaComputeCapability").compute_capability

    def nvmlDeviceGetVirtualizationMode(handle):
        return gpu_of(handle, "nvmlDeviceGetVirtualizationMode").virtualization_mode

    def nvmlDeviceGetMemoryInfo(handle, version=None):
        gpu = gpu_of(handle, "nvmlDeviceGetMemoryInfo")
        memory = real_pynvml.c_nvmlMemory_t()
        used = gpu.used_mib * MIB + sum(int(process.used_gib * GIB) for process in gpu.processes)
        memory.total, memory.used, memory.free = gpu.memory_mib * MIB, used, gpu.memory_mib * MIB - used
        return memory

    def nvmlDeviceGetEccMode(handle):
        gpu = gpu_of(handle, "nvmlDeviceGetEccMode")
        state_value = real_pynvml.NVML_FEATURE_ENABLED if gpu.ecc else real_pynvml.NVML_FEATURE_DISABLED
        return [state_value, state_value]

    def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
        gpu = gpu_of(handle, "nvmlDeviceGetTotalEccErrors")
        if errorType != real_pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return 0
        if counterType == real_pynvml.NVML_VOLATILE_ECC:
            return gpu.ecc_uncorrected_volatile
        return max(gpu.ecc_uncorrected_aggregate, gpu.ecc_uncorrected_volatile)

    def nvmlDeviceGetRemappedRows(device):
        return gpu_of(device, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlDeviceGetCurrentClocksEventReasons(handle):
        return gpu_of(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
        return gpu_of(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_event_reasons

    def nvmlDeviceGetTemperature(handle, sensor):
        return gpu_of(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetPowerUsage(handle):
        return int(gpu_of(handle, "nvmlDeviceGetPowerUsage").power_w * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(handle):
        return int(gpu_of(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_w * 1000)

    def nvmlDeviceGetMigMode(device):
        gpu = gpu_of(device, "nvmlDeviceGetMigMode")
        mode = real_pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig else real_pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetComputeMode(handle):
        return gpu_of(handle, "nvmlDeviceGetComputeMode").compute_mode

    def nvmlDeviceGetPersistenceMode(handle):
        gpu = gpu_of(handle, "nvmlDeviceGetPersistenceMode")
        return real_pynvml.NVML_FEATURE_ENABLED if gpu.persistence else real_pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetComputeRunningProcesses(handle):
        gpu = gpu_of(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [
            real_pynvml.nvmlFriendlyObject(
                {"pid": process.pid, "usedGpuMemory": int(process.used_gib * GIB), "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}
            )
            for process in gpu.processes
        ]

    def nvmlDeviceGetGraphicsRunningProcesses(handle):
        gpu_of(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []

    def nvmlDeviceGetCurrPcieLinkGeneration(handle):
        return gpu_of(handle, "nvmlDeviceGetCurrPcieLinkGeneration").pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(handle):
        return gpu_of(handle, "nvmlDeviceGetMaxPcieLinkGeneration").pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(handle):
        return gpu_of(handle, "nvmlDeviceGetCurrPcieLinkWidth").pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(handle):
        return gpu_of(handle, "nvmlDeviceGetMaxPcieLinkWidth").pcie[3]

    def nvmlDeviceGetCpuAffinity(handle, cpuSetSize):
        return _mask(list(gpu_of(handle, "nvmlDeviceGetCpuAffinity").cpus), cpuSetSize)

    def nvmlDeviceGetMemoryAffinity(handle, nodeSetSize, scope):
        return _mask([gpu_of(handle, "nvmlDeviceGetMemoryAffinity").numa_node], nodeSetSize)

    def link_of(device, link: int, function_name: str) -> tuple[str, str]:
        gpu = gpu_of(device, function_name)
        if not gpu.nvlinks:
            raise error(real_pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise error(real_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(device, link):
        link_of(device, link, "nvmlDeviceGetNvLinkState")
        return real_pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(device, link):
        return _pci_info(link_of(device, link, "nvmlDeviceGetNvLinkRemotePciInfo")[1])

    def nvmlDeviceGetNvLinkRemoteDeviceType(handle, link):
        kind, _remote = link_of(handle, link, "nvmlDeviceGetNvLinkRemoteDeviceType")
        return real_pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if kind == "switch" else real_pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetTopologyCommonAncestor(device1, device2):
        return common_ancestor(
            gpu_of(device1, "nvmlDeviceGetTopologyCommonAncestor"), gpu_of(device2, "nvmlDeviceGetTopologyCommonAncestor")
        )

    def nvmlDeviceGetP2PStatus(device1, device2, p2pIndex):
        if not isinstance(p2pIndex, int):
            # What ctypes raises inside the real function when given pynvml's NVML_P2P_CAPS_INDEX_READ, the tuple (0,).
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3")
        gpu_of(device1, "nvmlDeviceGetP2PStatus")
        gpu_of(device2, "nvmlDeviceGetP2PStatus")
        return p2p_status(machine, device1.index, device2.index)

    for name, value in list(locals().items()):
        if name.startswith("nvml") and inspect.isfunction(value):
            module.__dict__[name] = value
    return module


def implemented_functions(module: types.ModuleType) -> list[str]:
    return sorted(name for name, value in vars(module).items() if name.startswith("nvml") and inspect.isfunction(value))
