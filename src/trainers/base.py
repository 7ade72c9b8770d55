"""What every toolkit trainer adds to TRL's: complete-only checkpoints and the hooks its callbacks watch; the reference of
a model whose LoRA adapters the toolkit added as it loaded (`reference_is_the_base`)."""

from __future__ import annotations

import contextlib
import functools
import time

from torch.utils.data import RandomSampler
from transformers import TrainerCallback

from src.distributed import any_rank
from src.engines import local_shard
from src.models import ModelError
from src.run_safety import hang_watch, resharding
from src.run_safety.disk_space import write_failures_noted
from src.trainers.checkpointing import CompleteCheckpointsMixin
from src.trainers.resume_state import restore_window
from src.trainers.stage_plan import trained_per_epoch
from src.vision import IMAGE_COLUMN


class ToolkitTrainerMixin(CompleteCheckpointsMixin):
    """What every toolkit trainer adds to TRL's: complete-only checkpoints, each micro-batch shown to the callbacks
    that watch it (`on_micro_batch(loss, inputs)`: the non-finite guard, the throughput meter, the one-job check),
    the time spent evaluating and checkpointing shown to the callbacks that keep time (`on_pause(seconds)`),
    the model as accelerate wrapped it (DDP) shown to the callbacks that need it (`on_model_wrapped(model)`:
    gradient compression), and the training data loader to those that record what it gives this rank
    (`on_train_dataloader(dataloader, repeated_from)`: the one-job check; `repeated_from`: the training set's size
    where each step repeats some of its rows, else None); Trainer's callbacks only ever see the unwrapped model."""

    repeated_from = None  # set by _get_train_sampler where a step holds more rows than the training set

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._signature_columns is not None and IMAGE_COLUMN not in self._signature_columns:
            self._signature_columns.append(IMAGE_COLUMN)  # a row's images reach its collator (src/vision.py)

    def train(self, *args, **kwargs):
        for callback in self.callback_handler.callbacks:
            note_write_failures(callback, self.args.output_dir)
        return super().train(*args, **kwargs)

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "on_train_dataloader"):
                callback.on_train_dataloader(dataloader, self.repeated_from)
        return dataloader

    def _get_train_sampler(self, train_dataset=None):
        """transformers' shuffle, each epoch cut to whole global batches (stage_plan.trained_per_epoch says why).
        RandomSampler's `num_samples` below the data's size yields the first ones of the same permutation, and
        accelerate keeps it when it makes the sampler seedable (the same order on every process and at a resume)."""
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is not RandomSampler or not len(sampler.data_source):  # group_by_length, sequential, GRPO's
            return sampler  # repeated prompts: their own order
        global_batch = self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
        trained = trained_per_epoch(len(sampler.data_source), global_batch)
        self.repeated_from = len(sampler.data_source) if trained > len(sampler.data_source) else None
        return RandomSampler(sampler.data_source, num_samples=trained, generator=sampler.generator)

    def _prepare_for_training(self, *args, **kwargs):
        model, train_dataloader = super()._prepare_for_training(*args, **kwargs)
        if resharding.loads_universal(self):  # DeepSpeed has just loaded the universal checkpoint
            resharding.own_step_counters(self.optimizer)
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
        checkpoint = kwargs.get("resume_from_checkpoint")
        if checkpoint is not None and kwargs.get("epoch") == kwargs.get("epochs_trained"):
            # transformers opened an empty logging window at the resume: the checkpoint's own goes back in
            restore_window(self, checkpoint)
        return super()._run_epoch(*args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        seen = self.micro_batch_seen(inputs)
        for callback in self.callback_handler.callbacks:
            if hasattr(callback, "on_micro_batch"):
                callback.on_micro_batch(loss, seen)
        return loss

    def micro_batch_seen(self, inputs):
        """The micro-batch as the callbacks read it (input_ids, attention_mask): the collated one, unless the trainer
        makes its sequences inside the step (GRPO: the sampled answers after their prompts)."""
        return inputs

    def evaluate(self, *args, **kwargs):
        with self.pause(), hang_watch.phase("evaluation", f"after step {self.state.global_step}"):
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        with self.pause(), hang_watch.phase("checkpoint", f"checkpoint-{self.state.global_step}"):
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


def note_write_failures(callback, directory) -> None:
    """Every event of `callback` (the toolkit's, and the trackers' integrations: metrics.jsonl, the live report and
    its plots, TensorBoard's files) notes a failed write instead of raising it on this rank alone, while the others
    go on into the next collective: StopConditions stops every rank at the end of the step (a later callback of the
    same event still runs, so every rank reaches that check)."""
    if getattr(callback, "_notes_write_failures", False):
        return
    for name in dir(TrainerCallback):
        if name.startswith("on_"):
            event = getattr(callback, name)

            @functools.wraps(event)
            def noted(*args, _event=event, **kwargs):
                with write_failures_noted(directory):
                    return _event(*args, **kwargs)

            setattr(callback, name, noted)
    callback._notes_write_failures = True


class PairLengthsMixin:
    """For the pair trainers (DPO, reward) and KTO, whose own columns are several id lists: keep the "length" column
    src/data/ writes, which is what transformers' LengthGroupedSampler reads for group_by_length."""

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.args.train_sampling_strategy == "group_by_length" and "length" not in self._signature_columns:
            self._signature_columns.append("length")


# A LoRA adapter's second factor (peft's names for a linear layer's and an embedding's): zero in a new adapter
LORA_SECOND_FACTORS = ("lora_B", "lora_embedding_B")


@contextlib.contextmanager
def reference_is_the_base(model, ref_model=None):
    """A block around TRL's DPO, KTO or GRPO `__init__` handed a model whose LoRA adapters were added as it loaded
    (under FSDP2, before it was sharded: src/sharded_weights.py `with_adapters`), and no reference model.

    Handed a PEFT model, TRL takes its adapter for a trained starting point and copies it into a frozen "ref" adapter to
    run the reference through (peft's `add_adapter("ref")`, then each "default" weight copied into its twin). That copy
    cannot be made here (the new adapter's weights are whole tensors beside FSDP2's shards, and FSDP2 takes no new
    weights once it has sharded a model), and it is not needed: the adapter is new, its second factor (LoRA's B) zero,
    so the adapted model is the base, as a copy of it would be. In the block TRL's "ref" adapter is not added and its
    copy of each weight lands on that weight itself (a no-op); TRL then runs its reference as for an adapter it adds
    itself (as on DDP, where it is given the LoRA config): the base with the adapters disabled, nothing copied.

    An adapter already trained (some second factor not zero) would need TRL's copy as its reference: the toolkit never
    starts from one (--model_name_or_path refuses an adapter: pass its merged model), and one here is refused."""
    from peft import PeftModel

    if ref_model is not None or not isinstance(model, PeftModel):
        yield
        return
    (trained,) = any_rank(any(bool(local_shard(parameter.detach()).count_nonzero())
                              for name, parameter in model.named_parameters()
                              if any(f"{factor}." in name for factor in LORA_SECOND_FACTORS)))
    if trained:
        raise ModelError("the model's LoRA adapter is trained already (its B factors are not zero): a stage with a "
                         "reference starts from a model whose adapter is new; merge the adapter into its base (peft's "
                         "merge_and_unload) and start from that")
    own_add_adapter, own_get_parameter = type(model).add_adapter, type(model).get_parameter
    model.add_adapter = lambda name, *args, **kwargs: None if name == "ref" else own_add_adapter(
        model, name, *args, **kwargs)
    model.get_parameter = lambda target: own_get_parameter(model, target.replace(".ref.", ".default."))
    try:
        yield
    finally:
        del model.add_adapter, model.get_parameter
