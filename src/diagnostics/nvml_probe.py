"""Driver and GPU facts through NVML (the `pynvml` module of nvidia-ml-py).

`probe_nvml(nvml, cpu_count)` takes the module as an argument so tests can pass a fake with the same function
names and error classes. A GPU that does not support a query (NotSupported), or a query the user may not make
(NoPermission), leaves that fact None and records why in `GpuFacts.unavailable`; a GPU that falls off the bus
(GpuIsLost) is marked lost and not asked anything more. NVML numbers GPUs in PCI bus order and ignores
CUDA_VISIBLE_DEVICES; `devices.py` maps them to CUDA's numbering.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

# nvmlDeviceGetP2PStatus capability indices. pynvml defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,) (a stray
# comma upstream) which ctypes refuses, so the indices are written out here.
P2P_CAPS_READ = 0
P2P_CAPS_WRITE = 1

# Why each init failure happens, for the report.
INIT_FAILURES = {
    "NVMLError_LibraryNotFound": "no_library",
    "NVMLError_DriverNotLoaded": "driver_not_loaded",
    "NVMLError_LibRmVersionMismatch": "version_mismatch",
    "NVMLError_NoPermission": "no_permission",
}


@dataclass
class GpuProcess:
    pid: int
    name: str | None
    used_bytes: int | None


@dataclass
class NvLink:
    link: int
    remote_bus_id: str | None
    to_switch: bool


@dataclass
class GpuFacts:
    index: int  # NVML's index: PCI bus order, as nvidia-smi numbers GPUs
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None  # normalised "0000:18:00.0"
    brand: int | None = None
    compute_capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    ecc_enabled: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    mig_enabled: bool | None = None
    mig_pending: bool | None = None
    compute_mode: int | None = None
    persistence_mode: bool | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    clocks_event_reasons: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pcie_generation: int | None = None
    pcie_generation_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    cpu_affinity: list[int] | None = None
    numa_nodes: list[int] | None = None
    virtualization_mode: int | None = None
    nvlinks: list[NvLink] = field(default_factory=list)
    lost: bool = False
    unavailable: dict[str, str] = field(default_factory=dict)  # fact -> NVML's reason it is missing

    @property
    def bf16(self) -> bool | None:
        """Native bf16 needs compute capability 8.0 (Ampere) or newer."""
        return None if self.compute_capability is None else self.compute_capability >= (8, 0)


@dataclass
class PairFacts:
    gpu_a: int  # NVML indices, gpu_a < gpu_b
    gpu_b: int
    common_ancestor: int | None  # NVML_TOPOLOGY_* level
    p2p_read: int | None  # NVML_P2P_STATUS_*
    p2p_write: int | None
    nvlinks: int


@dataclass
class NvmlFacts:
    status: str  # "ok", "no_pynvml", "no_library", "driver_not_loaded", "version_mismatch", "no_permission", "failed"
    error: str | None = None
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None
    gpus: list[GpuFacts] = field(default_factory=list)
    pairs: list[PairFacts] = field(default_factory=list)

    def pair(self, gpu_a: int, gpu_b: int) -> PairFacts:
        low, high = sorted((gpu_a, gpu_b))
        return next(pair for pair in self.pairs if (pair.gpu_a, pair.gpu_b) == (low, high))


class _GpuLost(Exception):
    pass


def _text(value) -> str:
    # Older nvidia-ml-py returned bytes where the current one returns str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def normalise_bus_id(bus_id) -> str:
    """'00000000:18:00.0' (NVML) or '0000:18:00.0' (CUDA) -> '0000:18:00.0', lower case."""
    parts = _text(bus_id).strip().lower().split(":")
    if len(parts) == 2:  # no domain
        parts = ["0", *parts]
    domain, bus, device_function = parts[-3:]
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{device_function}"


def _cpus_from_mask(words) -> list[int]:
    return [word_index * 64 + bit for word_index, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]


class _Asker:
    """Calls NVML for one GPU, turning a per-call error into a missing fact instead of a crash."""

    def __init__(self, nvml: ModuleType, gpu: GpuFacts):
        self.nvml = nvml
        self.gpu = gpu

    def __call__(self, fact: str, function_name: str, *args):
        function = getattr(self.nvml, function_name, None)
        if function is None:  # an nvidia-ml-py older than the call
            self.gpu.unavailable[fact] = f"{function_name} missing from this nvidia-ml-py"
            return None
        try:
            return function(*args)
        except self.nvml.NVMLError_GpuIsLost:
            raise _GpuLost from None
        except self.nvml.NVMLError as error:
            self.gpu.unavailable[fact] = str(error)
            return None


def _probe_identity(ask: _Asker, handle, gpu: GpuFacts) -> None:
    name = ask("name", "nvmlDeviceGetName", handle)
    gpu.name = None if name is None else _text(name)
    uuid = ask("uuid", "nvmlDeviceGetUUID", handle)
    gpu.uuid = None if uuid is None else _text(uuid)
    pci = ask("bus_id", "nvmlDeviceGetPciInfo", handle)
    gpu.bus_id = None if pci is None else normalise_bus_id(pci.busId)
    gpu.brand = ask("brand", "nvmlDeviceGetBrand", handle)
    capability = ask("compute_capability", "nvmlDeviceGetCudaComputeCapability", handle)
    gpu.compute_capability = None if capability is None else tuple(capability)
    gpu.virtualization_mode = ask("virtualization_mode", "nvmlDeviceGetVirtualizationMode", handle)


def _probe_memory(ask: _Asker, handle, gpu: GpuFacts) -> None:
    memory = ask("memory", "nvmlDeviceGetMemoryInfo", handle)
    if memory is not None:
        gpu.memory_total_bytes, gpu.memory_used_bytes, gpu.memory_free_bytes = memory.total, memory.used, memory.free


def _probe_health(ask: _Asker, handle, gpu: GpuFacts) -> None:
    nvml = ask.nvml
    ecc_mode = ask("ecc", "nvmlDeviceGetEccMode", handle)
    if ecc_mode is not None:
        gpu.ecc_enabled = ecc_mode[0] == nvml.NVML_FEATURE_ENABLED
    if gpu.ecc_enabled:
        uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        gpu.ecc_uncorrected_volatile = ask("ecc_errors", "nvmlDeviceGetTotalEccErrors", handle, uncorrected, nvml.NVML_VOLATILE_ECC)
        gpu.ecc_uncorrected_aggregate = ask("ecc_errors", "nvmlDeviceGetTotalEccErrors", handle, uncorrected, nvml.NVML_AGGREGATE_ECC)
    remapped = ask("remapped_rows", "nvmlDeviceGetRemappedRows", handle)
    if remapped is not None:
        _correctable, gpu.remapped_rows_uncorrectable, pending, failed = remapped
        gpu.remap_pending, gpu.remap_failed = bool(pending), bool(failed)
    reasons = ask("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", handle)
    if reasons is None:  # drivers before 535 only have the older name
        reasons = ask("clocks_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        if reasons is not None:
            gpu.unavailable.pop("clocks_event_reasons", None)
    gpu.clocks_event_reasons = reasons
    gpu.temperature_c = ask("temperature", "nvmlDeviceGetTemperature", handle, nvml.NVML_TEMPERATURE_GPU)
    power_mw = ask("power", "nvmlDeviceGetPowerUsage", handle)
    gpu.power_w = None if power_mw is None else power_mw / 1000
    limit_mw = ask("power", "nvmlDeviceGetEnforcedPowerLimit", handle)
    gpu.power_limit_w = None if limit_mw is None else limit_mw / 1000


def _probe_modes(ask: _Asker, handle, gpu: GpuFacts) -> None:
    nvml = ask.nvml
    mig = ask("mig", "nvmlDeviceGetMigMode", handle)
    if mig is not None:
        gpu.mig_enabled = mig[0] == nvml.NVML_DEVICE_MIG_ENABLE
        gpu.mig_pending = mig[1] == nvml.NVML_DEVICE_MIG_ENABLE
    gpu.compute_mode = ask("compute_mode", "nvmlDeviceGetComputeMode", handle)
    persistence = ask("persistence_mode", "nvmlDeviceGetPersistenceMode", handle)
    gpu.persistence_mode = None if persistence is None else persistence == nvml.NVML_FEATURE_ENABLED


def _probe_processes(ask: _Asker, handle, gpu: GpuFacts) -> None:
    found: dict[int, GpuProcess] = {}
    for function_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        for process in ask("processes", function_name, handle) or []:
            if process.pid == os.getpid() or process.pid in found:
                continue
            name = ask("process_names", "nvmlSystemGetProcessName", process.pid)
            found[process.pid] = GpuProcess(process.pid, None if name is None else _text(name), process.usedGpuMemory)
    gpu.processes = list(found.values())


def _probe_pcie(ask: _Asker, handle, gpu: GpuFacts) -> None:
    gpu.pcie_generation = ask("pcie", "nvmlDeviceGetCurrPcieLinkGeneration", handle)
    gpu.pcie_generation_max = ask("pcie", "nvmlDeviceGetMaxPcieLinkGeneration", handle)
    gpu.pcie_width = ask("pcie", "nvmlDeviceGetCurrPcieLinkWidth", handle)
    gpu.pcie_width_max = ask("pcie", "nvmlDeviceGetMaxPcieLinkWidth", handle)


def _probe_affinity(ask: _Asker, handle, gpu: GpuFacts, cpu_count: int) -> None:
    cpu_words = max(1, -(-cpu_count // 64))
    cpu_mask = ask("cpu_affinity", "nvmlDeviceGetCpuAffinity", handle, cpu_words)
    gpu.cpu_affinity = None if cpu_mask is None else _cpus_from_mask(cpu_mask)
    node_mask = ask("numa_affinity", "nvmlDeviceGetMemoryAffinity", handle, 1, ask.nvml.NVML_AFFINITY_SCOPE_NODE)
    gpu.numa_nodes = None if node_mask is None else _cpus_from_mask(node_mask)


def _probe_nvlinks(ask: _Asker, handle, gpu: GpuFacts) -> None:
    nvml = ask.nvml
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError_GpuIsLost:
            raise _GpuLost from None
        except nvml.NVMLError:
            break  # no NVLink on this GPU (NotSupported), or past its last link (InvalidArgument)
        if state != nvml.NVML_FEATURE_ENABLED:
            continue
        remote = ask("nvlink_remote", "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remote_type = ask("nvlink_remote_type", "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        gpu.nvlinks.append(
            NvLink(
                link=link,
                remote_bus_id=None if remote is None else normalise_bus_id(remote.busId),
                to_switch=remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH,
            )
        )


def _probe_gpu(nvml: ModuleType, index: int, cpu_count: int) -> tuple[GpuFacts, object]:
    gpu = GpuFacts(index=index)
    ask = _Asker(nvml, gpu)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as error:
        gpu.lost = isinstance(error, nvml.NVMLError_GpuIsLost)
        gpu.unavailable["handle"] = str(error)
        return gpu, None
    try:
        for probe in (_probe_identity, _probe_memory, _probe_health, _probe_modes, _probe_processes, _probe_pcie, _probe_nvlinks):
            probe(ask, handle, gpu)
        _probe_affinity(ask, handle, gpu, cpu_count)
    except _GpuLost:
        gpu.lost = True
        return gpu, None
    return gpu, handle


def _nvlinks_between(gpu: GpuFacts, peer: GpuFacts) -> int:
    """Links from `gpu` that reach `peer`: directly, or through an NVSwitch that `peer` is also on."""
    direct = sum(1 for link in gpu.nvlinks if not link.to_switch and link.remote_bus_id == peer.bus_id)
    peer_on_switch = any(link.to_switch for link in peer.nvlinks)
    through_switch = sum(1 for link in gpu.nvlinks if link.to_switch) if peer_on_switch else 0
    return direct + through_switch


def _mark_unknown_remotes_as_switches(gpus: list[GpuFacts]) -> None:
    # When the driver cannot say what is on the far side of a link, a remote that is none of the GPUs is a switch.
    gpu_bus_ids = {gpu.bus_id for gpu in gpus}
    for gpu in gpus:
        if "nvlink_remote_type" in gpu.unavailable:
            for link in gpu.nvlinks:
                link.to_switch = link.remote_bus_id not in gpu_bus_ids


def _probe_pair(nvml: ModuleType, gpus: list[GpuFacts], handles: list, a: int, b: int) -> PairFacts:
    def ask(function_name: str, *args):
        try:
            return getattr(nvml, function_name)(handles[a], handles[b], *args)
        except nvml.NVMLError:
            return None

    both_present = handles[a] is not None and handles[b] is not None
    return PairFacts(
        gpu_a=a,
        gpu_b=b,
        common_ancestor=ask("nvmlDeviceGetTopologyCommonAncestor") if both_present else None,
        p2p_read=ask("nvmlDeviceGetP2PStatus", P2P_CAPS_READ) if both_present else None,
        p2p_write=ask("nvmlDeviceGetP2PStatus", P2P_CAPS_WRITE) if both_present else None,
        nvlinks=min(_nvlinks_between(gpus[a], gpus[b]), _nvlinks_between(gpus[b], gpus[a])),
    )


def probe_nvml(nvml: ModuleType | None, cpu_count: int) -> NvmlFacts:
    if nvml is None:
        return NvmlFacts(status="no_pynvml", error="nvidia-ml-py is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return NvmlFacts(status=INIT_FAILURES.get(type(error).__name__, "failed"), error=f"{type(error).__name__}: {error}")
    try:
        facts = NvmlFacts(status="ok")
        try:
            facts.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
            cuda_version = nvml.nvmlSystemGetCudaDriverVersion()
            facts.cuda_driver_version = (cuda_version // 1000, cuda_version % 1000 // 10)
        except nvml.NVMLError as error:
            facts.error = f"driver version: {error}"
        probed = [_probe_gpu(nvml, index, cpu_count) for index in range(nvml.nvmlDeviceGetCount())]
        facts.gpus = [gpu for gpu, _handle in probed]
        handles = [handle for _gpu, handle in probed]
        _mark_unknown_remotes_as_switches(facts.gpus)
        facts.pairs = [
            _probe_pair(nvml, facts.gpus, handles, a, b)
            for a in range(len(facts.gpus))
            for b in range(a + 1, len(facts.gpus))
        ]
        return facts
    except nvml.NVMLError as error:
        return NvmlFacts(status="failed", error=f"{type(error).__name__}: {error}")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
