"""The trainer callbacks that watch a run: the stop conditions every rank agrees on (a signal, a NaN, a failed write),
the evidence that the ranks trained as one job, and DDP's gradient compression; `callback` finds one on a trainer."""

from __future__ import annotations

import collections
import functools
import hashlib

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from src.distributed import any_rank, gather_objects
from src.engines import gathered, local_shard, whole
from src.run_safety import hang_watch
from src.run_safety.disk_space import WriteFailed, noticed_write_failure, stop_message
from src.run_safety.parent_watch import LAUNCHER_GONE, kill_starter_if_injected, launcher_gone
from src.run_safety.stops import set_clean_stop_point, stop_signal


class StopConditions(TrainerCallback):
    """After every optimizer step, all ranks agree (one tiny all-reduce) on whether to stop:
    - a stop signal reached any rank: save a checkpoint now and stop;
    - a loss or gradient norm was non-finite on any rank: stop without saving, before the step can be checkpointed.
    Gradients are checked just before the optimizer applies them, and zeroed when non-finite so the in-memory
    weights stay finite too.

    No stall per micro-batch: whether a loss or gradient norm was non-finite, and the first such value, are kept on the
    device; the agreement at the step's end is the one host read of a device value per optimizer step in a training
    step outside logging steps (what this guarantee costs; docs/speed.md)."""

    LOSS, GRADIENT_NORM = 1.0, 2.0  # which value went non-finite first, on the device

    def __init__(self):
        self.non_finite: str | None = None   # what went non-finite, e.g. "loss nan"
        self.diverged_at: int | None = None
        self.stopped_by: str | None = None
        self.stopped_at: int | None = None
        self._first_non_finite: torch.Tensor | None = None  # (kind, value) on the device; kind 0: none yet

    def on_train_begin(self, args, state, control, **kwargs):
        set_clean_stop_point(True)  # a stop asked for from now on (the launcher gone) is taken at a step's end

    def on_train_end(self, args, state, control, **kwargs):
        set_clean_stop_point(False)

    def _note(self, kind: float, value: torch.Tensor) -> torch.Tensor:
        """Keeps `value` (0-d) as the first non-finite one when it is and none was before; whether it is, on the
        device: nothing is read."""
        value = value.detach().float()
        bad = ~torch.isfinite(value)
        candidate = torch.stack([torch.full_like(value, kind), value])
        if self._first_non_finite is None:
            self._first_non_finite = torch.where(bad, candidate, torch.zeros_like(candidate))
        else:
            first = self._first_non_finite
            self._first_non_finite = torch.where(bad & (first[0] == 0), candidate, first)
        return bad

    def on_micro_batch(self, loss, inputs) -> None:
        self._note(self.LOSS, loss.detach().float().mean())

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if not gradients:
            return
        bad = self._note(self.GRADIENT_NORM, whole(torch.nn.utils.get_total_norm(gradients)))  # FSDP2: of shards
        for gradient in gradients:
            local_shard(gradient).masked_fill_(bad, 0)  # zero when non-finite, decided on the device

    def _non_finite_here(self) -> torch.Tensor:
        """1.0 if a loss or gradient norm went non-finite on this rank (on the device), else 0.0."""
        if self._first_non_finite is None:
            return torch.zeros(())
        return (self._first_non_finite[0] != 0).float()

    def _describe(self) -> str | None:
        """The first non-finite value of this rank, as "loss nan" (read once the run has diverged)."""
        if self._first_non_finite is None:
            return None
        kind, value = self._first_non_finite.tolist()
        return None if kind == 0 else f"{'loss' if kind == self.LOSS else 'gradient norm'} {value}"

    def on_step_end(self, args, state, control, **kwargs):
        kill_starter_if_injected(f"step:{state.global_step}", args.process_index)  # a test seam
        signalled, diverged, write_failed = any_rank(stop_signal() is not None, self._non_finite_here(),
                                                      noticed_write_failure() is not None)
        if write_failed:  # a write failed on some rank (rank 0's metrics line, report, tracker): all stop here
            raise WriteFailed(stop_message([failure for (failure,) in gather_objects([noticed_write_failure()])]))
        if diverged:
            self.diverged_at = state.global_step
            reasons = [(rank, reason) for rank, (reason,) in enumerate(gather_objects([self._describe()])) if reason]
            # The rank where it started first: its loss, before the all-reduce spread NaN gradients to every rank.
            reasons.sort(key=lambda item: not item[1].startswith("loss"))
            self.non_finite = ", ".join(f"{reason} (rank {rank})" for rank, reason in reasons)
            control.should_save = False
            control.should_evaluate = False
            control.should_training_stop = True
        elif signalled:
            self.stopped_by = stop_signal() or (LAUNCHER_GONE if launcher_gone() else "a signal to another rank")
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control


class HangBeats(TrainerCallback):
    """Training's beats for the hang watch (src/run_safety/hang_watch.py): each step, micro-batch and evaluation
    batch, and the step times its "no step for ..." line compares with."""

    def on_train_begin(self, args, state, control, **kwargs):
        hang_watch.training_started(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        hang_watch.doing("step", f"step {state.global_step + 1} of {state.max_steps}", state.global_step + 1)

    def on_substep_end(self, args, state, control, **kwargs):
        hang_watch.beat()

    def on_step_end(self, args, state, control, **kwargs):
        hang_watch.step_done(state.global_step)

    def on_prediction_step(self, args, state, control, **kwargs):
        hang_watch.beat()

    def on_train_end(self, args, state, control, **kwargs):
        hang_watch.training_ended()
        hang_watch.doing("final", "after training")


class OneJobCheck(TrainerCallback):
    """Evidence that the ranks trained as one job, checked at the end of training and recorded: the same weights
    on every rank (a DDP desync, or ranks each training alone, would differ) and, within each optimizer step,
    different rows on different ranks (a broken sampler would feed every rank the same data).

    A row is what the rank was given: its index in the training set, as the rank's data loader fetched it (the
    dataset's `__getitems__`, which every map-style torch data loader calls with the rank's own indices). Not its
    content: public sets often hold duplicate rows, which two ranks may legitimately be given in the same step.
    Fetches and micro-batches pair up in order (the loader fetches ahead, never out of order); with
    --dataloader_num_workers the fetches happen in worker processes and no rows are recorded (steps_checked 0).

    Cheap by design: indices for at most MAX_STEPS steps, and the weights as a strided sample of every parameter, so
    a 70B model is not hashed in full on every rank."""

    MAX_STEPS = 64
    WEIGHT_SAMPLES = 4096  # elements sampled per parameter tensor

    def __init__(self):
        self.rows: dict[int, list[int]] = {}
        self.step = 0
        self.result: dict | None = None
        self._fetched: collections.deque[list[int]] = collections.deque()
        self.repeated_from: int | None = None

    def on_train_dataloader(self, dataloader, repeated_from: int | None = None) -> None:
        """Record the indices this rank's training data loader fetches (called by the toolkit's trainers);
        `repeated_from`: the training set's size where it is smaller than a step, whose rows then repeat."""
        self.repeated_from = repeated_from
        dataset = getattr(dataloader, "dataset", None)
        fetch = getattr(dataset, "__getitems__", None)
        if fetch is None:
            return
        fetch = getattr(fetch, "_fetch", fetch)  # a loader of an earlier train() on the same dataset object

        def recording(keys):
            self._fetched.append([int(key) for key in keys])
            return fetch(keys)

        recording._fetch = fetch
        dataset.__getitems__ = recording  # the fetcher looks it up on the object: the dataset itself is unchanged

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_micro_batch(self, loss, inputs) -> None:
        if not self._fetched:
            return
        given = self._fetched.popleft()
        if len(self.rows) >= self.MAX_STEPS and self.step not in self.rows:
            return
        self.rows.setdefault(self.step, []).extend(given)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.blake2b(digest_size=16)
        parameters = dict(model.named_parameters())
        for name, tensor in sorted(model.state_dict().items()):
            # ZeRO-3 and FSDP2: the whole of each parameter, one at a time (a state_dict entry is this rank's share)
            with gathered([parameters[name]] if name in parameters else []):
                flat = whole(parameters.get(name, tensor).detach()).reshape(-1)
                stride = max(1, flat.numel() // self.WEIGHT_SAMPLES)
                digest.update(name.encode() + flat[::stride].float().cpu().numpy().tobytes())
        everyone = gather_objects([(digest.hexdigest(), self.rows)])
        weights = {weights for (weights, _), in everyone}
        shared = steps_with_shared_rows([rows for ((_, rows),) in everyone], self.repeated_from)
        self.result = {"ranks": len(everyone), "identical_weights": len(weights) == 1,
                       "disjoint_rows_per_step": not shared, "steps_checked": len(self.rows),
                       "steps_with_shared_rows": shared[:10]}


def steps_with_shared_rows(rows_per_rank: list[dict[int, list[int]]], repeated_from: int | None = None) -> list[int]:
    """The steps in which two ranks were given the same row (by index), in the first rank's order. With
    `repeated_from` (a training set smaller than a step, src/trainers/stage_plan.py: each step repeats some rows,
    which may fall on two ranks), the steps whose ranks together were not given every one of its rows."""
    steps = dict.fromkeys(step for rows in rows_per_rank for step in rows)
    if repeated_from is not None:
        return [step for step in steps
                if len(set().union(*(rows.get(step, []) for rows in rows_per_rank))) < repeated_from]
    return [step for step in steps
            if any(set(rows_a.get(step, [])) & set(rows_b.get(step, []))
                   for index, rows_a in enumerate(rows_per_rank) for rows_b in rows_per_rank[index + 1:])]


class GradientCompression(TrainerCallback):
    """DDP's compression communication hook (torch's fp16_compress_hook / bf16_compress_hook) on the model accelerate
    wrapped in DDP, counting what it sends: every gradient bucket DDP all-reduces passes through the hook, which casts
    it to 16 bits, so the bytes per step are measured, not assumed."""

    def __init__(self, name: str):
        self.name = name
        self.sent_bytes = 0
        self.uncompressed_bytes = 0
        self.steps = 0
        self.wrapped_as: str | None = None

    def on_model_wrapped(self, model) -> None:
        self.wrapped_as = type(model).__name__
        if not isinstance(model, DistributedDataParallel) or getattr(model, "_prefkit_comm_hook", None):
            return
        compress = getattr(default_hooks, f"{self.name}_compress_hook")

        @functools.wraps(compress)  # DDP checks the hook's name (bf16 only on NCCL): keep its check in force
        def counting_hook(state, bucket):
            buffer = bucket.buffer()
            self.uncompressed_bytes += buffer.numel() * buffer.element_size()
            self.sent_bytes += buffer.numel() * 2  # fp16 and bf16 are 2 bytes per value
            return compress(state, bucket)

        model.register_comm_hook(None, counting_hook)
        model._prefkit_comm_hook = self.name  # DDP takes one hook per model, for good

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1

    def summary(self) -> dict:
        if not self.sent_bytes:
            return {"name": self.name, "applied": False,
                    "reason": f"the trained model was {self.wrapped_as or 'never wrapped'}, not DDP"}
        steps = max(1, self.steps)
        return {"name": self.name, "applied": True, "bytes_per_step": self.sent_bytes // steps,
                "uncompressed_bytes_per_step": self.uncompressed_bytes // steps,
                "saved_fraction": round(1 - self.sent_bytes / self.uncompressed_bytes, 4), "steps": self.steps}


def callback(trainer, name: str):
    """The trainer's callback of this class name (the toolkit adds one of each)."""
    return next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == name)
