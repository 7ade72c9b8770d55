"""`check_gpu.py --bench`: all-reduce bus bandwidth, measured as nccl-tests defines it, in a child process.

algbw = bytes / time; all-reduce busbw = algbw * 2(n-1)/n (the traffic each link carries in a ring), so busbw
compares with link speed whatever the process count. The child (`allreduce_worker`) runs in its own session
with a hard timeout and the whole process group is killed when it expires: broken P2P hangs rather than fails.
On GPUs (NCCL) a hang, a wrong sum or a crash is retried once with NCCL_P2P_DISABLE=1, and the result says
which worked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
WORKER_COMMAND = (sys.executable, "-m", "src.diagnostics.allreduce_worker")
GPU_SIZES = (1 << 20, 16 << 20, 128 << 20)
CPU_SIZES = (64 << 10, 1 << 20, 16 << 20)
STDERR_TAIL_LINES = 5


@dataclass
class BenchRequest:
    backend: str  # "nccl" or "gloo"
    nprocs: int
    environ: dict[str, str]  # the child's environment (CUDA_VISIBLE_DEVICES picks the GPUs)
    timeout_s: float
    sizes: tuple[int, ...]


@dataclass
class BenchPoint:
    size_bytes: int
    iterations: int
    seconds_per_iteration: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool


@dataclass
class BenchAttempt:
    p2p_disabled: bool
    status: str  # "ok", "timeout", "wrong_result" or "failed"
    seconds: float
    points: list[BenchPoint] = field(default_factory=list)
    error: str | None = None


@dataclass
class BenchResult:
    backend: str
    nprocs: int
    outcome: str  # "ok", "ok_without_p2p" or "failed"
    attempts: list[BenchAttempt] = field(default_factory=list)

    @property
    def best(self) -> BenchAttempt:
        return self.attempts[-1]


def bus_bandwidth(algbw: float, nprocs: int) -> float:
    return algbw * 2 * (nprocs - 1) / nprocs


def _point(record: dict, nprocs: int) -> BenchPoint:
    algbw = record["size_bytes"] / record["seconds_per_iteration"] / 1e9
    return BenchPoint(
        size_bytes=record["size_bytes"],
        iterations=record["iterations"],
        seconds_per_iteration=record["seconds_per_iteration"],
        algbw_gbps=algbw,
        busbw_gbps=bus_bandwidth(algbw, nprocs),
        correct=record["correct"],
    )


def _points(stdout: str, nprocs: int) -> list[BenchPoint]:
    points = []
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # library chatter on stdout
        if isinstance(record, dict) and "seconds_per_iteration" in record:
            points.append(_point(record, nprocs))
    return points


def _stderr_tail(stderr: str) -> str | None:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return "\n".join(lines[-STDERR_TAIL_LINES:]) or None


def run_attempt(request: BenchRequest, p2p_disabled: bool, worker_command: tuple[str, ...] = WORKER_COMMAND) -> BenchAttempt:
    environ = dict(request.environ)
    environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: one thread per process on a shared CPU
    if p2p_disabled:
        environ["NCCL_P2P_DISABLE"] = "1"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="check_gpu_bench_") as scratch:
        command = [
            *worker_command,
            "--backend", request.backend,
            "--nprocs", str(request.nprocs),
            "--sizes", ",".join(str(size) for size in request.sizes),
            "--init-file", os.path.join(scratch, "rendezvous"),
            "--timeout", str(request.timeout_s),
        ]  # fmt: skip
        # A new session makes the worker and every rank it spawns one process group, killed together on timeout.
        child = subprocess.Popen(
            command, cwd=REPOSITORY_ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = child.communicate(timeout=request.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            timed_out = True
    points = _points(stdout, request.nprocs)
    if timed_out:
        status = "timeout"
    elif any(not point.correct for point in points):
        status = "wrong_result"
    elif child.returncode != 0 or len(points) < len(request.sizes):
        status = "failed"
    else:
        status = "ok"
    error = None if status == "ok" else _stderr_tail(stderr) or f"worker exited with status {child.returncode}"
    if status == "timeout":
        error = f"no result within {request.timeout_s:.0f} s (killed)"
    return BenchAttempt(p2p_disabled, status, time.monotonic() - started, points, error)


def run_bench(request: BenchRequest, worker_command: tuple[str, ...] = WORKER_COMMAND) -> BenchResult:
    already_disabled = request.environ.get("NCCL_P2P_DISABLE") == "1"
    first = run_attempt(request, p2p_disabled=already_disabled, worker_command=worker_command)
    result = BenchResult(request.backend, request.nprocs, "ok" if first.status == "ok" else "failed", [first])
    # A crash is retried too: NCCL aborts on NVLink pairs whose P2P the driver reports broken.
    if first.status != "ok" and request.backend == "nccl" and not already_disabled:
        retry = run_attempt(request, p2p_disabled=True, worker_command=worker_command)
        result.attempts.append(retry)
        result.outcome = "ok_without_p2p" if retry.status == "ok" else "failed"
    return result


def bench_sizes(backend: str) -> tuple[int, ...]:
    return GPU_SIZES if backend == "nccl" else CPU_SIZES

