"""Whole machines, described as data, for testing check_gpu.py without GPUs.

Each machine is an NVML description (turned into a fake pynvml module), host facts, software facts and an
environment. To see what check_gpu.py prints on one:

    python -m tests.fakes.machines                       # lists the machines
    python -m tests.fakes.machines h100_nvswitch [--json] [--params 7e9 --lora] [--bench] ...
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from check_gpu import main
from src.diagnostics.bandwidth import BenchRequest, run_bench
from src.diagnostics.model_shape import shape_from_model
from src.diagnostics.check import Sources
from src.diagnostics.software import SoftwareFacts, relevant_environment
from src.diagnostics.system import InfinibandPort, SystemFacts

from .fake_pynvml import FakeGpu, FakeMachine, FakeProcess, make_fake_pynvml, real_pynvml

TIB = 1024**4
GIB = 1024**3
SCRIPTED_WORKER = Path(__file__).with_name("scripted_allreduce_worker.py")
LIBRARIES = {
    "trl": "1.16.0",
    "transformers": "5.23.0",
    "peft": "0.21.2",
    "accelerate": "1.15.0",
    "bitsandbytes": "0.50.2",
    "deepspeed": None,
    "datasets": "5.2.0",
    "nvidia-ml-py": "13.615.71",
}


@dataclass
class MachineSpec:
    nvml: FakeMachine
    system: SystemFacts
    software: SoftwareFacts
    environ: dict[str, str] = field(default_factory=dict)
    torch_uuids: list[str] | None = None  # cuda:0, cuda:1, ... as torch would number them; None: CUDA's rules apply
    bench_behaviour: str = "ok"  # see scripted_allreduce_worker.py


def gpu_software(torch_cuda: str = "12.8", nccl: str = "2.27.5") -> SoftwareFacts:
    return SoftwareFacts(
        python="3.11.9",
        platform="Linux-6.8.0-60-generic-x86_64-with-glibc2.39",
        torch=f"2.13.0+cu{torch_cuda.replace('.', '')}",
        torch_cuda=torch_cuda,
        nccl=nccl,
        distributed=True,
        gloo=True,
        nccl_backend=True,
        libraries=dict(LIBRARIES),
    )


def server_system(gpu_count: int, **changes) -> SystemFacts:
    """A two-socket Intel server with active InfiniBand, roomy /dev/shm and a free rendezvous port."""
    facts = SystemFacts(
        hostname="fake-server",
        cpu_model="Intel(R) Xeon(R) Platinum 8480C",
        cpu_vendor="GenuineIntel",
        logical_cpus=224,
        usable_cpus=224,
        sockets=2,
        numa_nodes=[0, 1],
        memory_total_bytes=2 * TIB,
        memory_available_bytes=2 * TIB - 40 * GIB,
        shm_bytes=TIB,
        memlock_bytes=None,
        in_container=False,
        hypervisor=False,
        iommu="off",
        nvidia_pci_devices=gpu_count,
        infiniband_ports=[InfinibandPort(f"mlx5_{index}", "1", "4: ACTIVE", "InfiniBand") for index in range(gpu_count)],
    )
    return replace(facts, **changes)


def workstation_system(gpu_count: int, **changes) -> SystemFacts:
    """A one-socket AMD workstation without InfiniBand."""
    facts = SystemFacts(
        hostname="fake-workstation",
        cpu_model="AMD Ryzen Threadripper 7970X 32-Cores",
        cpu_vendor="AuthenticAMD",
        logical_cpus=64,
        usable_cpus=64,
        sockets=1,
        numa_nodes=[0],
        memory_total_bytes=256 * GIB,
        memory_available_bytes=240 * GIB,
        shm_bytes=128 * GIB,
        memlock_bytes=8 * 1024**2,
        in_container=False,
        hypervisor=False,
        iommu="off",
        nvidia_pci_devices=gpu_count,
    )
    return replace(facts, **changes)


SOCKET_CPUS = {0: tuple(range(0, 56)) + tuple(range(112, 168)), 1: tuple(range(56, 112)) + tuple(range(168, 224))}
H100_BUS_IDS = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
NVSWITCH_BUS_IDS = ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0")
NVSWITCH_LINKS = (5, 4, 4, 5)  # each H100 SXM has 18 NVLinks spread over the four NVSwitches


def h100_nvswitch() -> MachineSpec:
    """8x H100 SXM on NVSwitch (HGX/DGX H100): NV18 everywhere, P2P over NVLink, ready."""
    gpus = []
    for index, bus in enumerate(H100_BUS_IDS):
        socket = index // 4
        links = [("switch", switch) for switch, count in zip(NVSWITCH_BUS_IDS, NVSWITCH_LINKS) for _ in range(count)]
        gpus.append(
            FakeGpu(
                name="NVIDIA H100 80GB HBM3",
                bus_id=f"0000:{bus}:00.0",
                memory_mib=81559,
                compute_capability=(9, 0),
                pcie_path=(f"cpu{socket}", f"hostbridge{index // 2}", f"switch{index}"),
                numa_node=socket,
                cpus=SOCKET_CPUS[socket],
                nvlinks=links,
            )
        )
    return MachineSpec(FakeMachine(gpus), server_system(8), gpu_software())


def rtx4090_pcie(driver_version: str = "565.57.01", cuda_driver_version: int = 12070, torch_cuda: str = "12.6") -> MachineSpec:
    """2x GeForce RTX 4090 on the CPU's PCIe root ports: no P2P, SHM transport, consumer-GPU advice."""
    not_supported = real_pynvml.NVML_ERROR_NOT_SUPPORTED
    gpus = [
        FakeGpu(
            name="NVIDIA GeForce RTX 4090",
            bus_id=f"0000:{bus}:00.0",
            memory_mib=24564,
            compute_capability=(8, 9),
            pcie_path=("cpu0", "hostbridge0", f"rootport{index}"),
            cpus=tuple(range(64)),
            brand=real_pynvml.NVML_BRAND_GEFORCE,
            used_mib=410,
            power_w=22.0,
            power_limit_w=450.0,
            pcie=(1, 4, 16, 16),
            p2p_capable=False,
            failing={
                "nvmlDeviceGetEccMode": not_supported,
                "nvmlDeviceGetRemappedRows": not_supported,
                "nvmlDeviceGetMigMode": not_supported,
            },
        )
        for index, bus in enumerate(("01", "41"))
    ]
    machine = FakeMachine(
        gpus,
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        process_name_error=real_pynvml.NVML_ERROR_NO_PERMISSION,
    )
    return MachineSpec(machine, workstation_system(2), gpu_software(torch_cuda=torch_cuda))


def t4_a100_mixed() -> MachineSpec:
    """A Tesla T4 and an A100 on different host bridges of one socket: mixed models, fp16, no P2P."""
    t4 = FakeGpu(
        name="Tesla T4",
        bus_id="0000:3b:00.0",
        memory_mib=15360,
        compute_capability=(7, 5),
        pcie_path=("cpu0", "hostbridge0", "rootport0"),
        cpus=tuple(range(32)),
        brand=real_pynvml.NVML_BRAND_TESLA,
        power_w=27.0,
        power_limit_w=70.0,
        pcie=(1, 3, 16, 16),
    )
    a100 = FakeGpu(
        name="NVIDIA A100-PCIE-40GB",
        bus_id="0000:86:00.0",
        memory_mib=40960,
        compute_capability=(8, 0),
        pcie_path=("cpu0", "hostbridge1", "rootport1"),
        cpus=tuple(range(32)),
        power_w=35.0,
        power_limit_w=250.0,
        pcie=(1, 4, 16, 16),
    )
    machine = FakeMachine([t4, a100], p2p_overrides={frozenset((0, 1)): real_pynvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED})
    system = server_system(2, sockets=1, numa_nodes=[0], logical_cpus=32, usable_cpus=32, infiniband_ports=[])
    # CUDA's default order puts the fastest GPU first, so cuda:0 is the A100 although nvidia-smi calls it GPU 1.
    return MachineSpec(machine, system, gpu_software(), torch_uuids=[a100.uuid, t4.uuid])


def _a100_sxm(index: int, bus: str, memory_mib: int, peers: list[str], links_per_peer: int, **changes) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB" if memory_mib > 50000 else "NVIDIA A100-SXM4-40GB",
        bus_id=bus,
        memory_mib=memory_mib,
        compute_capability=(8, 0),
        pcie_path=("cpu0", f"hostbridge{index // 2}", f"switch{index // 2}", f"switch{index // 2}.{index % 2}"),
        cpus=tuple(range(64)),
        power_w=60.0,
        power_limit_w=400.0,
        pcie=(4, 4, 16, 16),
        nvlinks=[("gpu", peer) for peer in peers for _ in range(links_per_peer)],
        **changes,
    )


def a100_mig() -> MachineSpec:
    """2x A100 80GB joined by 12 NVLinks, MIG enabled on GPU 1: not ready, launch on GPU 0."""
    buses = ["0000:07:00.0", "0000:0f:00.0"]
    gpus = [
        _a100_sxm(0, buses[0], 81920, [buses[1]], 12),
        _a100_sxm(1, buses[1], 81920, [buses[0]], 12, mig=True),
    ]
    system = server_system(2, sockets=1, numa_nodes=[0], logical_cpus=64, usable_cpus=64, infiniband_ports=[])
    return MachineSpec(FakeMachine(gpus), system, gpu_software())


def a100_ecc() -> MachineSpec:
    """4x A100 40GB (HGX A100 4-GPU, NV4 between every pair); GPU 2 has uncorrected ECC errors and a pending remap."""
    buses = ["0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0"]
    gpus = []
    for index, bus in enumerate(buses):
        broken = {"ecc_uncorrected_volatile": 2, "remapped_rows": (0, 1, 1, 0)} if index == 2 else {}
        gpus.append(_a100_sxm(index, bus, 40960, [peer for peer in buses if peer != bus], 4, **broken))
    system = server_system(4, sockets=1, numa_nodes=[0], logical_cpus=64, usable_cpus=64)
    return MachineSpec(FakeMachine(gpus), system, gpu_software())


def a100_busy() -> MachineSpec:
    """2x A100 80GB with NVLink; someone's 30 GiB process sits on GPU 1: ready with a warning."""
    buses = ["0000:07:00.0", "0000:0f:00.0"]
    busy = [FakeProcess(pid=48213, name="python3", used_gib=30.0)]
    gpus = [
        _a100_sxm(0, buses[0], 81920, [buses[1]], 12),
        _a100_sxm(1, buses[1], 81920, [buses[0]], 12, processes=busy),
    ]
    system = server_system(2, sockets=1, numa_nodes=[0], logical_cpus=64, usable_cpus=64, infiniband_ports=[])
    return MachineSpec(FakeMachine(gpus), system, gpu_software())


def l40s_two_sockets() -> MachineSpec:
    """4x L40S, two behind a PCIe switch on each socket: P2P within a socket, SHM across (SYS)."""
    gpus = [
        FakeGpu(
            name="NVIDIA L40S",
            bus_id=f"0000:{bus}:00.0",
            memory_mib=46068,
            compute_capability=(8, 9),
            pcie_path=(f"cpu{index // 2}", f"hostbridge{index // 2}", f"switch{index // 2}"),
            numa_node=index // 2,
            cpus=SOCKET_CPUS[index // 2],
            power_w=36.0,
            power_limit_w=350.0,
            pcie=(1, 4, 16, 16),
        )
        for index, bus in enumerate(("4f", "52", "ce", "d1"))
    ]
    return MachineSpec(FakeMachine(gpus), server_system(4, infiniband_ports=[]), gpu_software())


def cpu_only() -> MachineSpec:
    """No driver and no NVIDIA device: the CPU path."""
    machine = FakeMachine([], init_error=real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    software = replace(gpu_software(), torch="2.13.0+cpu", torch_cuda=None, nccl=None, nccl_backend=False)
    system = workstation_system(0, cpu_model="Intel(R) Xeon(R) Processor", cpu_vendor="GenuineIntel", logical_cpus=2, usable_cpus=2)
    return MachineSpec(machine, system, software)


MACHINES = {
    "h100_nvswitch": h100_nvswitch,
    "rtx4090_pcie": rtx4090_pcie,
    "t4_a100_mixed": t4_a100_mixed,
    "a100_mig": a100_mig,
    "a100_ecc": a100_ecc,
    "a100_busy": a100_busy,
    "l40s_two_sockets": l40s_two_sockets,
    "cpu_only": cpu_only,
}


def fake_sources(spec: MachineSpec) -> Sources:
    software = replace(spec.software, environment=relevant_environment(spec.environ))

    def scripted_bench(request: BenchRequest):
        environ = {**request.environ, "FAKE_BENCH_BEHAVIOUR": spec.bench_behaviour}
        return run_bench(replace(request, environ=environ), worker_command=(sys.executable, str(SCRIPTED_WORKER)))

    return Sources(
        environ=spec.environ,
        software=lambda: software,
        system=lambda: spec.system,
        nvml=make_fake_pynvml(spec.nvml),
        torch_cuda_uuids=lambda: spec.torch_uuids,
        bench=scripted_bench,
        model_shape=lambda name, subject: shape_from_model(name, spec.environ, subject),
    )


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MACHINES:
        print("usage: python -m tests.fakes.machines MACHINE [check_gpu.py flags]\nmachines: " + ", ".join(MACHINES))
        sys.exit(0 if len(sys.argv) < 2 else 3)
    sys.exit(main(sys.argv[2:], sources=fake_sources(MACHINES[sys.argv[1]]())))
