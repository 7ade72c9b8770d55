"""Two hosts for real: two Linux network namespaces joined by a veth pair, each running `./run_distributed.sh 2` as a
node of one 4-process job (gloo over the veth), each with its own caches as separate machines would have. Plus the
Slurm batch script's node-rank and master-address derivation, with fake Slurm commands.

Needs root and iproute2 (`ip netns`). Outside CI a machine without them skips with the reason; in CI (CI=true, where
the tests run as root) it fails, so the test cannot silently stop running.
"""

from __future__ import annotations

import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import forked
from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files

PREFIX = "pkth"        # every namespace and link this test creates starts with it, followed by the creating pid
SUBNET = "10.213.0"    # both ends live in namespaces of our own: the addresses exist nowhere else
NODE_TIMEOUT = 240     # seconds per node process, training included


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def remove_leftovers() -> None:
    """Namespaces and links of earlier runs of this test whose process is gone (a crash, a kill -9)."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.startswith(PREFIX)]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()
             if line.split(":")[1].strip().startswith(PREFIX)]
    for name in names + links:
        pid = re.match(rf"{PREFIX}(\d+)", name).group(1)
        if pid != str(os.getpid()) and Path(f"/proc/{pid}").exists():
            continue  # a test run still in progress
        if name in names:
            ip("netns", "del", name, check=False)
        else:
            ip("link", "del", name, check=False)


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"two-host test cannot run in CI: {reason} (CI runs as root with iproute2 and must run it)")
    pytest.skip(reason)


@dataclass
class Hosts:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    interfaces: tuple[str, str]


@pytest.fixture(scope="module")
def two_hosts():
    if shutil.which("ip") is None:
        unavailable("no `ip` command (iproute2)")
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    remove_leftovers()
    tag = f"{PREFIX}{os.getpid()}"
    hosts = Hosts((f"{tag}-0", f"{tag}-1"), (f"{SUBNET}.1", f"{SUBNET}.2"), (f"{tag}a", f"{tag}b"))
    try:
        for namespace in hosts.namespaces:
            created = ip("netns", "add", namespace, check=False)
            if created.returncode:
                unavailable(f"cannot create a network namespace: {created.stderr.strip()}")
        ip("link", "add", hosts.interfaces[0], "type", "veth", "peer", "name", hosts.interfaces[1])
        for namespace, interface, address in zip(hosts.namespaces, hosts.interfaces, hosts.addresses):
            ip("link", "set", interface, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", namespace, "link", "set", interface, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in hosts.namespaces:  # deleting a namespace deletes the veth end inside it, and so the pair
            ip("netns", "del", namespace, check=False)
        ip("link", "del", hosts.interfaces[0], check=False)  # if it never moved into a namespace


def start_nodes(hosts: Hosts, node_dirs: list[Path], args: list[str], port: int,
                private_dir: tuple[Path, Path] | None = None, per_node: int = 2,
                **environment: str) -> tuple[list, list]:
    """`./run_distributed.sh PER_NODE ARGS` in each namespace as node 0 and node 1, each in its own process group
    (every process of a "host"); (processes, logs). Each node has its own caches. With private_dir=(directory,
    per-node subdirectory name), each node sees its own directory at that path (a bind mount in the node's mount
    namespace): no storage shared there."""
    processes, logs = [], []
    for node, (namespace, node_dir) in enumerate(zip(hosts.namespaces, node_dirs)):
        node_dir.mkdir(parents=True, exist_ok=True)
        env = os.environ | environment | {
            "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": str(port),
            "PREFKIT_CACHE": str(node_dir / "prefkit_cache"), "HF_HOME": str(node_dir / "hf_home"),
            "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
        command = ["./run_distributed.sh", str(per_node), *args]
        if private_dir:
            shared, own = private_dir[0], private_dir[0].parent / f"{private_dir[1]}{node}"
            shared.mkdir(parents=True, exist_ok=True)
            own.mkdir(parents=True, exist_ok=True)
            command = ["sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(own), str(shared), *command]
        log = open(node_dir / "launch.log", "w+")
        logs.append(log)
        processes.append(subprocess.Popen(["ip", "netns", "exec", namespace, *command], cwd=PROJECT_ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return processes, logs


def finish_nodes(processes: list, logs: list, timeout: float = NODE_TIMEOUT) -> list[tuple[int, str]]:
    """Wait for every node; (exit status, output) per node. On a timeout or an error, no node's processes outlive
    the test."""
    results = []
    try:
        for process in processes:
            process.wait(timeout=timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for process, log in zip(processes, logs):
        log.seek(0)
        results.append((process.returncode, log.read()))
        log.close()
    return results


def launch_nodes(hosts: Hosts, node_dirs: list[Path], args: list[str], port: int,
                 private_dir: tuple[Path, Path] | None = None, per_node: int = 2,
                 **environment: str) -> list[tuple[int, str]]:
    """start_nodes, then finish_nodes: (exit status, output) per node."""
    return finish_nodes(*start_nodes(hosts, node_dirs, args, port, private_dir, per_node, **environment))


def dpo_args(model: Path, data: Path, results: Path, run_name: str) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data),
            "--results_dir", str(results), "--run_name", run_name, "--max_length", "64", "--logging_steps", "1",
            "--eval_steps", "2", "--num_samples", "4", "--max_new_tokens", "6", "--judge", "none", "--seed", "3",
            "--val_size", "4", "--test_size", "4", "--batch_size", "8", "--max_steps", "4", "--learning_rate", "1e-3"]


@pytest.fixture(scope="module")
def job_of_four(two_hosts, tiny_model, tmp_path_factory):
    """One DPO job on the two hosts (2 processes each): its directory, node directories and (status, output)s."""
    root = tmp_path_factory.mktemp("job_of_four")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(48))
    nodes = [root / "node0", root / "node1"]
    results = root / "results"  # shared by both nodes, as a cluster's shared filesystem is
    outcome = launch_nodes(two_hosts, nodes, dpo_args(tiny_model, data, results, "two"), 29511)
    return root, data, nodes, outcome


def test_two_hosts_train_as_one_job_of_four(two_hosts, job_of_four):
    root, _, nodes, outcome = job_of_four
    results = root / "results"
    for node, (code, output) in enumerate(outcome):
        assert code == 0, f"node {node} exited {code}:\n{output[-6000:]}"
        # gloo bound to the veth (the hostname resolves to 127.0.0.1 here, which the other node cannot reach)
        assert f"through {two_hosts.interfaces[node]} (GLOO_SOCKET_IFNAME)" in output

    run_dir = results / "two"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert (info["world_size"], info["num_nodes"], info["local_world_size"]) == (4, 2, 2)
    assert (info["status"], info["distributed_type"], info["global_batch_size"], info["per_device_batch_size"]) == (
        "completed", "MULTI_CPU", 8, 2)
    assert info["one_job"] == {"ranks": 4, "identical_weights": True, "disjoint_rows_per_step": True,
                               "steps_checked": 4, "steps_with_shared_rows": []}
    assert info["summary"]["completed_steps"] == 4

    # One writer of the results: each step's record once, the plan printed by node 0 only.
    metrics = run_files.read_jsonl(run_dir / run_files.METRICS)
    assert [record["step"] for record in metrics if "loss" in record] == [1, 2, 3, 4]
    assert "== DPO" in outcome[0][1] and "== DPO" not in outcome[1][1]
    # A checkpoint holds every rank's share (node 1's RNG states next to node 0's), once, and is complete.
    checkpoint = run_dir / "model" / "checkpoint-4"
    assert (checkpoint / ".complete").exists()
    assert sorted(path.name for path in checkpoint.glob("rng_state_*")) == [f"rng_state_{r}.pth" for r in range(4)]
    assert (run_dir / "model" / "final" / "model.safetensors").exists()

    # Each machine tokenized into, and cached the reference log-probs in, its own cache.
    for node in nodes:
        prepared = list((node / "prefkit_cache" / "datasets").glob("dpo-*/train.arrow"))
        assert len(prepared) == 1 and list(prepared[0].parent.glob("cache-*.arrow")), f"{node}: no reference cache"
    assert info["reference_log_probs"]["train"]["cache"] == "computed"


def test_a_node_without_the_warm_reference_cache_does_not_hang_the_job(two_hosts, tiny_model, job_of_four):
    """Node 0 keeps the reference log-probs of an earlier run (the job of four); node 1 is a fresh machine without
    them. TRL would reuse the file on node 0 and run collectives on node 1: a hang. Both recompute instead, and both
    caches are whole. The job: the same 2 nodes x 2 processes, forked on this machine (tests/forked.py), each node's
    ranks with that node's own caches: what differs between the nodes here is the caches, not the network."""
    root, data, nodes, first = job_of_four
    assert [code for code, _ in first] == [0, 0], first[1][1][-4000:]
    reference_files = lambda node: sorted((node / "prefkit_cache" / "datasets").glob("dpo-*/cache-*.arrow"))  # noqa: E731
    assert reference_files(nodes[0]) and reference_files(nodes[1])
    for path in reference_files(nodes[1]):
        path.unlink()

    second = forked.run_job(4, dpo_args(tiny_model, data, root / "results", "second"), timeout=NODE_TIMEOUT,
                            env=os.environ | {"OMP_NUM_THREADS": "1"},
                            node_env=[{"PREFKIT_CACHE": str(node / "prefkit_cache")} for node in nodes])
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    info = run_files.read_json(root / "results" / "second" / run_files.TRAINING_INFO)
    assert info["reference_log_probs"]["train"]["cache"] == "computed"
    assert info["one_job"]["identical_weights"] and info["summary"]["completed_steps"] == 4
    assert len(reference_files(nodes[1])) == len(reference_files(nodes[0]))


def test_zero2_over_two_hosts_trains_as_two_processes_on_one(two_hosts, tiny_model, preference_file, tmp_path):
    """`STRATEGY=zero2 ./run_distributed.sh 1` on each host (accelerate launch, DeepSpeed over gloo on the veth): the
    job ran DeepSpeed ZeRO-2 as one job of 2 over 2 nodes, with the losses of the same job as 2 processes on one node
    (forked here with the environment accelerate launch gives its workers, tests/engine_launch.py)."""
    from engine_launch import accelerate_environment

    nodes, results = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "results"
    args = dpo_args(tiny_model, preference_file, results, "zero2_nodes")
    outcome = launch_nodes(two_hosts, nodes, args, 29513, per_node=1, STRATEGY="zero2", MAX_RESTARTS="0")
    for node, (code, output) in enumerate(outcome):
        assert code == 0, f"node {node} exited {code}:\n{output[-6000:]}"
        # the launcher's own processes included (accelerate launch imports DeepSpeed): src/library_warnings.py
        noise = [line for line in output.splitlines() if any(word in line for word in (
            "Warning:", "Setting accelerator", "built successfully", "mismatch"))]
        assert not noise, f"node {node}: {noise[:4]}"
    assert "  engine         DeepSpeed ZeRO-2 (deepspeed " in outcome[0][1]  # the plan block, printed by rank 0
    assert "gradients, optimizer states over 2 processes  [STRATEGY=zero2]" in outcome[0][1]
    info = run_files.read_json(results / "zero2_nodes" / run_files.TRAINING_INFO)
    assert (info["engine"], info["zero_stage"], info["world_size"], info["num_nodes"]) == ("deepspeed", 2, 2, 2)
    one_node = forked.run_job(2, args[:args.index("--run_name") + 1] + ["one_node"] + args[args.index("--run_name") + 2:],
                              env=accelerate_environment("zero2") | {"OMP_NUM_THREADS": "1"}, timeout=NODE_TIMEOUT)
    assert one_node.returncode == 0, (one_node.stdout + one_node.stderr)[-6000:]
    losses = {run: [record["loss"] for record in run_files.read_jsonl(results / run / run_files.METRICS)
                    if "loss" in record] for run in ("zero2_nodes", "one_node")}
    assert len(losses["one_node"]) == 4 and losses["zero2_nodes"] == pytest.approx(losses["one_node"], rel=1e-5)


def test_results_on_storage_a_node_cannot_see_is_refused(two_hosts, tiny_model, preference_file, tmp_path):
    """Each node sees its own directory at --results_dir: node 1 would silently start afresh on a resume while node 0
    resumes. The job stops with one clear line instead (MAX_RESTARTS=0: restarting cannot fix storage). One process
    per node: what is checked is the nodes' storage."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    results = tmp_path / "results"
    outcome = launch_nodes(two_hosts, nodes, dpo_args(tiny_model, preference_file, results, "private"), 29512,
                           private_dir=(results, "results-of-node"), per_node=1, MAX_RESTARTS="0")
    assert [code for code, _ in outcome] != [0, 0]
    assert "error: --results_dir: node(s) 1 cannot see" in outcome[0][1], outcome[0][1][-4000:]
    assert "must be on storage every node shares" in outcome[0][1]
    assert (tmp_path / "results-of-node0" / "private" / run_files.TRAINING_INFO).exists()  # node 0's own disk
    assert not list((tmp_path / "results-of-node1").rglob("*.json")), "node 1 wrote results of its own"


def test_a_lost_node_stops_the_survivors_in_one_line_within_the_node_timeout(two_hosts, tiny_model, preference_file,
                                                                            tmp_path):
    """Every process of node 1 is killed mid-training (the machine is lost). Node 0 stops within --node_timeout (20 s
    here) of its workers' (re)start, with one line naming node 1, instead of waiting for the process-group timeout
    (60 minutes) in the restarted workers' rendezvous; the newest complete checkpoint stays whole. The line names the
    launch that goes on with node 0 alone (NNODES=1, its 2 processes: the global batch of 8 splits over them), and
    that launch resumes the job of 2 nodes from the checkpoint (issue 58; here 2 steps more, as --max_steps says)."""
    import time

    from src.run_safety.build_once import COMPLETE_MARKER
    from src.run_safety.exit_status import ExitStatus
    from src.run_safety.checkpoints import checkpoint_step, newest_complete_checkpoint
    from test_resilience import wait_for

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    results = tmp_path / "results"
    args = dpo_args(tiny_model, preference_file, results, "lost")
    args[args.index("--max_steps") + 1] = "5000"  # far longer than the test
    args += ["--save_steps", "5", "--eval_strategy", "no", "--node_timeout", "20"]
    processes, logs = start_nodes(two_hosts, nodes, args, 29515)
    try:
        model_dir = results / "lost" / "model"
        wait_for(lambda: newest_complete_checkpoint(model_dir), timeout=NODE_TIMEOUT, what="a complete checkpoint")
        # Node 1 is gone: every process in its namespace (torchrun puts each worker in a process group of its own).
        for pid in ip("netns", "pids", two_hosts.namespaces[1]).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        killed = time.monotonic()
        # gloo fails the step at once on node 0 and torchrun restarts its workers, which then wait for node 1: the
        # watch stops them --node_timeout after they start (their start is slow on a loaded 2-core machine).
        try:
            processes[0].wait(timeout=20 + 200)
            stopped_after = time.monotonic() - killed
        except subprocess.TimeoutExpired:
            stopped_after = None  # node 0's output says where it waited
    finally:
        outcome = finish_nodes(processes, logs, timeout=1)
    code, output = outcome[0]
    assert stopped_after is not None, "node 0 still running 220 s after node 1 was lost: " + output[-4000:]
    assert code == ExitStatus.NODE_LOST, output[-4000:]
    assert "SignalException" not in output and "ChildFailedError" not in output, "the line ends it: " + output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("error: node 1 stopped answering")]
    assert len(lines) == 1, output[-4000:]
    assert "--node_timeout" in lines[0] and "resumes from" in lines[0] and str(model_dir) in lines[0]
    newest = newest_complete_checkpoint(model_dir)
    assert newest is not None and (newest / COMPLETE_MARKER).exists() and (newest / "model.safetensors").exists()
    print(f"node 0 stopped {stopped_after:.0f} s after node 1 was killed")
    go_on = lines[0].split("or go on without node 1 from there, with the same numbers: ")[1]
    assert go_on == f"NNODES=1 ./run_distributed.sh 2 {shlex.join(args)} on it (2 processes)", go_on
    step = checkpoint_step(newest)
    args[args.index("--max_steps") + 1] = str(step + 2)
    alone = subprocess.run(["ip", "netns", "exec", two_hosts.namespaces[0], "./run_distributed.sh", "2", *args],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=NODE_TIMEOUT,
                           env=os.environ | {"NNODES": "1", "PREFKIT_CACHE": str(nodes[0] / "prefkit_cache"),
                                             "HF_HOME": str(nodes[0] / "hf_home"), "PYTHON": sys.executable,
                                             "OMP_NUM_THREADS": "1"})
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    info = run_files.read_json(results / "lost" / run_files.TRAINING_INFO)
    resume = info["resumes"][-1]
    assert (info["world_size"], info["num_nodes"], resume["from_step"]) == (2, 1, step)
    assert resume["split_change"] == "saved by 2 nodes x 2 processes, now 2: micro-batch 2 → 4, global batch 8 " \
        "unchanged", resume


SBATCH = PROJECT_ROOT / "configs" / "slurm" / "dpo_2nodes.sbatch"


def test_slurm_script_parses():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    directives = [line.split()[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    for wanted in ("--nodes=2", "--gpus-per-node=8", "--ntasks-per-node=1", "--signal=TERM@120", "--time=08:00:00"):
        assert wanted in directives


def test_slurm_script_derives_node_rank_and_master_address(tmp_path):
    """Fake `scontrol` and `srun` on PATH: srun runs its command once per node with that node's SLURM_NODEID, as
    Slurm does; run_distributed.sh prints the torchrun command it would run (PRINT_LAUNCH=1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        [[ $1 == show && $2 == hostnames && $3 == "gpu-[017-018]" ]] || { echo "unexpected: $*" >&2; exit 1; }
        printf 'gpu-017\\ngpu-018\\n'
        """))
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        while [[ $1 == -* ]]; do shift; done
        for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$node "$@" || exit $?; done
        """))
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "NODE_RANK", "MASTER_"))}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-[017-018]",
            "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": str(PROJECT_ROOT), "PRINT_LAUNCH": "1",
            "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SBATCH), "--config", "configs/default.yaml", "--max_steps", "10"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    launches = [line.strip() for line in result.stdout.strip().splitlines()]
    assert len(launches) == 2
    for node, line in enumerate(launches):
        assert (f"--nnodes 2 --node_rank {node} --master_addr gpu-017 --master_port 29500 --nproc_per_node 8"
                in line), line
        assert line.endswith("-m src.main_distributed --config configs/default.yaml --max_steps 10"), line
