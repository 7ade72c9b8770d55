"""What this process may use of the machine it runs on: its cores and its memory as a container, Slurm or `taskset`
grants them, not as the machine has them. The one answer for everything that sizes a pool or a thread count: data
preparation's workers (src/data/), check_gpu's CPU process count (src/diagnostics/system.py), each CPU process's
torch threads (src/distributed.py) and run_distributed.sh's OMP_NUM_THREADS (`python -m src.resource_limits N`).

- Cores: the CPU affinity (what Slurm, `taskset`, `docker --cpuset-cpus` give), bounded by a cgroup CPU quota
  (`docker --cpus`, a Kubernetes CPU limit, Slurm's cgroup), rounded down, at least 1. A pod limited to 4 CPUs on a
  128-core node may use 4: its affinity still lists all 128, and `os.cpu_count()` and `nproc` say 128 too.
- Memory: the cgroup memory limit (`docker -m`, a Kubernetes memory limit), None when unlimited. /proc/meminfo in a
  container shows the host's memory.
- cgroup v2 (`cpu.max`, `memory.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.limit_in_bytes`):
  the process's own cgroup (named in /proc/self/cgroup) and each ancestor this mount namespace shows, the tightest
  limit winning: a Slurm job's or a systemd slice's limit sits on its own cgroup, deep in the host's tree; a
  container with its own cgroup namespace sees its limit at the root.

The test seam cgroup_tree (src/seams.py): <dir> reads `<dir>/proc_self_cgroup` for /proc/self/cgroup and
`<dir>/sys_fs_cgroup/` for /sys/fs/cgroup (a fake quota); not planted outside tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from src import seams

UNLIMITED_V1 = 1 << 60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(controller: str) -> list[Path]:
    """The cgroup directories whose files limit this process for `controller` ("cpu", "memory"), innermost first."""
    fake = seams.get("cgroup_tree")
    root = Path(fake) / "sys_fs_cgroup" if fake else Path("/sys/fs/cgroup")
    membership = _read(Path(fake) / "proc_self_cgroup" if fake else Path("/proc/self/cgroup")) or ""
    found: list[Path] = []
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:  # cgroup v2 ("0::/path"): the unified tree, mounted at the root or at unified/ (hybrid)
            mounts = [root] if (root / "cgroup.controllers").exists() else [root / "unified"]
        elif controller in controllers.split(","):  # v1: the controller's own tree ("cpu,cpuacct" or "cpu")
            mounts = [root / controllers, root / controller]
        else:
            continue
        mount = next((mount for mount in mounts if mount.is_dir()), None)
        if mount is None:
            continue
        # The cgroup itself and its ancestors; a path this mount does not show (a container's view of the host's
        # tree, without a cgroup namespace) is skipped, and the mount's root is the container's own cgroup.
        relative = Path(path.lstrip("/"))
        for directory in (mount / relative, *(mount / parent for parent in relative.parents)):
            if directory.is_dir() and directory not in found:
                found.append(directory)
    return found


def cpu_quota() -> float | None:
    """CPUs a cgroup quota grants this process (2.5 for `--cpus 2.5`), None when no quota bounds it."""
    quotas = []
    for directory in _cgroup_dirs("cpu"):
        v2 = (_read(directory / "cpu.max") or "").split()
        if v2 and v2[0] != "max" and v2[0].isdigit():
            quotas.append(int(v2[0]) / int(v2[1] if len(v2) > 1 and v2[1].isdigit() else 100_000))
        quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
        if quota and period and quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit():
            quotas.append(int(quota) / int(period))
    return min(quotas, default=None)


def memory_limit_bytes() -> int | None:
    """Bytes a cgroup memory limit grants this process, None when unlimited."""
    limits = []
    for directory in _cgroup_dirs("memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):  # v2, v1
            text = _read(directory / name) or ""
            if text.isdigit() and int(text) < UNLIMITED_V1:
                limits.append(int(text))
    return min(limits, default=None)


def usable_cores() -> int:
    """How many cores this process may use: its CPU affinity, bounded by its cgroup CPU quota (rounded down), >= 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, int(quota))  # a fraction of a core more would only be throttled
    return max(1, cores)


def threads_per_process(processes: int) -> int:
    """Each of `processes` processes' share of the usable cores (torch's threads, OMP_NUM_THREADS), >= 1."""
    return max(1, usable_cores() // max(1, processes))


if __name__ == "__main__":  # python -m src.resource_limits [PROCESSES]: the threads each of PROCESSES may use
    print(threads_per_process(int(sys.argv[1]) if len(sys.argv) > 1 else 1))
