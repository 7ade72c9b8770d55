"""The child process of `check_gpu.py --bench`: an all-reduce bandwidth measurement across local processes.

    python -m src.diagnostics.allreduce_worker --backend gloo --nprocs 2 --sizes 65536,1048576 --init-file /tmp/x

Spawns one process per rank (one GPU each for NCCL). For every message size, rank 0 prints one JSON line:
{"size_bytes", "iterations", "seconds_per_iteration", "correct"}. The parent (`bandwidth.py`) turns the times into
bandwidth and kills this process group if it hangs, which is how broken P2P shows itself.

Correctness: rank r contributes (r + 1) * pattern, where pattern cycles through 1..7, so every element of the sum
is n(n+1)/2 * pattern, a small integer that float32 holds exactly; one wrong element fails the size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.run_safety.parent_watch import exit_with_parent

TARGET_SECONDS_PER_SIZE = 0.2
MIN_ITERATIONS, MAX_ITERATIONS = 3, 50
WARMUP_ITERATIONS = 2


def _device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sum_is_correct(elements: int, rank: int, world_size: int, device: torch.device) -> bool:
    pattern = (torch.arange(elements, device=device) % 7 + 1).float()
    tensor = pattern * (rank + 1)
    dist.all_reduce(tensor)
    correct = torch.equal(tensor, pattern * (world_size * (world_size + 1) // 2))
    verdict = torch.tensor([1.0 if correct else 0.0], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every rank must agree the sum is right
    return bool(verdict.item())


def _max_over_ranks(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _time_iterations(tensor: torch.Tensor, iterations: int, device: torch.device) -> float:
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    _synchronize(device)
    return _max_over_ranks(time.perf_counter() - start, device)


def _measure(size_bytes: int, rank: int, world_size: int, device: torch.device) -> dict:
    elements = size_bytes // 4
    correct = _sum_is_correct(elements, rank, world_size, device)
    # Zeros for timing: repeated sums of the pattern would overflow, and values do not change the speed.
    tensor = torch.zeros(elements, dtype=torch.float32, device=device)
    _time_iterations(tensor, WARMUP_ITERATIONS, device)
    # All ranks derive the count from the same (all-reduced) probe time, so they run the same number of calls.
    probe_seconds = _time_iterations(tensor, 1, device)
    iterations = int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, TARGET_SECONDS_PER_SIZE / max(probe_seconds, 1e-6))))
    seconds = _time_iterations(tensor, iterations, device)
    return {
        "size_bytes": elements * 4,
        "iterations": iterations,
        "seconds_per_iteration": seconds / iterations,
        "correct": correct,
    }


def _rank_main(rank: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        args.backend,
        init_method=f"file://{args.init_file}",
        rank=rank,
        world_size=args.nprocs,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    device = _device(args.backend, rank)
    try:
        for size_bytes in args.sizes:
            result = _measure(size_bytes, rank, args.nprocs, device)
            if rank == 0:
                print(json.dumps(result), flush=True)
            if not result["correct"]:
                break
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--nprocs", type=int, required=True)
    parser.add_argument("--sizes", type=lambda text: [int(size) for size in text.split(",")], required=True)
    parser.add_argument("--init-file", required=True, help="a path for torch.distributed's FileStore rendezvous")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    # check_gpu killed (kill -9, an OOM kill): this process and its ranks end at once, not at the process-group
    # timeout (the ranks themselves get SIGINT when this process dies: torch.multiprocessing.spawn's PDEATHSIG).
    exit_with_parent()
    mp.spawn(_rank_main, args=(args,), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    sys.exit(main())
