"""What a checkpoint carries beyond transformers' files, so that a run resumed from it (on any number of processes)
logs what the uninterrupted run logs: the split that saved it (split.json: src/run_safety/checkpoint_split.py reads
it) and the logging window open at the save (log_window.json).

The window: transformers logs the mean loss since its last log (`_tr_loss`, each rank's sum, averaged over the ranks
at the log, and `_globalstep_last_logged`), and the toolkit's trainers the metrics kept since then (src/trainers/
device_metrics.py: the window's rows, and what TRL appended to `_metrics["train"]`). A checkpoint off the logging grid
(saved at step 43, logged every 5) would lose the steps 41-43 of the log at step 45: a resumed run logged the mean of
44-45 alone, 5.7e-4 off the uninterrupted run's on the issue's DPO run. Here the save carries the window as every rank
would log it, in terms of no split (the loss summed over the window's steps and averaged over the ranks; the metrics
flushed: the values and weights of its micro-batch rows, summed over the ranks), and the resume puts it back on every
rank: the first log after it covers the same steps as the uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.trainer_pt_utils import nested_gather

from src.engines import engine_record
from src.run_safety import hang_watch
from src.run_safety.checkpoint_split import SPLIT_FILE, split_record
from src.world import World

WINDOW_FILE = "log_window.json"


def split_of(trainer) -> dict:
    """The split that saves now, from the trainer's arguments and accelerator (split.json)."""
    args = trainer.args
    engine = engine_record(trainer.accelerator)
    if getattr(trainer, "is_fsdp_enabled", False):
        engine["state_dict_type"] = trainer.accelerator.state.fsdp_plugin.state_dict_type.name
    return split_record(args.world_size, World.from_environment().num_nodes, args.per_device_train_batch_size,
                        args.gradient_accumulation_steps, engine)


def _metric_store(trainer) -> dict | None:
    """Where the trainer's training metrics wait for the next log: its metric window's store (TRL's `_metrics`, the
    experimental pair trainers' `_stored_metrics`), else TRL's `_metrics`."""
    window = getattr(trainer, "metric_window", None)
    store = window.store(trainer) if window is not None else getattr(trainer, "_metrics", None)
    return store if isinstance(store, dict) and "train" in store else None


def window_at_save(trainer) -> dict:
    """The logging window now, the same on every rank (every rank calls it: one gather of the loss, and the metric
    window's flush)."""
    window = getattr(trainer, "metric_window", None)
    with hang_watch.waiting("the logging window gathered from every rank"):  # a stuck peer is not this rank
        if window is not None:
            window.flush(trainer)  # its rows summed over the ranks, appended as a log would: values of no split
        loss = nested_gather(trainer._tr_loss.detach(), trainer.args.parallel_mode).mean().item()
    store = _metric_store(trainer)
    return {"loss_sum": loss, "last_logged": trainer._globalstep_last_logged,
            "metrics": {name: [float(value) for value in values] for name, values in store["train"].items()}
            if store is not None else {},
            "weights": {name: list(values) for name, values in window.weights.items()} if window is not None else {},
            "total_train_tokens": getattr(trainer, "_total_train_tokens", None)}


def write(trainer, checkpoint: Path, window: dict) -> None:
    """Rank 0: split.json and log_window.json into the checkpoint (before its manifest is taken)."""
    (Path(checkpoint) / SPLIT_FILE).write_text(json.dumps(split_of(trainer), indent=1))
    (Path(checkpoint) / WINDOW_FILE).write_text(json.dumps(window, allow_nan=True))


def restore_window(trainer, checkpoint: str | Path) -> None:
    """Every rank, as training resumes from `checkpoint` (after transformers opened its own window): the window
    the checkpoint carries put back. A checkpoint from before this file opens an empty one, as before."""
    path = Path(checkpoint) / WINDOW_FILE
    if not path.is_file():
        return
    window = json.loads(path.read_text())
    trainer._tr_loss += torch.tensor(window["loss_sum"], dtype=trainer._tr_loss.dtype, device=trainer._tr_loss.device)
    trainer._globalstep_last_logged = window["last_logged"]
    store = _metric_store(trainer)
    if store is not None:
        for name, values in window["metrics"].items():
            store["train"][name] = list(values) + list(store["train"].get(name, []))
    metric_window = getattr(trainer, "metric_window", None)
    if metric_window is not None:
        for name, values in window["weights"].items():
            metric_window.weights[name] = list(values) + metric_window.weights.get(name, [])
    if window.get("total_train_tokens") is not None and hasattr(trainer, "_total_train_tokens"):
        trainer._total_train_tokens = window["total_train_tokens"]
