"""The process group, and the one place that knows which rank does what.

    print0(...)        prints on rank 0 only, so logging code never branches on rank
    init(plan, world)  starts the process group the way TRL's Trainer will find it (accelerate's PartialState), with
                       each process's share of the cores this machine grants as torch's threads
    map_across_ranks   splits work over the ranks and gathers the results in order
    manifest_across_ranks  what a save wrote, hashed by every rank (its share of the blocks) right after it

On CPU, accelerate runs every torchrun rank alone (distributed type NO, world size 1, no error) unless told to use the
CPU; `init` tells it (but under DeepSpeed, which it would then quietly drop: src/engines.py), and `check_world_size`
makes the silent failure loud.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from src.config_error import ConfigError
from src.engines import accelerate_cpu, adopt_fsdp_on_cpu, fsdp_on_cpu
from src.library_warnings import printed_lines_dropped
from src.plan import Plan
from src.world import World
from src.resource_limits import threads_per_process
from src.run_safety import hang_watch
from src.run_safety.checkpoint_manifest import blocks, checksums, listing, manifest
from src.run_safety.disk_space import WriteFailed, noticed_write_failure, stop_message

# Long enough for the slowest legitimate wait between collectives (saving a large checkpoint, a long evaluation);
# data preparation never waits on a collective (see src/run_safety/build_once.py), so it does not count against it.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)

_world = World.from_environment()


def print0(*args, **kwargs) -> None:
    if _world.is_main:
        print(*args, **kwargs, flush=True)


def init(plan: Plan, world: World):
    """Start (or join) the process group for this job and return accelerate's state."""
    from accelerate import PartialState

    if "OMP_NUM_THREADS" not in os.environ:  # not set by a launcher: torch would size its pool by the machine's cores
        import torch

        torch.set_num_threads(threads_per_process(world.local_world_size))  # a container's quota counted
    cpu = accelerate_cpu(plan.device)  # not under DeepSpeed, which accelerate would then quietly drop
    if cpu:
        # ACCELERATE_USE_CPU is what TrainingArguments(use_cpu=True) sets too; set it before the first PartialState.
        os.environ["ACCELERATE_USE_CPU"] = "true"
    if world.world_size == 1 and not fsdp_on_cpu(plan.device, 1):
        return PartialState(cpu=cpu)
    _init_process_group(plan.backend, world)  # accelerate finds it initialized and adopts it
    with printed_lines_dropped():  # DeepSpeed's "op built successfully" line, as its comm backend starts here
        state = PartialState(cpu=cpu, backend=plan.backend, timeout=COLLECTIVE_TIMEOUT)
    adopt_fsdp_on_cpu(plan.device, world.world_size)  # accelerate alone would drop FSDP on CPU processes
    return state


def _init_process_group(backend: str, world: World) -> None:
    """init_process_group on torchrun's store, under a key prefix of its own per restart attempt.

    torchrun keeps the rendezvous store across restarts; a restarted rank can read the address a dead rank of the
    previous attempt published under the same key, connect to nothing and hang (seen with gloo, torch 2.13). A
    prefix per attempt gives every attempt clean keys."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if world.world_size == 1:  # FSDP on one process: a group of one, no rendezvous to wait for
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=COLLECTIVE_TIMEOUT)
        return
    store, rank, world_size = next(dist.rendezvous("env://", rank=world.rank, world_size=world.world_size,
                                                   timeout=COLLECTIVE_TIMEOUT))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"prefkit/attempt-{attempt}", store), rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def check_world_size(trainer_world_size: int, world: World) -> None:
    """The trainer must see the same job torchrun started: otherwise each rank would be training alone."""
    if trainer_world_size != world.world_size:
        raise RuntimeError(
            f"torchrun started {world.world_size} processes but the trainer sees a world of {trainer_world_size}: "
            "the ranks would each train alone. This is a bug in the launch setup, please report it."
        )


def check_shared_storage(written_by_rank_0: Path, world: World) -> None:
    """Every node must see the run directory rank 0 writes: each rank saves its share of a checkpoint there (its RNG
    state; rank 0 the weights and optimizer) and every rank reads the newest one back to resume. On storage private
    to each node, the other nodes would silently start from scratch while node 0 resumes."""
    if world.num_nodes == 1:
        return
    seen = [visible for (visible,) in gather_objects([written_by_rank_0.exists()])]
    blind = sorted({rank // world.local_world_size for rank, visible in enumerate(seen) if not visible})
    if blind:
        raise ConfigError(f"--results_dir: node(s) {', '.join(map(str, blind))} cannot see {written_by_rank_0}, which "
                          "rank 0 just wrote: with several nodes, --results_dir (and --output_dir) must be on storage "
                          "every node shares (NFS, Lustre, ...), so checkpoints can be resumed on every node")


def any_rank(*flags) -> list[bool]:
    """Each flag OR-ed over all ranks (itself when there is no process group). A flag may be a 0-d tensor on the
    device, not read before the others: one host read for all of them, after the all-reduce."""
    return [bool(value) for value in _largest_over_ranks(flags)]


def most_on_any_rank(*counts: int) -> list[int]:
    """Each count's largest value over all ranks (itself when there is no process group)."""
    return [int(value) for value in _largest_over_ranks(counts)]


def _largest_over_ranks(values) -> list[float]:
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    device = "cuda" if distributed and dist.get_backend() == "nccl" else \
        next((value.device for value in values if torch.is_tensor(value)), "cpu")
    stacked = torch.stack([value.detach().float().to(device).reshape(()) if torch.is_tensor(value) else
                           torch.full((), float(value), device=device) for value in values])
    if distributed:
        # A stuck peer is not this rank. The read is inside: NCCL's all_reduce returns at once, the wait is there.
        with hang_watch.waiting("an agreement between the ranks"):
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
            return stacked.tolist()
    return stacked.tolist()


def write_failure_on_any_rank() -> str | None:
    """The one line of a write that failed on any rank (src/run_safety/disk_space.py note_write_failure), agreed by
    every rank (one all-reduce; a gather only when one failed); None when none did. Every rank must call it."""
    (failed,) = any_rank(noticed_write_failure() is not None)
    if not failed:
        return None
    return stop_message([failure for (failure,) in gather_objects([noticed_write_failure()])])


def barrier() -> None:
    """Every rank waits here for the others, and all stop here together (WriteFailed) when a write failed on any
    rank since: a barrier is a point every rank meets, so a failure on one rank (rank 0's files) never leaves the
    others alone in a collective."""
    message = write_failure_on_any_rank()
    if message:
        raise WriteFailed(message)


def finish() -> None:
    """Leave the job's process group once this rank's last collective is done. Without it every NCCL rank warns at
    exit that destroy_process_group() was never called (and may leak the communicator's resources); rank 0's work
    after the last collective (export, Hub push) goes on alone, which needs no group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    hang_watch.stop_watching()  # no peer waits for this rank any more; rank 0's Hub push alone is not judged


def gather_objects(local: list) -> list[list]:
    """Every rank's list, in rank order, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    gathered: list = [None] * dist.get_world_size()
    with hang_watch.waiting("a gather from every rank"):  # a stuck peer is not this rank
        dist.all_gather_object(gathered, local)
    return gathered


def map_across_ranks(items: list, work, world: World) -> list:
    """`work(share)` → one result per item of the share, run by every rank on its share of `items` (every
    world_size-th item, so each rank gets a similar mix); the results, in item order, on every rank. Work that can
    be split is, so no rank waits in a collective toward its timeout while another does it all."""
    mine = list(range(world.rank, len(items), world.world_size))
    results = work([items[index] for index in mine])
    if len(results) != len(mine):
        raise RuntimeError(f"rank {world.rank} returned {len(results)} results for {len(mine)} items")
    ordered: list = [None] * len(items)
    for share in gather_objects(list(zip(mine, results))):
        for index, result in share:
            ordered[index] = result
    return ordered



def manifest_across_ranks(directory: Path, world: World,
                          leave_out: tuple[str, ...] = ()) -> tuple[dict | None, str | None]:
    """The manifest of what every rank just saved into `directory` (src/run_safety/checkpoint_manifest.py), on every
    rank: (manifest, None), or (None, the first file some rank could not read back). Every rank lists the directory
    (on shared storage another node's new files can be missing from one rank's listing for a while, never from their
    writer's: the union has them all), the blocks are dealt round the ranks, and each hashes its share on its share of
    the machine's cores, mostly from the page cache the write left. Every rank must call it, after all have saved.
    `leave_out`: names at the directory's top that are rewritten after the save (checkpoint_manifest.listing)."""
    files: dict[str, int] = {}
    for (seen,) in gather_objects([listing(directory, leave_out)]):
        for name, size in seen.items():
            files[name] = max(size, files.get(name, 0))
    threads = threads_per_process(world.local_world_size)

    def hash_share(share):  # never raises: every rank must reach the gather
        try:
            return [(checksum, None) for checksum in checksums(directory, share, threads)]
        except OSError as error:
            return [(None, f"{error.filename or directory}: {error.strerror or error}")] * len(share)

    hashed = map_across_ranks(blocks(files), hash_share, world)
    problem = next((problem for _checksum, problem in hashed if problem), None)
    return (None, problem) if problem else (manifest(files, [checksum for checksum, _ in hashed]), None)
