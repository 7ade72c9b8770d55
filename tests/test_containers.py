"""What "this machine" is inside a container (docs/reliability.md, "Containers: what this machine is"): each place the
toolkit reads it from a name that containers share or hide, shown with a real namespace (`unshare`) or a fake.

- The run directory's hold: a launch in another PID namespace of the same host (same host name, same boot id, as
  two pods with host networking on one node) cannot see the holder's pid, so it is refused while the holder's
  heartbeat beats, and takes a dead holder's hold over once the heartbeat is stale.
- The cores this process may use: affinity and the cgroup CPU quota (v1 and v2, a fake cgroup tree), for data
  preparation's workers, check_gpu and run_distributed.sh's threads; the memory limit likewise.
- /dev/shm: what the container mounts there (a mount namespace with a small tmpfs), not the host's.
- The launcher's leftover directory in a shared TMPDIR: a live launch in another PID namespace is left alone.

`unshare` needs root (or user namespaces). Outside CI a machine without it skips with the reason; in CI (CI=true,
where the tests run as root) it fails, so the test cannot silently stop running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, plant, preference_rows, write_jsonl
from src import resource_limits, seams
from src.diagnostics.system import collect_system
from src.run_safety.run_lock import STALE_AFTER_S, RunDirectoryHeld, acquire, hold_path
from test_resilience import job_args

NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]  # its end ends what runs in it


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"container test cannot run in CI: {reason} (CI runs as root and must run it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def pid_namespaces():
    """`unshare --pid --fork --mount-proc` works here: a command in it runs as pid 1 of a namespace of its own."""
    if shutil.which("unshare") is None:
        unavailable("unshare (util-linux) is not installed")
    probe = subprocess.run([*NEW_PID_NAMESPACE, "sh", "-c", "echo $$; readlink /proc/self/ns/pid"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        unavailable(f"unshare --pid refused here: {probe.stderr.strip()[:200]}")
    pid, namespace = probe.stdout.split()
    assert pid == "1" and namespace != os.readlink("/proc/self/ns/pid"), probe.stdout
    return NEW_PID_NAMESPACE


HOLD_AND_WAIT = """
import os, sys, time
from pathlib import Path
from src.run_safety.run_lock import acquire
hold = acquire(Path(sys.argv[1]))
print("held", os.getpid(), flush=True)
if sys.argv[2] == "die":
    os._exit(0)  # gone without releasing: as a kill -9 or a lost container leaves it
time.sleep(300)
"""


def holder(run_dir: Path, *, namespace: list[str] = (), die: bool = False) -> subprocess.Popen:
    """A process that takes the hold on `run_dir` (in `namespace`, if given) and keeps it beating, or dies at once."""
    process = subprocess.Popen([*namespace, sys.executable, "-c", HOLD_AND_WAIT, str(run_dir), "die" if die else "live"],
                               cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert line.startswith("held"), line + process.stderr.read()
    return process


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=30)


def test_a_launch_in_another_pid_namespace_is_refused_in_one_line(pid_namespaces, tiny_model, tmp_path):
    """The issue's case: a job holds the run directory; the same command started in another PID namespace of this
    host (same host name, same boot id, shared results) cannot see the holder's pid. It used to take the hold over
    ("its process N is gone") and train into the live run; it is refused, in one line, and changes nothing."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(40))
    results, run_dir = tmp_path / "results", tmp_path / "results" / "job"
    live = holder(run_dir)
    try:
        before = hold_path(run_dir).read_text()
        second = subprocess.run([*pid_namespaces, "bash", "run_distributed.sh", "2",
                                 *job_args(tiny_model, data, results, steps=3)], cwd=PROJECT_ROOT,
                                env=os.environ | {"PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
        assert live.poll() is None, "the holder must still be alive for the refusal to mean anything"
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        (line,) = [line for line in second.stderr.splitlines() if line.strip()]
        recorded = json.loads(before)
        assert line.startswith(f"error: {run_dir} is in use by another job: host {socket.gethostname()}, pid "
                               f"{recorded['pid']} in another PID namespace of this machine (another container) "
                               f"(pid {recorded['pid']} on "), line
        assert "last heartbeat" in line and "--run_name" in line
        assert hold_path(run_dir).read_text() == before and not run_dir.exists(), "the refused launch touched nothing"

        # The workers' own path (acquire, not the preflight's check) refuses it too.
        worker = subprocess.run([*pid_namespaces, sys.executable, "-c",
                                 "import sys; from pathlib import Path; from src.run_safety.run_lock import acquire; "
                                 "acquire(Path(sys.argv[1]))", str(run_dir)],
                                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
        assert worker.returncode != 0 and "RunDirectoryHeld" in worker.stderr and "in use by another job" in worker.stderr
    finally:
        stop(live)


def test_two_containers_whose_launches_have_the_same_pid_are_two_jobs(pid_namespaces, tmp_path):
    """A fresh PID namespace hands out the same small pids: the launch in each of two containers runs as pid 1. The
    job's name carries its PID namespace, so the second is not taken for a restart of the first (which would take
    the live hold as its own)."""
    run_dir = tmp_path / "results" / "job"
    first = holder(run_dir, namespace=pid_namespaces)
    try:
        assert json.loads(hold_path(run_dir).read_text())["pid"] == 1
        second = subprocess.run([*pid_namespaces, sys.executable, "-c", HOLD_AND_WAIT, str(run_dir), "die"],
                                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "in use by another job" in second.stderr, second.stdout + second.stderr
        assert first.poll() is None and json.loads(hold_path(run_dir).read_text())["pid"] == 1
    finally:
        stop(first)


def test_a_dead_holder_in_another_pid_namespace_is_taken_over_once_its_heartbeat_is_stale(pid_namespaces, tmp_path):
    """A job in another container that really died: its pid cannot be looked up from here, so its hold counts until
    its heartbeat is STALE_AFTER_S old (aged here with utime, as a stopped heartbeat leaves it), then is taken over."""
    run_dir = tmp_path / "results" / "job"
    dead = holder(run_dir, namespace=pid_namespaces, die=True)
    dead.wait(timeout=30)
    with pytest.raises(RunDirectoryHeld, match="in another PID namespace of this machine"):
        acquire(run_dir)  # pid 1 of its namespace is not our pid 1, alive as it is: judged by the heartbeat alone
    stamp = time.time() - STALE_AFTER_S - 30
    os.utime(hold_path(run_dir), (stamp, stamp))
    hold = acquire(run_dir)
    try:
        assert hold.took_over and "heartbeat stopped" in hold.took_over
        assert json.loads(hold_path(run_dir).read_text())["pid"] == os.getpid()
    finally:
        hold.release()


# --- the cores and the memory this process may use -----------------------------------------------------------------

def fake_cgroup(root: Path, membership: str, files: dict[str, str]) -> Path:
    """A cgroup tree for the seam cgroup_tree: /proc/self/cgroup's text and files under /sys/fs/cgroup."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "proc_self_cgroup").write_text(membership)
    for name, text in files.items():
        (root / "sys_fs_cgroup" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "sys_fs_cgroup" / name).write_text(text)
    return root


def test_a_cgroup_quota_bounds_the_cores_v1_and_v2(tmp_path, monkeypatch):
    """A pod granted 1.5 CPUs may use 1 core whatever its affinity lists; the limit may sit on the process's own cgroup
    deep in the host's tree (a Slurm job, a systemd slice) or on an ancestor, the tightest winning."""
    affinity = len(os.sched_getaffinity(0))
    v2 = fake_cgroup(tmp_path / "v2", "0::/kubepods/pod1/ctr\n", {
        "cgroup.controllers": "cpu memory", "kubepods/pod1/ctr/cpu.max": "max 100000",
        "kubepods/pod1/cpu.max": "150000 100000", "kubepods/pod1/ctr/memory.max": "max",
        "kubepods/memory.max": str(6 << 30), "kubepods/pod1/memory.max": str(4 << 30)})
    v1 = fake_cgroup(tmp_path / "v1", "5:memory:/slurm/job_7\n3:cpu,cpuacct:/slurm/job_7\n1:name=systemd:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/slurm/job_7/cpu.cfs_quota_us": "50000", "cpu,cpuacct/slurm/job_7/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/slurm/job_7/memory.limit_in_bytes": str(3 << 30)})
    unlimited = fake_cgroup(tmp_path / "none", "0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "max 100000"})
    for tree, quota, cores, memory in ((v2, 1.5, 1, 4 << 30), (v1, 0.5, 1, 3 << 30), (unlimited, None, affinity, None)):
        plant(monkeypatch, cgroup_tree=str(tree))
        assert (resource_limits.cpu_quota(), resource_limits.usable_cores(), resource_limits.memory_limit_bytes()) \
            == (quota, min(cores, affinity), memory), tree
        facts = collect_system({})  # check_gpu's numbers are the same answer
        assert facts.usable_cpus == min(cores, affinity)
        if memory:
            assert facts.memory_total_bytes == memory
    # A container without a cgroup namespace sees the host's path in /proc/self/cgroup but its own cgroup mounted at
    # the root: the path it cannot see is skipped and the root's limit counts.
    plant(monkeypatch, cgroup_tree=str(fake_cgroup(tmp_path / "docker", "1:cpu:/docker/abc\n", {
        "cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"})))
    assert resource_limits.cpu_quota() == 1.0 and resource_limits.usable_cores() == 1


def test_the_affinity_bounds_the_cores(tmp_path):
    """`taskset` (or Slurm's --cpus-per-task, docker --cpuset-cpus) leaves one core: one core, one thread each."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    environ = {key: value for key, value in os.environ.items() if key != seams.VARIABLE}
    one = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "src.resource_limits"], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=60, env=environ, check=True)
    assert one.stdout.strip() == "1"


def test_data_preparation_and_the_launcher_use_the_quota(tiny_tokenizer, tmp_path, monkeypatch):
    """The pod limited to fewer CPUs than its node shows: preparation starts one worker per granted core, not per core
    of the node, and run_distributed.sh gives each process its share of the granted cores as OMP_NUM_THREADS."""
    import src.data as data_module
    import src.data.prepare as preparation  # where prepare_data calls the map
    from src.config import DataArguments, SFTArguments

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to tell the quota from the affinity")
    one_cpu = fake_cgroup(tmp_path / "cgroup", "0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "100000 100000"})
    workers = []  # the processes asked of each split's map, per preparation
    real_map = preparation.map_with_progress

    def counting(dataset, function, fn_kwargs, features, label, num_proc, work):
        workers.append(num_proc)
        return real_map(dataset, function, fn_kwargs, features, label, num_proc, work)

    monkeypatch.setattr(preparation, "map_with_progress", counting)
    rows = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    asked = {}
    for quota, cache in ((None, "free"), (one_cpu, "quota")):
        if quota:
            plant(monkeypatch, cgroup_tree=str(quota))
        workers.clear()
        data_module.prepare_data(DataArguments(dataset_name=str(rows), max_length=64, val_size=2, test_size=2),
                                 SFTArguments(), "dpo", 0, tiny_tokenizer, tmp_path / cache)
        asked[cache] = set(workers)
    assert asked == {"free": {len(os.sched_getaffinity(0))}, "quota": {1}}

    fake = tmp_path / "python"  # the preflight passes; "torchrun" reports the threads it was given
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  "-m src.main_distributed --dry_run"*) exit 0 ;;
  "-m src.run_safety.parent_watch"*) echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"; exit 0 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    fake.chmod(0o755)
    environ = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", seams.VARIABLE)}
    threads = {}
    for name, extra in (("free", {}), ("quota", seams.env({}, cgroup_tree=str(one_cpu)))):
        launched = subprocess.run(["bash", "run_distributed.sh", "1"], cwd=PROJECT_ROOT, capture_output=True,
                                  text=True, timeout=120, env=environ | {"PYTHON": str(fake), "TMPDIR": str(tmp_path)}
                                  | extra)
        assert launched.returncode == 0, launched.stderr[-2000:]
        threads[name] = launched.stdout.strip().splitlines()[-1]
    assert threads == {"free": f"OMP_NUM_THREADS={len(os.sched_getaffinity(0))}", "quota": "OMP_NUM_THREADS=1"}


def test_each_process_takes_its_share_of_the_quota_as_torch_threads(tmp_path):
    """Started without a launcher that sets OMP_NUM_THREADS (`python -m src.main_distributed`, SageMaker), torch would
    size its thread pool by the node's cores; the process group's start gives it the quota's share instead."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to tell the quota from the affinity")
    script = ("import types, torch; from src.world import World; from src.distributed import init; "
              "init(types.SimpleNamespace(device='cpu', backend='gloo'), World.from_environment()); "
              "print(torch.get_num_threads())")
    one_cpu = fake_cgroup(tmp_path / "cgroup", "0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "100000 100000"})
    environ = {key: value for key, value in os.environ.items()
               if key not in ("OMP_NUM_THREADS", seams.VARIABLE, "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    threads = [subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=120, env=environ | extra, check=True).stdout.split()[-1]
               for extra in ({}, seams.env({}, cgroup_tree=str(one_cpu)))]
    assert threads == [str(len(os.sched_getaffinity(0))), "1"]


# --- the launcher's directory in a shared TMPDIR -------------------------------------------------------------------

def test_a_live_launch_in_another_pid_namespace_keeps_its_directory(pid_namespaces, tmp_path):
    """run_distributed.sh removes the directories that killed launches left in TMPDIR, judging each launcher by its
    pid. A TMPDIR shared with another container (a shared /tmp, a TMPDIR on a shared volume) holds launches whose pids
    that container cannot see: a launch there leaves them alone, as it leaves a live one here."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    here = f"{os.readlink('/proc/self/ns/pid')}@{Path('/proc/sys/kernel/random/boot_id').read_text().strip()}"
    start = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    live = temporary / "prefkit-launch.live"  # a launch of this namespace, still running: this test stands for it
    live.mkdir()
    (live / "launcher").write_text(f"{os.getpid()} {start} {here}\n")
    killed = temporary / "prefkit-launch.killed"  # one an earlier launch in that container left: its launcher is gone
    killed.mkdir()
    (killed / "launcher").write_text("999999 1\n")
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  "-m src.main_distributed --dry_run"*) exit 0 ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    fake.chmod(0o755)
    subprocess.run([*pid_namespaces, "bash", "run_distributed.sh", "2", "--dry_run"], cwd=PROJECT_ROOT, check=True,
                   capture_output=True, timeout=120, env=os.environ | {"PYTHON": str(fake), "TMPDIR": str(temporary)})
    assert sorted(temporary.glob("prefkit-launch.*")) == [live], "the other namespace's live launch kept"


# --- /dev/shm ------------------------------------------------------------------------------------------------------

def test_check_gpu_reads_the_containers_own_dev_shm(tmp_path):
    """NCCL's shared-memory transport and DataLoader workers use the /dev/shm the container mounts (Docker's default:
    a 64 MiB tmpfs of its own; Kubernetes: the same unless an emptyDir of medium Memory), not the host's. check_gpu
    reads it there: in a mount namespace with a 64 MiB tmpfs at /dev/shm, it says 64 MiB."""
    if shutil.which("unshare") is None:
        unavailable("unshare (util-linux) is not installed")
    script = ("import json; from src.diagnostics.system import collect_system; "
              "print(json.dumps(collect_system({}).shm_bytes))")
    seen = subprocess.run(["unshare", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size=64m shm /dev/shm && exec {sys.executable} -c '{script}'"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    if seen.returncode != 0 and "mount" in seen.stderr:
        unavailable(f"a tmpfs cannot be mounted in a mount namespace here: {seen.stderr.strip()[:200]}")
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert json.loads(seen.stdout) == 64 << 20
    assert collect_system({}).shm_bytes != 64 << 20, "the host's /dev/shm is untouched"
    # What check_gpu then says of 64 MiB in a container (the error, --shm-size): tests/test_check_gpu.py, with fakes.


# --- build-once locks on a cache shared by containers of one machine ---------------------------------------------------

def test_a_build_lock_held_in_another_pid_namespace_is_waited_for(pid_namespaces, tmp_path):
    """The prepared-data and embedded-model caches are built once under a file lock (src/run_safety/build_once.py):
    a kernel lock on the file, which containers of one machine sharing PREFKIT_CACHE see whatever their PID
    namespaces, so a builder in another container is waited for (not judged by a pid)."""
    from filelock import FileLock, Timeout

    lock = tmp_path / ".prepared.lock"
    builder = subprocess.Popen([*pid_namespaces, sys.executable, "-c",
                                "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
                                "lock.acquire(); print('locked', flush=True); time.sleep(300)", str(lock)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "locked"
        with pytest.raises(Timeout):
            FileLock(lock).acquire(timeout=0.5)
    finally:
        stop(builder)
    with FileLock(lock).acquire(timeout=10):  # its end (a kill included) releases it
        pass
