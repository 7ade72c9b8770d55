"""The real entry point under torchrun, instrumented so a test can prove the ranks trained as one job.

    torchrun --nproc_per_node 2 tests/rank_probe.py PROBE_DIR [main_distributed flags...]

Each rank writes PROBE_DIR/<stage>_rank<r>.json: the world size its trainer saw, a digest of every training row it
was fed (per optimizer step), a digest of its weights when training ended (the whole weights under ZeRO-3) and what
it held then (`held`: elements of its weights, a live reference's and its optimizer states: a sharding engine's share,
ZeRO-3's partitions and FSDP2's DTensor local shards), and what it held of the model as the stage loaded it, before
the trainer wrapped it (`loaded`), and of a reference model the toolkit loaded and handed the trainer
(`loaded_reference`, with `kept_as_given`: whether the trainer runs that one; None where it handed none).

Fault injection: with PROBE_NAN_AT_STEP=K (and PROBE_NAN_RANK, default 1), that rank sets one weight to NaN before
optimizer step K+1 — what a bad kernel or an overflow does to a real run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from src import main_distributed  # noqa: E402
from src.engines import gathered, resharded  # noqa: E402
from src.trainers import build  # noqa: E402


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _torch_optimizer(optimizer):
    """The torch optimizer that holds the states, under accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: ZeRO-3's partition (`ds_tensor`), FSDP2's shard (a DTensor's local
    tensor), or the tensor itself."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held_numbers(trainer, parameters) -> dict:
    """What this rank holds, in elements: the model's weights (ZeRO-3 and FSDP2: its shard), a live reference
    model's, and its optimizer's states (one moment tensor or flat partition per parameter group, step counters left
    out)."""
    states = _torch_optimizer(trainer.optimizer).state.values()
    reference = getattr(trainer, "ref_model", None)
    return {"weights": sum(_local(p).numel() for p in parameters),
            "reference_weights": sum(_local(p).numel() for p in reference.parameters())
            if reference is not None else None,
            "full_weights": sum(getattr(p, "ds_numel", p.numel()) for p in parameters),
            "optimizer_states": sum(_local(value).numel() for state in states for value in state.values()
                                    if torch.is_tensor(value) and value.dim() > 0),
            # DeepSpeed's gradient reduce bucket as its engine sized it (elements; a ZeRO-3 rank allocates it whole)
            "reduce_bucket": engine.zero_reduce_bucket_size() if hasattr(
                engine := trainer.model_wrapped, "zero_reduce_bucket_size") else None}


def loaded_numbers(model) -> dict:
    """What this rank holds of the model as loaded, before the trainer wraps it (elements: ZeRO-3's partitions where
    the weights were partitioned as they loaded, FSDP2's shards where it was sharded as it loaded: every unit holding
    its shards again, as the trainer makes them, where a forward before training left some gathered)."""
    resharded(model)
    parameters = list(model.parameters())
    return {"weights": sum(_local(p).numel() for p in parameters),
            "full_weights": sum(getattr(p, "ds_numel", p.numel()) for p in parameters)}


def instrument(build_trainer, probe_dir: Path):
    def build(stage, *args, **kwargs):
        loaded = loaded_numbers(args[0])  # the model as the stage loaded it (build_trainer's first argument)
        given = kwargs.get("ref_model")  # a reference the toolkit loaded for the trainer
        loaded_reference = loaded_numbers(given) if given is not None else None
        trainer = build_trainer(stage, *args, **kwargs)
        if given is not None:  # the trainer runs the one it was given (an engine may wrap it: DeepSpeed's inference
            # engine), not one of its own
            loaded_reference["kept_as_given"] = getattr(trainer.ref_model, "module", trainer.ref_model) is given
        seen: dict[int, list[str]] = {}
        compute_loss = trainer.compute_loss

        def recording_compute_loss(model, inputs, *more, **options):
            ids = inputs.get("input_ids", inputs.get("chosen_input_ids"))  # SimPO's and ORPO's pairs: the chosen
            if model.training and ids is not None:
                rows = seen.setdefault(trainer.state.global_step, [])
                rows.extend(_digest(row[row != trainer.processing_class.pad_token_id]) for row in ids)
            return compute_loss(model, inputs, *more, **options)

        trainer.compute_loss = recording_compute_loss

        class WriteProbe(TrainerCallback):
            def on_train_end(self, args, state, control, model=None, **kw):
                parameters = list(trainer.accelerator.unwrap_model(trainer.model).parameters())
                with gathered(parameters):  # ZeRO-3: each rank holds a share; the digest is of the whole
                    weights = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                                         .flatten() for p in parameters])  # FSDP2: gathered from the shards
                record = {"rank": int(os.environ.get("RANK", 0)), "world_size": trainer.args.world_size,
                          "seen": seen, "weights": _digest(weights), "steps": state.global_step,
                          "held": held_numbers(trainer, parameters), "loaded": loaded,
                          "loaded_reference": loaded_reference}
                path = probe_dir / f"{stage}_rank{record['rank']}.json"
                path.write_text(json.dumps(record))

        trainer.add_callback(WriteProbe())
        nan_step = int(os.environ.get("PROBE_NAN_AT_STEP", "-1"))
        if nan_step >= 0 and int(os.environ.get("RANK", 0)) == int(os.environ.get("PROBE_NAN_RANK", "1")):

            class InjectNaN(TrainerCallback):
                def on_step_begin(self, args, state, control, model=None, **kw):
                    if state.global_step == nan_step:
                        with torch.no_grad():
                            next(model.parameters()).view(-1)[0] = float("nan")

            trainer.add_callback(InjectNaN())
        return trainer

    return build


def run(instrumented) -> int:
    """The entry point with every stage's trainer instrumented: `PROBE_DIR [main_distributed flags...]` from argv."""
    probe_dir = Path(sys.argv[1])
    probe_dir.mkdir(parents=True, exist_ok=True)
    build.build_trainer = instrumented(build.build_trainer, probe_dir)
    return main_distributed.main(sys.argv[2:])


def entry(argv: list[str]) -> int:
    """run() as a forked process's entry point (tests/forked.py): `argv` is also its sys.argv[1:]."""
    return run(instrument)


if __name__ == "__main__":
    sys.exit(run(instrument))
