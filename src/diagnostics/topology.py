"""The `nvidia-smi topo -m` matrix rebuilt from NVML, the P2P matrix, and the transport NCCL will pick per pair.

NCCL's rule (src/graph/paths.cc, ncclTopoCheckP2p; src/transport/shm.cc): two GPUs of one node use P2P when
their path is no longer than the P2P level and NVML reports P2P read and write OK. The level defaults to PXB
(PCIe switches, not through the CPU); on AMD x86 CPUs with at most two GPUs it is SYS; NCCL_P2P_LEVEL sets it,
NCCL_P2P_DISABLE=1 makes it LOC (no P2P). An NVLink pair whose P2P NVML reports broken makes NCCL abort unless
NCCL_IGNORE_DISABLED_P2P=1. Without P2P, the pair goes through host shared memory (SHM, /dev/shm) unless
NCCL_SHM_DISABLE=1, and then through the network transport (sockets or InfiniBand).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .nvml_probe import PairFacts
from .software import is_truthy

# NVML_TOPOLOGY_* -> nvidia-smi's label. INTERNAL (0) is two GPUs on one board, shown as PIX.
ANCESTOR_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
MATRIX_LEGEND = (
    "X = self, NV# = # NVLinks, PIX = one PCIe switch, PXB = several PCIe switches, "
    "PHB = PCIe host bridge (CPU), NODE = between host bridges of one NUMA node, SYS = across CPU sockets"
)
# NVML_P2P_STATUS_* -> the labels of `nvidia-smi topo -p2p r`.
P2P_LABELS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}
P2P_REASONS = {
    1: "chipset not supported",
    2: "GPU not supported",
    3: "topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}
P2P_LEGEND = "OK = read and write OK, CNS = chipset, GNS = GPU, TNS = topology not supported, DR = disabled by regkey, NS = not supported, U = unknown"
P2P_STATUS_OK = 0

# NCCL's path types in its own order (topoPathTypeStr); only the order matters for the comparisons below.
NCCL_PATH_ORDER = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET")
# nvidia-smi label -> NCCL path type. NCCL calls any route through the CPU PHB, whether one host bridge or two.
NCCL_PATH_OF_LABEL = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}
# Old numeric NCCL_P2P_LEVEL values.
NCCL_OLD_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")

TRANSPORT_LABELS = {"P2P/NVLink": "NVL", "P2P/PCIe": "P2P", "SHM": "SHM", "NET": "NET", "fails": "ERR"}
TRANSPORT_LEGEND = "NVL = P2P over NVLink, P2P = P2P over PCIe, SHM = through host shared memory, NET = network transport, ERR = NCCL refuses"


@dataclass
class Transport:
    kind: str  # "P2P/NVLink", "P2P/PCIe", "SHM", "NET" or "fails"
    reason: str

    @property
    def label(self) -> str:
        return TRANSPORT_LABELS[self.kind]


def link_label(pair: PairFacts) -> str:
    if pair.nvlinks:
        return f"NV{pair.nvlinks}"
    return ANCESTOR_LABELS.get(pair.common_ancestor, "?")


def p2p_ok(pair: PairFacts) -> bool:
    return pair.p2p_read == P2P_STATUS_OK and pair.p2p_write == P2P_STATUS_OK


def p2p_label(pair: PairFacts) -> str:
    if p2p_ok(pair):
        return "OK"
    failing = pair.p2p_read if pair.p2p_read != P2P_STATUS_OK else pair.p2p_write
    return P2P_LABELS.get(failing, "U")


def p2p_reason(pair: PairFacts) -> str:
    failing = pair.p2p_read if pair.p2p_read != P2P_STATUS_OK else pair.p2p_write
    return P2P_REASONS.get(failing, "unknown")


def nccl_path(pair: PairFacts) -> str | None:
    if pair.nvlinks:
        return "NVL"
    return NCCL_PATH_OF_LABEL.get(ANCESTOR_LABELS.get(pair.common_ancestor, ""))


def within_p2p_level(path: str | None, level: str) -> bool:
    return path is not None and NCCL_PATH_ORDER.index(path) <= NCCL_PATH_ORDER.index(level)


def p2p_level(nccl_settings: Mapping[str, str], cpu_vendor: str | None, gpu_count: int) -> tuple[str, str]:
    """The farthest path NCCL allows P2P over, and why."""
    if nccl_settings.get("NCCL_P2P_DISABLE", "").strip() == "1":
        return "LOC", "NCCL_P2P_DISABLE=1"
    level = nccl_settings.get("NCCL_P2P_LEVEL", "").strip().upper()
    if level in NCCL_PATH_ORDER:
        return level, f"NCCL_P2P_LEVEL={level}"
    if level.isdigit():
        return NCCL_OLD_LEVELS[min(int(level), len(NCCL_OLD_LEVELS) - 1)], f"NCCL_P2P_LEVEL={level}"
    if cpu_vendor == "AuthenticAMD" and gpu_count <= 2:
        return "SYS", "NCCL default on AMD CPUs with at most 2 GPUs"
    return "PXB", "NCCL default"


def nccl_transport(pair: PairFacts, level: str, nccl_settings: Mapping[str, str]) -> Transport:
    path = nccl_path(pair)
    if path is None:
        return Transport("SHM" if not is_truthy(nccl_settings.get("NCCL_SHM_DISABLE")) else "NET", "topology unknown")
    if within_p2p_level(path, level):
        if p2p_ok(pair):
            return Transport("P2P/NVLink" if path == "NVL" else "P2P/PCIe", f"path {path} within P2P level {level}")
        if path == "NVL" and not is_truthy(nccl_settings.get("NCCL_IGNORE_DISABLED_P2P")):
            return Transport("fails", f"NVLink pair but NVML P2P {p2p_reason(pair)}: NCCL aborts")
        reason = f"NVML P2P {p2p_reason(pair)}"
    else:
        reason = f"path {path} beyond P2P level {level}"
    if is_truthy(nccl_settings.get("NCCL_SHM_DISABLE")):
        return Transport("NET", f"{reason}; NCCL_SHM_DISABLE=1")
    return Transport("SHM", reason)


def cpu_ranges(cpus: list[int] | None) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3,8-9', as nvidia-smi writes CPU affinity."""
    if not cpus:
        return "N/A"
    ranges = []
    start = previous = cpus[0]
    for cpu in cpus[1:] + [None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        ranges.append(f"{start}-{previous}" if previous != start else str(start))
        if cpu is not None:
            start = previous = cpu
    return ",".join(ranges)
