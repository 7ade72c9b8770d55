"""What every toolkit trainer adds to TRL's: complete-only checkpoints and the hooks its callbacks watch."""

from __future__ import annotations

import contextlib
import time

from src.trainers.checkpointing import CompleteCheckpointsMixin


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

    def _run_epoch(self, *args, **kwargs):
        # Resumed from the final checkpoint (a kill after training finished): nothing is left to train. transformers
        # would train one more step when the last step falls mid-epoch (it skips the trained batches, then steps).
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

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
