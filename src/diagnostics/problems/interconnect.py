"""Between the GPUs: NVLink or PCIe peer-to-peer that is broken, unavailable or unreliable (consumer cards, virtual
machines), the NCCL settings that work around it, and GPUs split across CPU sockets.
"""

from __future__ import annotations

import re

from src.diagnostics.nvml_probe import GpuFacts, PairFacts
from src.diagnostics.problems.machine import (ERROR, WARNING, Machine, Problem, gpu_indices, version_tuple,
                                              pinned_gpus_prefix)
from src.diagnostics.topology import link_label, nccl_path, p2p_ok, p2p_reason, within_p2p_level


VIRTUALIZATION_PASSTHROUGH, VIRTUALIZATION_VGPU = 1, 2
# Consumer GPUs whose P2P over PCIe is unsupported or unreliable; NCCL has hung on them where the driver still
# reported P2P. accelerate refuses to start on the RTX 40 series with a driver older than 550.40.07 unless both
# NCCL_P2P_DISABLE and NCCL_IB_DISABLE are set (accelerate.utils.environment.check_cuda_p2p_ib_support).
CONSUMER_P2P_PATTERN = re.compile(r"RTX (40|50)\d\d")
ACCELERATE_RTX40_MIN_DRIVER = (550, 40, 7)


def pairs_text(pairs: list[PairFacts]) -> str:
    return ", ".join(f"{pair.gpu_a}-{pair.gpu_b}" for pair in pairs)


def consumer_launch(machine: Machine) -> bool:
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
            f"GPU pairs {pairs_text(broken)} are joined by NVLink but the driver reports P2P {p2p_reason(broken[0])}: "
            "NCCL aborts ('P2P is disabled between NVLINK connected GPUs')",
            "on NVSwitch systems start the fabric manager (sudo systemctl start nvidia-fabricmanager) and check "
            "nvidia-smi nvlink -s; to run without P2P meanwhile, NCCL_P2P_DISABLE=1 (the command sets it)",
            gpus=sorted({pair.gpu_a for pair in broken} | {pair.gpu_b for pair in broken}),
            command_env={"NCCL_P2P_DISABLE": "1"},
            worked_around=True,
        )
    ]


def p2p_unavailable(machine: Machine) -> list[Problem]:
    if consumer_launch(machine):
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
            f"P2P is unavailable between GPUs {pairs_text(unavailable)} ({p2p_reason(unavailable[0])}) although their "
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
    if not cause or not pcie_p2p or verified or consumer_launch(machine):
        return []
    return [
        Problem(
            WARNING,
            "p2p_unreliable",
            f"GPUs {pairs_text(pcie_p2p)} will use P2P over PCIe under {cause}: there it often hangs or corrupts data",
            "run python check_gpu.py --bench: it catches a hang or a wrong sum and retries without P2P. If P2P fails, "
            "use NCCL_P2P_DISABLE=1, or boot with iommu=pt and disable PCIe ACS",
            gpus=sorted({pair.gpu_a for pair in pcie_p2p} | {pair.gpu_b for pair in pcie_p2p}),
        )
    ]


def consumer_gpus(machine: Machine) -> list[Problem]:
    if not consumer_launch(machine):
        return []
    names = sorted({machine.gpu(index).name for index in machine.launch_gpus})
    env = {"NCCL_P2P_DISABLE": "1"}
    what = (
        f"consumer GPUs ({', '.join(names)}): P2P between them is unsupported or unreliable, and NCCL has hung on "
        "such machines even where the driver reported P2P"
    )
    driver_version = version_tuple(machine.nvml.driver_version)
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
    groups = "; ".join(f"NUMA node {node}: GPUs {gpu_indices(indices)}" for node, indices in by_node.items())
    largest_group = max(by_node.values(), key=len)
    return [
        Problem(
            WARNING,
            "cross_socket",
            f"GPU pairs {pairs_text(crossing)} talk across CPU sockets (SYS): NCCL goes through host memory and the "
            f"socket interconnect, well below PCIe speed ({groups})",
            f"if the model fits on one socket's GPUs, {pinned_gpus_prefix(machine, largest_group)} ./run_distributed.sh "
            f"{len(largest_group)}; otherwise keep each process on its GPU's NUMA node (torchrun --numa-binding=node) "
            "and measure with --bench",
            gpus=sorted({pair.gpu_a for pair in crossing} | {pair.gpu_b for pair in crossing}),
        )
    ]
