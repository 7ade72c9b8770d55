"""Host facts: CPU, memory, /dev/shm, memlock, container/VM/IOMMU, NVIDIA devices on the PCI bus, InfiniBand
ports, and whether the rendezvous port is free. Read from /proc and /sys; anything unreadable is None."""

from __future__ import annotations

import os
import platform
import resource
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from src.resource_limits import memory_limit_bytes, usable_cores

from .inputs import InputError

DEFAULT_MASTER_PORT = 29500
NVIDIA_PCI_VENDOR = "0x10de"
# PCI class 0x03xxxx is a display or 3D controller: the GPUs. NVSwitches (0x0680xx) and audio functions are not.
DISPLAY_CLASS_PREFIX = "0x03"


@dataclass
class InfinibandPort:
    device: str
    port: str
    state: str  # e.g. "4: ACTIVE"
    link_layer: str  # "InfiniBand", or "Ethernet" for RoCE

    @property
    def active(self) -> bool:
        return "ACTIVE" in self.state.upper()


@dataclass
class SystemFacts:
    hostname: str
    cpu_model: str | None
    cpu_vendor: str | None  # "GenuineIntel", "AuthenticAMD", ...; NCCL's P2P default depends on it
    logical_cpus: int
    usable_cpus: int  # after affinity and a container's CPU quota
    sockets: int | None
    numa_nodes: list[int]
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    shm_bytes: int | None
    memlock_bytes: int | None  # None means unlimited
    in_container: bool
    hypervisor: bool
    iommu: str  # "off", "passthrough", "translated" or "unknown"
    nvidia_pci_devices: int
    infiniband_ports: list[InfinibandPort] = field(default_factory=list)
    rendezvous_port: int = DEFAULT_MASTER_PORT
    rendezvous_port_free: bool | None = True  # None: not checked here (the store runs on node rank 0)
    free_port: int | None = None  # a port found free, offered when the rendezvous port is taken


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _cpuinfo_field(cpuinfo: str, name: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _socket_count() -> int | None:
    packages = {
        text.strip()
        for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id")
        if (text := _read(path)) is not None
    }
    return len(packages) or None


def _numa_nodes() -> list[int]:
    return sorted(int(path.name[4:]) for path in Path("/sys/devices/system/node").glob("node[0-9]*"))


def _meminfo_bytes(name: str) -> int | None:
    value = _cpuinfo_field(_read("/proc/meminfo") or "", name)
    return int(value.split()[0]) * 1024 if value else None


def _shm_bytes() -> int | None:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def _memlock_bytes() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _in_container(environ: Mapping[str, str]) -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists() or "KUBERNETES_SERVICE_HOST" in environ:
        return True
    cgroup = _read("/proc/1/cgroup") or ""
    return any(marker in cgroup for marker in ("docker", "kubepods", "containerd", "lxc"))


def _iommu_mode() -> str:
    groups = Path("/sys/kernel/iommu_groups")
    if not groups.is_dir():
        return "unknown"
    if not any(groups.iterdir()):
        return "off"
    cmdline = _read("/proc/cmdline") or ""
    return "passthrough" if "iommu=pt" in cmdline else "translated"


def _nvidia_pci_devices() -> int:
    count = 0
    for device in Path("/sys/bus/pci/devices").glob("*"):
        vendor, device_class = _read(device / "vendor"), _read(device / "class")
        if vendor and device_class and vendor.strip() == NVIDIA_PCI_VENDOR and device_class.startswith(DISPLAY_CLASS_PREFIX):
            count += 1
    return count


def _infiniband_ports() -> list[InfinibandPort]:
    ports = []
    for port_dir in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        ports.append(
            InfinibandPort(
                device=port_dir.parent.parent.name,
                port=port_dir.name,
                state=(_read(port_dir / "state") or "unknown").strip(),
                link_layer=(_read(port_dir / "link_layer") or "unknown").strip(),
            )
        )
    return ports


def port_is_free(port: int) -> bool:
    # SO_REUSEADDR like the c10d TCPStore, so a socket lingering in TIME_WAIT does not count as "in use".
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def rendezvous_port(environ: Mapping[str, str]) -> int:
    text = environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise InputError(f"MASTER_PORT={text!r} in the environment is not a port number: unset it or use e.g. 29500")
    return int(text)


def collect_system(environ: Mapping[str, str]) -> SystemFacts:
    cpuinfo = _read("/proc/cpuinfo") or ""
    memory_limit = memory_limit_bytes()  # /proc/meminfo in a container is the host's
    memory_total = _meminfo_bytes("MemTotal")
    memory_available = _meminfo_bytes("MemAvailable")
    if memory_limit is not None:
        memory_total = min(memory_total or memory_limit, memory_limit)
        memory_available = min(memory_available or memory_limit, memory_limit)
    port = rendezvous_port(environ)
    # Only the node that hosts the rendezvous store (node rank 0) binds the port.
    port_free = port_is_free(port) if environ.get("NODE_RANK", "0") == "0" else None
    return SystemFacts(
        hostname=socket.gethostname(),
        cpu_model=_cpuinfo_field(cpuinfo, "model name") or platform.processor() or None,
        cpu_vendor=_cpuinfo_field(cpuinfo, "vendor_id"),
        logical_cpus=os.cpu_count() or 1,
        usable_cpus=usable_cores(),
        sockets=_socket_count(),
        numa_nodes=_numa_nodes(),
        memory_total_bytes=memory_total,
        memory_available_bytes=memory_available,
        shm_bytes=_shm_bytes(),
        memlock_bytes=_memlock_bytes(),
        in_container=_in_container(environ),
        hypervisor="hypervisor" in (_cpuinfo_field(cpuinfo, "flags") or "").split(),
        iommu=_iommu_mode(),
        nvidia_pci_devices=_nvidia_pci_devices(),
        infiniband_ports=_infiniband_ports(),
        rendezvous_port=port,
        rendezvous_port_free=port_free,
        free_port=None if port_free in (True, None) else find_free_port(),
    )
