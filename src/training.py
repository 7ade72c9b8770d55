"""TRL trainers built from the resolved plan, and the callback that records every logged metric.

The toolkit hands TRL tokenized, file-backed datasets (src/data.py), so the trainers skip their own preparation; the
batch, learning rate, precision and backend come from the plan (src/config.py) and nothing else sets them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

from src import run_files
from src.config import Config, Plan
from src.run_safety.disk_space import (
    WriteFailed, note_write_failure, pending_write_failure, write_failed_message, write_failure_errno,
)
from src.distributed import any_rank, gather_objects, print0
from src.dpo_eval import PairMetrics
from src.models import DropoutOff
from src.packed_dpo import (PackedDPOForward, PackedPreferenceCollator, attention_layout, fused_modules,
                            unsupported_reason)
from src.packed_dpo_support import announce_padded
from src.progress import Progress, eta_seconds, format_duration
from src.reporting.live import LiveReport
from src.run_safety.checkpoints import mark_complete
from src.run_safety.stops import stop_signal
from src.throughput import ThroughputMeter


class CompleteCheckpointsMixin:
    """For transformers Trainers: a checkpoint is marked complete once every rank has saved, and older checkpoints
    are rotated only then (transformers rotates inside the save, so a crash mid-save could leave none whole). A write
    that fails (full disk, quota, I/O error: src/run_safety/disk_space.py) on any rank stops every rank in the same collective,
    with the half-written checkpoint removed and one line naming the newest complete one."""

    _write_failure: tuple[int, Path] | None = None

    def _note_write_failure(self, error: Exception, directory) -> None:
        number = write_failure_errno(error, directory)
        if number is None:
            raise error
        if self._write_failure is None:
            self._write_failure = (number, Path(directory))

    # Each piece of a checkpoint save records its failure instead of raising, so this rank still reaches the
    # collectives transformers runs between the pieces (a barrier after the weights when a best model is tracked).
    def save_model(self, output_dir=None, _internal_call=False):
        if not _internal_call:
            return super().save_model(output_dir, _internal_call)
        try:
            return super().save_model(output_dir, _internal_call)
        except Exception as error:
            self._note_write_failure(error, output_dir)

    def _save_piece(self, save, output_dir) -> None:
        if self._write_failure is None:  # after one failure the rest of this checkpoint is not attempted
            try:
                save(output_dir)
            except Exception as error:
                self._note_write_failure(error, output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        self._save_piece(super()._save_optimizer_and_scheduler, output_dir)

    def _save_rng_state(self, output_dir):
        self._save_piece(super()._save_rng_state, output_dir)

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        try:
            super()._save_checkpoint(model, trial)
        except Exception as error:  # the trainer state, written after every collective of the save
            self._note_write_failure(error, checkpoint)
        finally:
            self.args.save_total_limit = limit
        # Every rank's RNG state and shards are on disk, or some rank could not write its share.
        (failed,) = any_rank(self._write_failure is not None)
        if failed:
            number, directory = next(failure for (failure,) in gather_objects([self._write_failure]) if failure)
            message = write_failed_message(number, directory, Path(run_dir))  # the free space when it failed
            if self.args.should_save:
                shutil.rmtree(checkpoint, ignore_errors=True)  # never complete: its space goes back
            raise WriteFailed(message)
        if self.args.should_save:
            mark_complete(checkpoint)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()


class StopConditions(TrainerCallback):
    """After every optimizer step, all ranks agree (one tiny all-reduce) on whether to stop:
    - a stop signal reached any rank: save a checkpoint now and stop;
    - a loss or gradient norm was non-finite on any rank: stop without saving, before the step can be checkpointed.
    Gradients are checked just before the optimizer applies them, and zeroed when non-finite so the in-memory
    weights stay finite too."""

    def __init__(self):
        self.non_finite: str | None = None   # what went non-finite, e.g. "loss nan"
        self.diverged_at: int | None = None
        self.stopped_by: str | None = None
        self.stopped_at: int | None = None

    def on_micro_batch(self, loss, inputs) -> None:
        import torch

        if self.non_finite is None and not torch.isfinite(loss.detach()).all():
            self.non_finite = f"loss {float(loss.detach().float().mean())}"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch

        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if not gradients:
            return
        norm = torch.nn.utils.get_total_norm(gradients)
        if not torch.isfinite(norm):
            if self.non_finite is None:
                self.non_finite = f"gradient norm {float(norm)}"
            for gradient in gradients:
                gradient.zero_()

    def on_step_end(self, args, state, control, **kwargs):
        signalled, diverged, write_failed = any_rank(stop_signal() is not None, self.non_finite is not None,
                                                      pending_write_failure() is not None)
        if write_failed:  # rank 0 could not append a metrics line: every rank stops here, the same way
            number, directory = next(failure for (failure,) in gather_objects([pending_write_failure()]) if failure)
            raise WriteFailed(write_failed_message(number, directory, Path(args.output_dir)))
        if diverged:
            self.diverged_at = state.global_step
            reasons = [(rank, reason) for rank, (reason,) in enumerate(gather_objects([self.non_finite])) if reason]
            # The rank where it started first: its loss, before the all-reduce spread NaN gradients to every rank.
            reasons.sort(key=lambda item: not item[1].startswith("loss"))
            self.non_finite = ", ".join(f"{reason} (rank {rank})" for rank, reason in reasons)
            control.should_save = False
            control.should_evaluate = False
            control.should_training_stop = True
        elif signalled:
            self.stopped_by = stop_signal() or "a signal to another rank"
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control


class ToolkitTrainerMixin(CompleteCheckpointsMixin):
    """What every toolkit trainer adds to TRL's: complete-only checkpoints, each micro-batch shown to the callbacks
    that watch it (`on_micro_batch(loss, inputs)`: the non-finite guard, the throughput meter, the one-job check),
    the time spent evaluating and checkpointing shown to the callbacks that keep time (`on_pause(seconds)`),
    and the model as accelerate wrapped it (DDP) shown to the callbacks that need it (`on_model_wrapped(model)`:
    gradient compression); Trainer's callbacks only ever see the unwrapped model."""

    def _prepare_for_training(self, *args, **kwargs):
        model, train_dataloader = super()._prepare_for_training(*args, **kwargs)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "on_model_wrapped"):
                callback.on_model_wrapped(model)
        return model, train_dataloader

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "on_micro_batch"):
                callback.on_micro_batch(loss, inputs)
        return loss

    def evaluate(self, *args, **kwargs):
        with self.pause():
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        with self.pause():
            super()._save_checkpoint(model, trial)

    @contextlib.contextmanager
    def pause(self):
        """Time that is not training (evaluation, checkpointing): its length goes to the callbacks that keep time
        (`on_pause(seconds)`: the throughput meter leaves it out of its window)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "on_pause"):
                    callback.on_pause(time.perf_counter() - started)


class PairLengthsMixin:
    """For the pair trainers (DPO, reward), whose own columns are several id lists: keep the "length" column
    src/data.py writes, which is what transformers' LengthGroupedSampler reads for group_by_length."""

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.args.train_sampling_strategy == "group_by_length" and "length" not in self._signature_columns:
            self._signature_columns.append("length")


class PreparedDPOTrainer(PairLengthsMixin, ToolkitTrainerMixin, DPOTrainer):
    """DPOTrainer that accepts data already tokenized by src/data.py (same ids as its own preparation).

    Reference log-probs: TRL precomputes them across all ranks and caches them next to the dataset, keyed by the
    dataset's fingerprint and a hash of the reference weights. Our datasets are file-backed and keyed by source,
    tokenizer and lengths (src/data.py), so that cache persists across runs; the key is widened here with what else
    changes the numbers, and the outcome (reused or computed, how long) is recorded."""

    reference_cache: dict | None = None
    _reference_progress: Progress | None = None  # while the reference pass runs

    def __init__(self, *args, packed_forward=None, **kwargs):
        # Set before TRL's __init__, which already runs the reference precompute pass through it.
        self.packed_forward = packed_forward
        self.pair_metrics = PairMetrics()
        self.dropout_off = []
        if kwargs["args"].disable_dropout:  # before the precompute pass too
            self.dropout_off = [DropoutOff(model) for model in (kwargs.get("model"), kwargs.get("ref_model"))
                                if model is not None and not isinstance(model, str)]
        super().__init__(*args, **kwargs)
        if self.args.disable_dropout:
            if self.ref_model is not None and kwargs.get("ref_model") is None:  # TRL loaded it
                self.dropout_off.append(DropoutOff(self.ref_model))
            if dropout_still_on(self.model, self.args.gradient_checkpointing_kwargs):
                print0(f"  warning: {self.model.config.model_type} still applies dropout after --disable_dropout (a "
                       "dropout the toolkit cannot reach): its DPO log-probs are noisy")

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            for dropout in self.dropout_off:  # the saved config keeps the model's own dropout values
                dropout.restore()

    def _save(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dropout in self.dropout_off:
                stack.enter_context(dropout.restored())
            return super()._save(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """Eval metrics as per-pair means (src/dpo_eval.py): the same on any number of processes and batch size."""
        self.pair_metrics.reset()
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        output.metrics.update(self.pair_metrics.result(metric_key_prefix))
        output.metrics[f"{metric_key_prefix}_num_tokens"] = self._total_train_tokens
        self._metrics["eval"].clear()  # TRL's per-batch means, replaced by the above
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        import torch

        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.pair_metrics.add_batch(self, model, inputs,
                                               lambda model, inputs: self._compute_loss(model, inputs, False))
        return loss.detach(), None, None

    def _compute_loss(self, model, inputs, return_outputs):
        if self.packed_forward is None:
            return super()._compute_loss(model, inputs, return_outputs)
        # Without precomputed reference log-probs the reference forward runs inside the same call.
        forwards = ("policy",) if self.precompute_ref_logps else ("policy", "reference")
        with self.packed_forward.running(inputs, forwards, fused_modules(self)) as inputs:
            return super()._compute_loss(model, inputs, return_outputs)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        from datasets.fingerprint import Hasher

        # Autocast precision, device kind, LD-DPO weighting, truncation and the forward (packed or padded, and the
        # packing code's version) change the log-probs, not the weights.
        how = (self.args.bf16, self.args.fp16, self.accelerator.device.type, self.ld_alpha, self.args.max_length,
               self.args.truncation_mode, self.packed_forward.cache_tag() if self.packed_forward else "padded")
        original = dataset._fingerprint
        cache_dir = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
        started = time.monotonic()
        dataset._fingerprint = Hasher.hash((original, how))
        accelerator, self.accelerator = self.accelerator, _LocalMainAccelerator(self.accelerator)
        # TRL draws a tqdm bar (carriage returns in a log file); one Progress line instead, fed by compute_ref_log_probs
        self._reference_progress = Progress(f"  reference log-probs ({name})", total=len(dataset), unit="pairs",
                                            enabled=accelerator.is_main_process)
        quiet = os.environ.get("TQDM_DISABLE")
        os.environ["TQDM_DISABLE"] = "1"
        try:
            self._same_cache_on_every_machine(dataset)
            before = set(cache_dir.glob("cache-*.arrow")) if cache_dir else set()
            result = super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            dataset._fingerprint = original
            self.accelerator = accelerator
            if quiet is None:
                del os.environ["TQDM_DISABLE"]
            else:
                os.environ["TQDM_DISABLE"] = quiet
            progress, self._reference_progress = self._reference_progress, None
        if progress.done:  # computed, not read from the cache
            progress.close()
        created = sorted(set(cache_dir.glob("cache-*.arrow")) - before) if cache_dir else []
        self.reference_cache = (self.reference_cache or {}) | {name: {
            "cache": "computed" if created else "reused",
            "seconds": round(time.monotonic() - started, 2),
            "rows": len(dataset),
            "file": str(created[0]) if created else None,
        }}
        return result


    def compute_ref_log_probs(self, model, inputs):
        progress = self._reference_progress
        if progress is not None:  # chosen and rejected rows of every rank's micro-batch
            pairs = inputs["input_ids"].shape[0] // 2 * self.accelerator.num_processes
            progress.update(min(pairs, progress.total - progress.done))
        if self.packed_forward is None:
            return super().compute_ref_log_probs(model, inputs)
        with self.packed_forward.running(inputs, ("reference",), fused_modules(self)) as inputs:
            return super().compute_ref_log_probs(model, inputs)

    def _same_cache_on_every_machine(self, dataset) -> None:
        """TRL reuses the cache file where it exists and otherwise computes with collectives on every rank: if one
        machine has the file (a warm cache from an earlier run) and another does not (a new node), the ranks would
        take different paths and hang. Any machine missing it → every machine drops its copy and all compute (the
        same numbers are written back)."""
        from accelerate.utils import broadcast_object_list
        from datasets.fingerprint import Hasher

        if self.accelerator.num_processes == 1:
            return
        fingerprint = [Hasher.hash((dataset._fingerprint, self._precompute_model_hash))]  # as TRL derives it
        broadcast_object_list(fingerprint, from_process=0)
        cache_file = Path(dataset._get_cache_file_path(fingerprint[0]))
        (missing_somewhere,) = any_rank(not cache_file.exists())
        if missing_somewhere:
            self.accelerator.wait_for_everyone()  # every rank has looked before any copy goes
            if self.accelerator.is_local_main_process:
                cache_file.unlink(missing_ok=True)
            self.accelerator.wait_for_everyone()


def dropout_still_on(model, gradient_checkpointing_kwargs: dict | None = None) -> bool:
    """Two train-mode forwards of the same 16 tokens differ: some dropout still reaches the outputs. No grad, the RNG
    state forked (the run's random stream is untouched); a model that cannot run outside its wrapper (sharded weights)
    is not judged."""
    import torch
    from trl.models.utils import disable_gradient_checkpointing

    was_training = model.training
    try:
        device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        input_ids = (torch.arange(16, device=device) * 7 % vocab)[None]
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                disable_gradient_checkpointing(model, gradient_checkpointing_kwargs):
            first, second = (model(input_ids=input_ids, use_cache=False).logits for _ in range(2))
        return not torch.equal(first, second)
    except Exception:  # noqa: BLE001 - a check that cannot run says nothing rather than stopping the run
        return False
    finally:
        model.train(was_training)


class _LocalMainAccelerator:
    """The trainer's accelerator, except that `is_main_process` means the main process of this machine.

    TRL writes the reference log-probs cache next to the dataset on global rank 0 only, then every rank reads it back;
    the dataset cache is per machine (src/data.py), so on a second node the file would not exist. Each node's first
    process writes its own copy (the same gathered numbers; an atomic rename if the cache is shared storage)."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def is_main_process(self) -> bool:
        return self._accelerator.is_local_main_process


class ToolkitSFTTrainer(ToolkitTrainerMixin, SFTTrainer):
    """SFTTrainer with the toolkit's additions (it already skips tokenizing data that has input_ids).

    Padding-free without packing: TRL then refuses a max_length (it would not enforce it), so the SFTConfig gets none
    and the rows are cut here to `truncate_to`, as TRL's own truncation cuts them (rows left with no trained token
    were already dropped by src/data.py)."""

    TRUNCATED_COLUMNS = ("input_ids", "assistant_masks", "completion_mask")

    def __init__(self, *args, truncate_to: int | None = None, **kwargs):
        self.truncate_to = truncate_to
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if self.truncate_to is not None and "input_ids" in dataset.column_names:
            length, keep_end = self.truncate_to, args.truncation_mode == "keep_end"
            columns = [column for column in self.TRUNCATED_COLUMNS if column in dataset.column_names]
            dataset = dataset.map(lambda batch: {column: [values[-length:] if keep_end else values[:length]
                                                          for values in batch[column]] for column in columns},
                                  batched=True, desc=f"Truncating {dataset_name} dataset")
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)


class ToolkitRewardTrainer(PairLengthsMixin, ToolkitTrainerMixin, RewardTrainer):
    """RewardTrainer with the toolkit's additions, on data already tokenized by src/data.py (same ids as its own
    preparation, pairs over max_length already dropped and counted there, so its length filter has nothing to do)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "chosen_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


class MetricsRecorder(TrainerCallback):
    """Appends every logged event to metrics.jsonl on rank 0, as it happens, so a crashed run keeps its curves."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = Path(metrics_path)
        self.started = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "epoch": state.epoch, "time_s": round(time.monotonic() - self.started, 3)}
            record.update(logs)
            try:
                run_files.append_jsonl(self.metrics_path, record)
            except OSError as error:
                note_write_failure(error, self.metrics_path.parent)


class ConsoleLog(TrainerCallback):
    """One compact line per logged event on rank 0 (replaces Trainer's dict printer), ending with the elapsed time and
    the ETA (at the rate since this launch began training, evaluations included)."""

    KEYS = ("loss", "eval_loss", "rewards/margins", "rewards/accuracies", "eval_rewards/accuracies", "margin",
            "accuracy", "eval_accuracy",
            "mean_token_accuracy", "eval_mean_token_accuracy", "learning_rate", "grad_norm", "perf/tokens_per_second")

    def __init__(self):
        self.started = time.monotonic()
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.start_step = time.monotonic(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            line = (f"done in {format_duration(logs['train_runtime'])}, "
                    f"{logs.get('train_samples_per_second', 0):.1f} samples/s")
        else:
            parts = [f"{key} {logs[key]:.4g}" for key in self.KEYS if isinstance(logs.get(key), (int, float))]
            elapsed = time.monotonic() - self.started
            eta = eta_seconds(state.global_step - self.start_step, state.max_steps - self.start_step, elapsed)
            line = "  ".join(parts + [f"elapsed {format_duration(elapsed)}", f"ETA {format_duration(eta)}"])
        print(f"  step {state.global_step:>5}/{state.max_steps}  {line}", flush=True)


class OneJobCheck(TrainerCallback):
    """Evidence that the ranks trained as one job, checked at the end of training and recorded: the same weights
    on every rank (a DDP desync, or ranks each training alone, would differ) and, within each optimizer step,
    different rows on different ranks (a broken sampler would feed every rank the same data).

    Cheap by design: each row is remembered as 8 bytes of a hash (for at most MAX_STEPS steps), and the weights as a
    strided sample of every parameter, so a 70B model is not hashed in full on every rank."""

    MAX_STEPS = 64
    WEIGHT_SAMPLES = 4096  # elements sampled per parameter tensor

    def __init__(self):
        self.rows: dict[int, list[str]] = {}
        self.step = 0
        self.result: dict | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_micro_batch(self, loss, inputs) -> None:
        if len(self.rows) >= self.MAX_STEPS and self.step not in self.rows:
            return
        ids = inputs["input_ids"].detach().cpu()
        mask = inputs.get("attention_mask")
        mask = mask.detach().cpu().bool() if mask is not None else None
        digests = self.rows.setdefault(self.step, [])
        for index, row in enumerate(ids):
            tokens = row[mask[index]] if mask is not None else row
            digests.append(hashlib.blake2b(tokens.numpy().tobytes(), digest_size=8).hexdigest())

    def on_train_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.blake2b(digest_size=16)
        for name, parameter in sorted(model.state_dict().items()):
            flat = parameter.detach().reshape(-1)
            stride = max(1, flat.numel() // self.WEIGHT_SAMPLES)
            digest.update(name.encode() + flat[::stride].float().cpu().numpy().tobytes())
        everyone = gather_objects([(digest.hexdigest(), self.rows)])
        weights = {weights for (weights, _), in everyone}
        shared_steps = [step for step in self.rows
                        if any(set(rows_a.get(step, [])) & set(rows_b.get(step, []))
                               for index, ((_, rows_a),) in enumerate(everyone)
                               for ((_, rows_b),) in everyone[index + 1:])]
        self.result = {"ranks": len(everyone), "identical_weights": len(weights) == 1,
                       "disjoint_rows_per_step": not shared_steps, "steps_checked": len(self.rows),
                       "steps_with_shared_rows": shared_steps[:10]}


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
        import functools

        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

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


# TRL's padding-free SFT batch is one row: the micro-batch's sequences end to end, positions restarting at 0, no
# attention mask. Flash-attention reads the boundaries TRL passes (cu_seq_lens) and attends within each sequence at
# linear cost. sdpa and eager get a block-diagonal causal mask that transformers builds from the restarting positions
# (masking_utils.find_packed_sequence_indices) -- only when no KV cache is passed, which TRL's SFTTrainer ensures
# (use_cache=False); tests/test_sft_padding_free.py checks each sequence's hidden states against the sequence alone.
# That mask is dense, so their attention costs (micro-batch tokens)^2 instead of sequences x length^2: on the embedded
# default (16 rows of 47 tokens on average) a step took 1.4x (sdpa) and 2.1x (eager) the CPU time of the padded one
# (bench/bench_sft_forward.py), so it is not their default.
PADDING_FREE_LINEAR = ("flash_attention_2", "flash_attention_3")
PADDING_FREE_EXACT = PADDING_FREE_LINEAR + ("sdpa", "eager")


def _exact_padding_free(attn_implementation: str) -> bool:
    return attn_implementation in PADDING_FREE_EXACT or "flash-attn" in attn_implementation  # Hub kernels


def resolve_sft_forward(config: Config, attn_implementation: str | None) -> dict:
    """How the SFT stage batches its sequences, decided once from the flags and the loaded model's attention:
    "packed" (TRL's packing, --packing), "padding_free" (TRL's padding_free: one row per micro-batch) or "padded".
    --padding_free unset means: on where it is exact and cheap (flash-attention), off elsewhere. Where the attention
    cannot keep packed sequences apart, packing and padding-free are turned off with a warning (never silently wrong).
    Returns what training_info.json records, with `warning` set when a request was not honoured."""
    attention = attn_implementation or "sdpa"
    requested = config.trl_overrides.get("padding_free")
    strategy = config.trl_overrides.get("packing_strategy", "bfd")
    packing = config.sft.packing
    exact = _exact_padding_free(attention)
    result = {"attn_implementation": attention, "padding_free_requested": requested, "packing_requested": packing,
              "warning": None}
    if packing and strategy == "wrapped":
        # Wrapped packing cuts sequences at row ends and lets them attend across: TRL's own documented trade-off.
        return result | {"forward": "packed", "packing_strategy": strategy, "padding_free": False,
                         "reason": "--packing_strategy wrapped (sequences attend across their boundaries, by design)"}
    if (packing or requested) and not exact:
        asked = "--packing" if packing else "--padding_free"
        return result | {"forward": "padded", "padding_free": False, "reason": f"{attention} attention",
                         "warning": f"{asked} is off: {attention} attention cannot keep packed sequences apart; "
                                    "training on padded batches (use sdpa, eager or flash-attention to pack)"}
    if packing:
        return result | {"forward": "packed", "packing_strategy": strategy, "padding_free": True,
                         "reason": f"--packing ({strategy}): rows of --max_length, exact with {attention}"}
    if requested is None:
        requested = attention in PADDING_FREE_LINEAR or "flash-attn" in attention
        reason = (f"default with {attention}: exact, attention within each sequence" if requested else
                  f"default with {attention}: padding-free is exact but its dense mask over the whole micro-batch "
                  "costs more than the padding it saves (--padding_free true to use it)")
    else:
        reason = f"--padding_free {str(requested).lower()}"
    return result | {"forward": "padding_free" if requested else "padded", "padding_free": bool(requested),
                     "reason": reason}


def _eval_steps(config: Config, total_steps: int | None) -> int | None:
    if config.training.eval_steps is not None:
        return config.training.eval_steps
    return max(1, (total_steps or 1000) // 10)  # about ten evaluations per run


def build_trl_config(stage: str, config: Config, plan: Plan, output_dir: Path, has_validation: bool,
                     total_steps: int | None, sft_forward: dict | None = None):
    """DPOConfig / SFTConfig / RewardConfig from the plan; TRL pass-through fields go last and may set anything not
    derived. For SFT, `sft_forward` (resolve_sft_forward) decides packing and padding-free, whatever was passed."""
    training = config.training
    eval_strategy = training.eval_strategy if has_validation else "no"
    eval_steps = _eval_steps(config, total_steps)
    save_strategy = training.save_strategy
    if save_strategy == "best" and eval_strategy == "no":
        save_strategy = "steps"  # "best" needs evaluations; with no validation split, checkpoint on steps
    common = dict(
        output_dir=str(output_dir),
        run_name=training.run_name,
        seed=training.seed,
        data_seed=training.seed,
        per_device_train_batch_size=plan.per_device_batch_size,
        per_device_eval_batch_size=plan.per_device_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        learning_rate=plan.learning_rate,
        max_steps=training.max_steps,
        num_train_epochs=training.num_epochs,
        warmup_steps=training.warmup_steps,
        lr_scheduler_type=training.lr_scheduler_type,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        bf16=plan.precision == "bf16",
        fp16=plan.precision == "fp16",
        use_cpu=plan.device == "cpu",
        ddp_backend=plan.backend if plan.world_size > 1 else None,
        ddp_find_unused_parameters=False,
        ddp_timeout=3600,
        activation_checkpointing=training.gradient_checkpointing,
        logging_steps=training.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN belongs in the curve, not replaced by the running mean
        eval_strategy=eval_strategy,
        eval_steps=eval_steps,
        save_strategy=save_strategy,
        save_steps=training.save_steps or eval_steps,
        save_total_limit=training.save_total_limit,
        metric_for_best_model="eval_loss" if eval_strategy != "no" else None,
        greater_is_better=False if eval_strategy != "no" else None,
        report_to=[] if training.report_to == ["none"] else training.report_to,
        max_length=config.data.max_length,
        dataset_num_proc=config.data.dataset_num_proc,
        disable_tqdm=True,
        trust_remote_code=config.model.trust_remote_code,
    )
    if stage == "dpo":
        dpo = config.dpo
        precompute = dpo.precompute_ref_log_probs
        if precompute is None:
            precompute = not config.trl_overrides.get("sync_ref_model", False)
        specific = dict(beta=dpo.beta, loss_type=dpo.loss_type, loss_weights=dpo.loss_weights,
                        label_smoothing=dpo.label_smoothing, precompute_ref_log_probs=precompute)
        config_class = DPOConfig
    elif stage == "reward":
        specific = {}
        config_class = RewardConfig
    else:
        sft = config.sft
        specific = dict(assistant_only_loss=sft.assistant_only_loss, completion_only_loss=sft.completion_only_loss,
                        packing=sft.packing)
        config_class = SFTConfig
    overrides = {key: value for key, value in config.trl_overrides.items()
                 if key in {item for item in config_class.__dataclass_fields__}}
    if stage == "sft" and sft_forward is not None:
        overrides |= {"packing": sft_forward["forward"] == "packed", "padding_free": sft_forward["padding_free"]}
        if sft_forward["forward"] == "padding_free":
            overrides["max_length"] = None  # TRL's rule without packing: the trainer truncates (ToolkitSFTTrainer)
    if stage == "dpo":  # TRL 1.16's DPOTrainer ignores padding_free (it pads): build_trainer's packed_dpo answers to it
        overrides.pop("padding_free", None)
    return config_class(**{**common, **specific, **overrides})


def build_trainer(stage: str, model, tokenizer, trl_config, prepared, peft_config, metrics_path: Path,
                  plan: Plan, truncate_to: int | None = None, packed_dpo: bool = True):
    """The stage's trainer with the toolkit's callbacks; for DPO the packed forward unless `packed_dpo` is False
    (`--padding_free false`, src/packed_dpo.padding_free_requested)."""
    trainer_class = {"dpo": PreparedDPOTrainer, "sft": ToolkitSFTTrainer, "reward": ToolkitRewardTrainer}[stage]
    extra = {"truncate_to": truncate_to} if stage == "sft" else {}
    reference_forward = stage == "dpo" and not trl_config.precompute_ref_log_probs and peft_config is None
    dpo_forward = {}
    if stage == "dpo":
        dpo_forward = packed_dpo_forward(model, tokenizer, trl_config, peft_config, packed_dpo)
    # DPO and reward batches hold a chosen and a rejected sequence per pair.
    meter = ThroughputMeter(plan.device, sum(p.numel() for p in model.parameters()), reference_forward,
                            _device_name(plan.device), sequences_per_example=1 if stage == "sft" else 2)
    trainer = trainer_class(
        model=model,
        args=trl_config,
        train_dataset=prepared.train,
        eval_dataset=prepared.validation if trl_config.eval_strategy != "no" else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        # The meter adds perf/* to each record before the recorder writes it.
        callbacks=[meter, MetricsRecorder(metrics_path), ConsoleLog(), StopConditions(), OneJobCheck(),
                   LiveReport(metrics_path.parent, on_pause=meter.on_pause)] + (
            [GradientCompression(plan.ddp_comm_hook)] if plan.ddp_comm_hook != "none" else []),
        **extra,
        **dpo_forward,
    )
    trainer.remove_callback(PrinterCallback)
    if dpo_forward and dpo_forward["packed_forward"].enabled:
        meter.computed_tokens = dpo_forward["packed_forward"].computed_tokens
    return trainer


def packed_dpo_forward(model, tokenizer, trl_config, peft_config, packed: bool = True) -> dict:
    """The trainer arguments of the DPO forward: packed (src/packed_dpo.py) unless `--padding_free false` or the
    model cannot honour it (then TRL's padded forward, with one warning line saying why)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference


    if not packed:
        return {"packed_forward": PackedDPOForward("--padding_free false")}
    reason = unsupported_reason(model, trl_config, peft_config)
    forward = PackedDPOForward(reason, attention_layout(model))
    if reason:
        announce_padded(reason)
        return {"packed_forward": forward}
    pad_token = trl_config.pad_token or tokenizer.pad_token or tokenizer.eos_token
    padded = DataCollatorForPreference(pad_token_id=tokenizer.convert_tokens_to_ids(pad_token),
                                       max_length=trl_config.max_length, truncation_mode=trl_config.truncation_mode,
                                       pad_to_multiple_of=trl_config.pad_to_multiple_of)
    # Attention's work per key against the rest of a token's (projections and MLP, ~12 hidden² per layer, vs ~4 hidden)
    attention_cost = 1 / (3 * model.config.get_text_config().hidden_size)
    return {"packed_forward": forward,
            "data_collator": PackedPreferenceCollator(padded, forward.layout, attention_cost)}


def callback(trainer, name: str):
    """The trainer's callback of this class name (the toolkit adds one of each)."""
    return next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == name)


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else ""


def planned_steps(train_rows: int, plan: Plan, config: Config) -> int:
    """Optimizer steps the run will take (what max_steps or the epochs amount to)."""
    import math

    if config.training.max_steps > 0:
        return config.training.max_steps
    per_epoch = math.ceil(train_rows / (plan.per_device_batch_size * plan.world_size)) // plan.gradient_accumulation_steps
    return max(1, math.ceil(per_epoch * config.training.num_epochs))


def silent_no_op_warnings(stage: str, config: Config, plan: Plan) -> list[str]:
    """Options TRL (or the toolkit) accepts and then ignores: say so instead of letting them do nothing."""
    warnings = []
    if config.training.ddp_comm_hook != plan.ddp_comm_hook:
        warnings.append(f"--ddp_comm_hook {config.training.ddp_comm_hook} is ignored on one process: no gradients "
                        "are all-reduced")
    if stage == "dpo":
        if config.dpo.label_smoothing and set(config.dpo.loss_type) <= {"sigmoid", "ipo", "hinge"}:
            warnings.append(f"label_smoothing {config.dpo.label_smoothing} has no effect with loss_type "
                            f"{config.dpo.loss_type}: it applies to robust and exo_pair")
    return warnings
