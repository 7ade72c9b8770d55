"""The DPO trainer: TRL's DPOTrainer on data src/data/ already tokenized, with the packed forward
(src/packed_dpo.py), per-pair eval metrics (src/dpo_eval.py), dropout off and a reference log-probs cache that
persists across runs."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from datasets.fingerprint import Hasher
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from trl import DPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.utils import hash_module

from src.distributed import any_rank, barrier, print0
from src.engines import gathered, partitioned, sharded, whole
from src.dpo_eval import PairMetrics
from src.models import DropoutOff
from src.packed_dpo import AnswerMaskedCollator, PackedPreferenceCollator, attention_cost_of, forward_plan
from src.packed_forward import fused_modules
from src.packed_layout import ANSWER_MASKS
from src.progress import Progress
from src.run_safety import hang_watch
from src.run_safety.disk_space import fail_write_if_injected, write_failures_noted
from src.run_safety.parent_watch import kill_starter_if_injected
from src.trainers.base import PairLengthsMixin, ToolkitTrainerMixin
from src.trainers.device_metrics import Mean, MetricWindow, Ratio, RunningTokens

# What TRL 1.16's DPOTrainer._compute_loss gathers for its training metrics, in its order (MoE models: "aux_loss"
# first), and how it turns each micro-batch's gathered values into the metrics it logs (src/trainers/device_metrics.py;
# logged as the window's weighted means: the Ratios over its tokens, the Means over its pairs).
DPO_GATHERED = ("entropy_sum", "entropy_tokens", "batch_tokens", "chosen_logits", "chosen_tokens", "rejected_logits",
                "rejected_tokens", "correct_tokens", "accuracy_tokens", "rewards/chosen", "rewards/rejected",
                "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
DPO_METRICS = {"entropy": Ratio("entropy_sum", "entropy_tokens"), "num_tokens": RunningTokens("batch_tokens"),
               "logits/chosen": Ratio("chosen_logits", "chosen_tokens"),
               "logits/rejected": Ratio("rejected_logits", "rejected_tokens"),
               "mean_token_accuracy": Ratio("correct_tokens", "accuracy_tokens"),
               **{name: Mean(name) for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                "rewards/margins", "logps/chosen", "logps/rejected")}}


class PreparedDPOTrainer(PairLengthsMixin, ToolkitTrainerMixin, DPOTrainer):
    """DPOTrainer that accepts data already tokenized by src/data/ (same ids as its own preparation).

    Reference log-probs: TRL precomputes them across all ranks and caches them next to the dataset, keyed by the
    dataset's fingerprint and a hash of the reference weights. Our datasets are file-backed and keyed by source,
    tokenizer and lengths (src/data/), so that cache persists across runs; the key is widened here with what else
    changes the numbers, and the outcome (reused or computed, how long) is recorded."""

    reference_cache: dict | None = None
    _reference_progress: Progress | None = None  # while the reference pass runs

    @staticmethod
    def forward_for(model, tokenizer, trl_config, peft_config, packed: bool = True, attention: str = "auto") -> dict:
        """The trainer arguments of its forward (src/trainers/build.py asks every trainer class that has this)."""
        return packed_dpo_forward(model, tokenizer, trl_config, peft_config, packed, attention)

    def __init__(self, *args, packed_forward=None, **kwargs):
        # Set before TRL's __init__, which already runs the reference precompute pass through it.
        self.packed_forward = packed_forward
        self.pair_metrics = PairMetrics()
        self.dropout_off = []
        if kwargs["args"].disable_dropout:  # before the precompute pass too
            self.dropout_off = [DropoutOff(model) for model in (kwargs.get("model"), kwargs.get("ref_model"))
                                if model is not None and not isinstance(model, str)]
        with hashed_whole(kwargs.get("model"), kwargs.get("ref_model")):
            super().__init__(*args, **kwargs)
        drop_reference_after_pass(self, kwargs.get("ref_model"))
        aux = ("aux_loss",) if self.aux_loss_enabled else ()
        self.metric_window = MetricWindow(aux + DPO_GATHERED, {**{name: Mean(name) for name in aux}, **DPO_METRICS},
                                          "TRL's DPOTrainer", lambda trainer: trainer._metrics, weighted=True)
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

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # A tool trajectory's loss masks reach the collator (TRL keeps only its own columns otherwise).
        self._signature_columns += [key for key in ANSWER_MASKS.values() if key not in self._signature_columns]

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def log(self, *args, **kwargs):
        # The training metrics, kept on the device since the last log, as means over the window's tokens (pairs for
        # the rewards and log-probs), not TRL's mean of micro-batch ratios: the same on any split of a global batch.
        self.metric_window.at_log(self)
        return super().log(*args, **kwargs)

    def evaluation_loop(self, *args, metric_key_prefix: str = "eval", **kwargs):
        """Eval metrics as per-pair means (src/dpo_eval.py): the same on any number of processes and batch size."""
        self.metric_window.flush(self)  # eval logs the running count of training tokens
        self.pair_metrics.reset()
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        output.metrics.update(self.pair_metrics.result(metric_key_prefix))
        output.metrics[f"{metric_key_prefix}_num_tokens"] = self._total_train_tokens
        self._metrics["eval"].clear()  # TRL's per-batch means, replaced by the above
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.pair_metrics.add_batch(self, model, inputs,
                                               lambda model, inputs: self._compute_loss(model, inputs, False))
        return loss.detach(), None, None

    def _compute_loss(self, model, inputs, return_outputs):
        # A training micro-batch's metrics stay on the device until the next log (no stall per step); eval's are
        # per-pair means (src/dpo_eval.py).
        metrics = self.metric_window.recording(self) if self.model.training else contextlib.nullcontext()
        if self.packed_forward is None:
            with metrics:
                return super()._compute_loss(model, inputs, return_outputs)
        # Without precomputed reference log-probs the reference forward runs inside the same call.
        forwards = ("policy",) if self.precompute_ref_logps else ("policy", "reference")
        with self.packed_forward.running(inputs, forwards, fused_modules(self)) as inputs, metrics:
            return super()._compute_loss(model, inputs, return_outputs)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        how = reference_cache_how(self.args, self.accelerator.device.type, self.ld_alpha,
                                  self.packed_forward.cache_tag() if self.packed_forward else "padded")
        # TRL draws a tqdm bar (carriage returns in a log file); one Progress line instead, fed by compute_ref_log_probs
        self._reference_progress = Progress(f"  reference log-probs ({name})", total=len(dataset), unit="pairs",
                                            enabled=self.accelerator.is_main_process)
        try:
            with reference_cache_pass(self, dataset, name, how, trl_key=()):
                result = super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            progress, self._reference_progress = self._reference_progress, None
        if progress.done:  # computed, not read from the cache
            progress.close()
        return result

    def compute_ref_log_probs(self, model, inputs):
        progress = self._reference_progress
        if progress is not None:  # chosen and rejected rows of every rank's micro-batch
            pairs = inputs["input_ids"].shape[0] // 2 * self.accelerator.num_processes
            progress.update(min(pairs, progress.total - progress.done))
        kill_starter_if_injected("reference", self.accelerator.process_index)  # a test seam
        with hang_watch.phase("reference", f"a batch of {inputs['input_ids'].shape[0] // 2} pairs"):
            if self.packed_forward is None:
                return super().compute_ref_log_probs(model, inputs)
            with self.packed_forward.running(inputs, ("reference",), fused_modules(self)) as inputs:
                return super().compute_ref_log_probs(model, inputs)


def dropout_still_on(model, gradient_checkpointing_kwargs: dict | None = None) -> bool:
    """Two train-mode forwards of the same 16 tokens differ: some dropout still reaches the outputs. No grad, the RNG
    state forked (the run's random stream is untouched); a model that cannot run outside its wrapper (sharded weights)
    is not judged."""
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
    the dataset cache is per machine (src/data/), so on a second node the file would not exist. Each node's first
    process writes its own copy (the same gathered numbers; an atomic rename if the cache is shared storage)."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def is_main_process(self) -> bool:
        return self._accelerator.is_local_main_process

    def wait_for_everyone(self) -> None:
        barrier()  # after the cache is written: a failed write there stops every rank here, together


def reference_cache_how(args, device_type: str, ld_alpha, forward: str) -> tuple:
    """What changes DPO's reference log-probs besides the prepared data (source, tokenizer, lengths: its fingerprint)
    and the weights (TRL's model hash): autocast precision, device kind, LD-DPO weighting, truncation, and the forward
    (packed or padded, and the packing code's version)."""
    return args.bf16, args.fp16, device_type, ld_alpha, args.max_length, args.truncation_mode, forward


@contextlib.contextmanager
def reference_cache_pass(trainer, dataset, name: str, how: tuple, trl_key: tuple):
    """TRL's `_precompute_ref_logps` as the toolkit runs it, for DPO and KTO alike: TRL's cache next to the prepared
    split, keyed also by `how` (what changes the numbers beyond TRL's key: precision, device kind, lengths, ...); one
    copy per machine (_LocalMainAccelerator); the same path on every machine (_same_cache_on_every_machine); a failed
    write noted; TRL's tqdm bar off; what happened (computed or reused, seconds) in `trainer.reference_cache`.
    `trl_key`: what the TRL trainer adds to (fingerprint, model hash) in its cache key (KTO: whether the KL is on)."""
    rehash_reference_weights(trainer)
    original = dataset._fingerprint
    cache_dir = Path(dataset.cache_files[0]["filename"]).parent if dataset.cache_files else None
    started = time.monotonic()
    dataset._fingerprint = Hasher.hash((original, how))
    accelerator, trainer.accelerator = trainer.accelerator, _LocalMainAccelerator(trainer.accelerator)
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        _same_cache_on_every_machine(trainer, dataset, trl_key)
        before = set(cache_dir.glob("cache-*.arrow")) if cache_dir else set()
        dataset.map = _map_noting_write_failures(dataset.map)  # TRL writes the cache with it
        try:
            yield
        finally:
            del dataset.map
    finally:
        dataset._fingerprint = original
        trainer.accelerator = accelerator
        _release_inference_engine(trainer)
        if quiet is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = quiet
    created = sorted(set(cache_dir.glob("cache-*.arrow")) - before) if cache_dir else []
    trainer.reference_cache = (getattr(trainer, "reference_cache", None) or {}) | {name: {
        "cache": "computed" if created else "reused",
        "seconds": round(time.monotonic() - started, 2),
        "rows": len(dataset),
        "file": str(created[0]) if created else None,
    }}


class _WholeOnRead:
    """A sharded weight (a ZeRO-3 partition, an FSDP2 DTensor) that TRL's `hash_module` reads (`.cpu()`) as the whole
    tensor, gathered then."""

    def __init__(self, parameter):
        self.parameter = parameter

    def cpu(self) -> torch.Tensor:
        with gathered([self.parameter]):
            return whole(self.parameter.detach()).cpu().clone()


@contextlib.contextmanager
def hashed_whole(*modules):
    """TRL's trainers key the reference log-probs cache by `hash_module` of the reference (or of the policy) as their
    __init__ takes it, reading each weight's `.cpu()`: a ZeRO-3 partition reads as an empty tensor (every model of the
    same shapes one key, another model's cache reused) and an FSDP2 DTensor not at all (`.numpy()` refuses tensor
    subclasses). For that __init__, a sharded module's state_dict reads every weight whole, one gathered at a time:
    the key a DDP run of the same model computes, so a cache is shared across engines."""
    shadowed = [module for module in modules if module is not None and not isinstance(module, str)
                and sharded(module.parameters())]
    for module in shadowed:  # TRL calls `state_dict()` bare; anything else (a wrapper's recursion) gets torch's own
        own = type(module).state_dict
        module.state_dict = lambda *args, module=module, own=own, **kwargs: own(module, *args, **kwargs) if (
            args or kwargs) else {name: _WholeOnRead(value) if sharded([value]) else value.detach()
                                  for name, value in own(module, keep_vars=True).items()}
    try:
        yield
    finally:
        for module in shadowed:
            del module.state_dict


def drop_reference_after_pass(trainer, given_reference) -> None:
    """Under FSDP, TRL frees the reference it loaded for the precompute pass once the pass is done; the one the
    toolkit gives it there (the starting model loaded a share per rank: src/pipeline/training.py) goes the same way."""
    precomputed = getattr(trainer, "precompute_ref_logps", None) or trainer.args.precompute_ref_log_probs
    if given_reference is not None and precomputed and trainer.is_fsdp_enabled:
        trainer.ref_model = None

def base_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    """A PEFT model's base weights, what its reference runs (the base with its adapters disabled), named as the same
    model without adapters names them: no adapter's tensors (the names each tuner layer declares in
    `adapter_layer_names`: lora_A, lora_B, ...), and no `base_layer` (where a tuner layer keeps the layer it wraps) in
    a name."""
    base = model.get_base_model()
    adapter_names = {name for module in base.modules() if isinstance(module, BaseTunerLayer)
                     for name in module.adapter_layer_names}
    weights = {}
    for name, tensor in base.state_dict(keep_vars=True).items():
        parts = name.split(".")
        if not adapter_names.intersection(parts):
            weights[".".join(part for part in parts if part != "base_layer")] = tensor
    return weights


class _ReferenceWeights:
    """A module as `hash_module` sees it (its state_dict): the weights its reference forward runs (a PEFT model's
    base weights), each detached as state_dict() gives them, a sharded weight (ZeRO-3, FSDP2) whole as it is read, one
    at a time."""

    def __init__(self, module, adapters: bool):
        self.module, self.adapters = module, adapters

    def state_dict(self) -> dict:
        named = base_weights(self.module) if self.adapters else self.module.state_dict(keep_vars=True)
        return {name: _WholeOnRead(value) if sharded([value]) else value.detach() for name, value in named.items()}


def rehash_reference_weights(trainer) -> None:
    """TRL keys the reference cache by a hash of the reference's weights (`_precompute_model_hash`), taken in its
    `__init__` over the module as held. Taken again here with TRL's own function where that key is not the
    reference's: under ZeRO-3 the weights are partitioned as they load (each rank's empty tensors would key every
    model of the same shapes alike: another model's cache reused), so each is gathered whole as it is read, the key a
    DDP run computes; with adapters the reference is the base with its adapters disabled, so the key is the base's
    weights alone, the key of the same base trained without adapters (a LoRA run and a full one share their cache;
    the adapters' rank and random start do not enter it)."""
    model = trainer.accelerator.unwrap_model(trainer.ref_model or trainer.model)  # TRL hashed it unwrapped
    adapters = trainer.ref_model is None and isinstance(model, PeftModel)
    if getattr(trainer, "_precompute_model_hash", None) is None or getattr(trainer, "_rehashed", False) or not (
            adapters or partitioned(model.parameters())):  # FSDP2's DTensors: read whole already (hashed_whole)
        return
    trainer._precompute_model_hash = hash_module(_ReferenceWeights(model, adapters))
    trainer._rehashed = True


def _release_inference_engine(trainer) -> None:
    """Under DeepSpeed TRL runs the pass through an inference engine of its own built on the policy's modules
    (`_precompute_engine`); under ZeRO-3 its parameter hooks would stay on them next to the training engine's, whose
    first step then fails inside DeepSpeed ("IndexError: pop from an empty deque"). Released after the pass (its
    hooks removed; the weights stay partitioned for the training engine); a later pass builds another."""
    engine = getattr(trainer, "_precompute_engine", None)
    if engine is not None:
        engine.destroy()
        trainer._precompute_engine = None


def _same_cache_on_every_machine(trainer, dataset, trl_key: tuple) -> None:
    """TRL reuses the cache file where it exists and otherwise computes with collectives on every rank: if one
    machine has the file (a warm cache from an earlier run) and another does not (a new node), the ranks would
    take different paths and hang. Any machine missing it → every machine drops its copy and all compute (the
    same numbers are written back)."""
    if trainer.accelerator.num_processes == 1:
        return
    fingerprint = [Hasher.hash((dataset._fingerprint, trainer._precompute_model_hash, *trl_key))]  # as TRL derives it
    broadcast_object_list(fingerprint, from_process=0)
    cache_file = Path(dataset._get_cache_file_path(fingerprint[0]))
    (missing_somewhere,) = any_rank(not cache_file.exists())
    if missing_somewhere:
        trainer.accelerator.wait_for_everyone()  # every rank has looked before any copy goes
        if trainer.accelerator.is_local_main_process:
            cache_file.unlink(missing_ok=True)
        trainer.accelerator.wait_for_everyone()


def _map_noting_write_failures(dataset_map):
    """Dataset.map as TRL calls it to write the reference log-probs cache (one process per machine): a failed write
    is noted (src/run_safety/disk_space.py), so that process still reaches the barrier after it, where every rank
    stops together, instead of raising alone while the others wait there."""

    def map_noted(*args, **kwargs):
        with write_failures_noted(Path(kwargs.get("cache_file_name") or ".").parent):
            if kwargs.get("cache_file_name"):
                fail_write_if_injected(Path(kwargs["cache_file_name"]))
            return dataset_map(*args, **kwargs)

    return map_noted


def packed_dpo_forward(model, tokenizer, trl_config, peft_config, packed: bool = True, attention: str = "auto") -> dict:
    """The trainer arguments of the DPO forward: packed (src/packed_dpo.py) unless `--padding_free false` or the
    model cannot honour it (then TRL's padded forward, with one warning line saying why); `attention`:
    --packed_attention."""
    forward = forward_plan(model, trl_config, peft_config, packed, attention)
    pad_token = trl_config.pad_token or tokenizer.pad_token or tokenizer.eos_token
    padded = DataCollatorForPreference(pad_token_id=tokenizer.convert_tokens_to_ids(pad_token),
                                       max_length=trl_config.max_length, truncation_mode=trl_config.truncation_mode,
                                       pad_to_multiple_of=trl_config.pad_to_multiple_of)
    if not forward.enabled:  # TRL's padded forward, with the answers' loss masks of tool trajectories applied
        return {"packed_forward": forward, "data_collator": AnswerMaskedCollator(padded)}
    return {"packed_forward": forward,
            "data_collator": PackedPreferenceCollator(padded, forward.layout, attention_cost_of(model),
                                                      attention=forward.attention)}
