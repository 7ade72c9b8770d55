"""The host and the launch's settings: shared memory for NCCL, the rendezvous port, InfiniBand, locked memory, a multi-
node launch, and NCCL or CUDA settings left over from an older fix."""

from __future__ import annotations

from src.diagnostics.memory_plan import GIB
from src.diagnostics.problems.interconnect import consumer_launch, pairs_text
from src.diagnostics.problems.machine import ERROR, WARNING, Machine, Problem
from src.diagnostics.software import is_truthy
from src.diagnostics.topology import nccl_transport, p2p_level


SHM_FAILS_BYTES = 256 * 1024**2
SHM_WARN_BYTES = GIB


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
    if machine.nccl_settings.get("NCCL_P2P_DISABLE") != "1" or consumer_launch(machine):
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
            f"{pairs_text(would_use_p2p)}: the setting costs bandwidth",
            "unset NCCL_P2P_DISABLE (run --bench to confirm P2P is sound)",
        )
    ]
