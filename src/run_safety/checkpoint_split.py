"""Who saved a checkpoint, and whether this launch can go on from it: the split a checkpoint was saved by (its
processes, nodes, micro-batch, accumulation, global batch and engine: `split.json`, written beside transformers'
files by src/trainers/checkpointing.py), what changed since (`change_line`: "saved by 2 processes, now 1:
accumulation 1 → 2, global batch 8 unchanged") and the one-line refusals of a resume that cannot give the numbers of
the run it continues (`refusal`: another global batch, another engine, a checkpoint its engine cannot reshard), each
naming what would make it work. Light: no torch (the launcher's preflight reads it before any process group).

The global batch is what makes a resume on another number of processes the same run: the toolkit keeps it, and the
learning rate, whatever the split (src/plan.py), and cuts each epoch to whole global batches, so the data order, the
pairs left out per epoch and every optimizer step are the split's business only. A checkpoint saved by a toolkit from
before this record is read from its files (the RNG states say how many processes saved it; the engine's files which
engine); its batch is then unknown, and not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from src.config import Config
from src.config_error import ConfigError
from src.engines import DDP, DEEPSPEED, FSDP, Engine
from src.plan import Plan, largest_split, process_counts_that_split
from src.run_files import TRAINING_INFO
from src.run_safety.stops import Status
from src.world import World

SPLIT_FILE = "split.json"
# FSDP state-dict types whose files are one rank's own shard, which only the same number of processes can load:
# accelerate's LOCAL_STATE_DICT, and SHARDED_STATE_DICT written per rank without torch.distributed.checkpoint.
PER_RANK_FSDP_FILES = ("pytorch_model_fsdp_rank", "pytorch_model_fsdp_0_rank")


def split_record(world_size: int, num_nodes: int, per_device: int, accumulation: int, engine: dict) -> dict:
    """What split.json holds: the split that saved the checkpoint, and its engine as training_info.json names it
    (`engine`, with `zero_stage`, or `fsdp_version` and `state_dict_type`)."""
    return {"world_size": world_size, "num_nodes": num_nodes, "per_device_batch_size": per_device,
            "gradient_accumulation_steps": accumulation, "global_batch_size": world_size * per_device * accumulation,
            **engine}


def saved_split(checkpoint: Path) -> dict:
    """The split that saved `checkpoint`: its split.json, or what its files say (a checkpoint from before it)."""
    checkpoint = Path(checkpoint)
    try:
        return json.loads((checkpoint / SPLIT_FILE).read_text())
    except (OSError, ValueError):
        pass
    ranks = len(list(checkpoint.glob("rng_state_*.pth")))
    record = {"world_size": ranks or 1, "global_batch_size": None}
    if any(checkpoint.glob("global_step*")):
        return record | {"engine": DEEPSPEED, "zero_stage": None}
    if any(path.name.startswith("pytorch_model_fsdp") for path in checkpoint.iterdir()):
        return record | {"engine": FSDP}
    return record | {"engine": DDP if ranks > 1 else "none"}


def engine_of(engine: Engine | None) -> dict:
    """This launch's engine in the record's terms."""
    if engine is None:
        return {"engine": DDP}
    return {"engine": engine.name, **({"zero_stage": engine.zero_stage} if engine.name == DEEPSPEED else {})}


def _strategy(record: dict) -> str:
    """The STRATEGY that launches the engine a record names (run_distributed.sh)."""
    if record.get("engine") == FSDP:
        return "STRATEGY=fsdp"
    if record.get("engine") == DEEPSPEED:
        stage = record.get("zero_stage")
        return f"STRATEGY=zero{stage}" if stage else "STRATEGY=zero1, zero2 or zero3 (its ZeRO stage)"
    return "plain DDP (no STRATEGY)"


def _title(record: dict) -> str:
    if record.get("engine") == DEEPSPEED:
        stage = record.get("zero_stage")
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    return {FSDP: "FSDP", DDP: "plain DDP", "none": "one process, no engine"}.get(record.get("engine"), "?")


def _same_engine(saved: dict, now: dict) -> bool:
    """One process without an engine writes what DDP writes (and reads it): the same checkpoint."""
    plain = {DDP, "none"}
    if saved.get("engine") in plain or now["engine"] in plain:
        return saved.get("engine") in plain and now["engine"] in plain
    if saved.get("engine") != now["engine"]:
        return False
    return saved.get("zero_stage") in (None, now.get("zero_stage"))


def processes(count: int, nodes: int) -> str:
    """"2 processes", "1 process", "2 nodes x 8 processes"."""
    if nodes > 1:
        return f"{nodes} nodes x {count // nodes} processes"
    return f"{count} process{'es' if count != 1 else ''}"


def refusal(checkpoint: Path, saved: dict, plan: Plan, engine: Engine | None) -> str | None:
    """Why this launch cannot go on from `checkpoint` with the numbers of the run it continues, in one line naming
    what would make it work; None when it can."""
    now = engine_of(engine)
    name = f"{Path(checkpoint).parent.name}/{Path(checkpoint).name}"
    fresh = "or start afresh with --overwrite"
    batch = saved.get("global_batch_size")
    if batch is not None and batch != plan.global_batch_size:
        how = (f"--per_device_batch_size {plan.per_device_batch_size} on {plan.world_size} processes"
               if plan.batch_mode == "per_device" else f"--batch_size {plan.global_batch_size}")
        return (f"{name} was trained at a global batch of {batch}, and this launch's is {plan.global_batch_size} "
                f"({how}): relaunch with --batch_size {batch} (the same steps on any number of processes), {fresh}")
    if not _same_engine(saved, now):
        return (f"{name} was saved under {_title(saved)} and this launch runs {_title(now)}: relaunch with "
                f"{_strategy(saved)}, {fresh}")
    if saved.get("world_size") == plan.world_size:
        return None
    if saved.get("engine") == FSDP and (
            saved.get("state_dict_type") == "LOCAL_STATE_DICT" or
            any(path.name.startswith(PER_RANK_FSDP_FILES) for path in Path(checkpoint).iterdir())):
        return (f"{name} holds one FSDP shard per process (saved by {saved['world_size']}), which only "
                f"{saved['world_size']} processes can load: resume it on {saved['world_size']} processes; for "
                "checkpoints any number can resume, keep fsdp_state_dict_type: SHARDED_STATE_DICT or FULL_STATE_DICT "
                "(configs/accelerate/fsdp.yaml)")
    if saved.get("engine") == DEEPSPEED and any(Path(checkpoint).glob("global_step*/offloaded_tensors")):
        return (f"{name} keeps its optimizer states offloaded to NVMe, which DeepSpeed cannot convert for another "
                f"number of processes: resume it on {saved['world_size']} processes, or train with "
                "offload_optimizer_device: none or cpu")
    return None


def change_line(saved: dict, plan: Plan) -> str | None:
    """What changed since the checkpoint was saved, for the console and training_info.json ("saved by 2 processes,
    now 1: accumulation 1 → 2, global batch 8 unchanged"); None when the split is the same."""
    before = processes(saved["world_size"], saved.get("num_nodes") or 1)
    now = processes(plan.world_size, plan.num_nodes)
    if before == now:
        return None
    changes = [f"{label} {saved[key]} → {getattr(plan, key)}" for key, label in (
        ("per_device_batch_size", "micro-batch"), ("gradient_accumulation_steps", "accumulation"))
        if saved.get(key) is not None and saved[key] != getattr(plan, key)]
    batch = saved.get("global_batch_size")
    changes.append(f"global batch {batch} unchanged" if batch is not None else
                   f"global batch {plan.global_batch_size}")
    return f"saved by {before}, now {plan.world_size if plan.num_nodes == 1 else now}: {', '.join(changes)}"


class UnsplitResume(ConfigError):
    """An unfinished run relaunched on processes its global batch cannot be split over: the processes that can
    (`nodes` x `per_node`, the most at most this launch's) go on with it; the command is added by the one who knows
    the arguments (src/pipeline/exits.py)."""

    def __init__(self, message: str, nodes: int, per_node: int):
        super().__init__(message)
        self.nodes, self.per_node = nodes, per_node


def unsplit_resume(run_dir: Path, config: Config, world: World) -> UnsplitResume | None:
    """For a launch whose global batch does not split over its processes: when it would resume an unfinished run
    (a stage record running or stopped), the refusal that keeps the run's batch and names the process counts that
    split it, instead of a new batch (a resume at another batch would not be the same run)."""
    records = [Path(run_dir) / TRAINING_INFO, *sorted(Path(run_dir).glob(f"*/{TRAINING_INFO}"))]
    unfinished = []
    for path in records:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("status") in (Status.RUNNING, Status.STOPPED):
            unfinished.append(record)
    best = largest_split(config, world.num_nodes, world.local_world_size)
    if not unfinished or best is None:
        return None
    counts = process_counts_that_split(config, range(1, 2 * world.world_size + 1))
    batch = unfinished[0].get("global_batch_size")
    return UnsplitResume(
        f"{run_dir} is an unfinished run{f' at a global batch of {batch}' if batch else ''}, which "
        f"{processes(world.world_size, world.num_nodes)} cannot split: resume it on {', '.join(map(str, counts))} "
        "processes (the same numbers on any of them), or start afresh with --overwrite", *best)
