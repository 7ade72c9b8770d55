"""The KTO trainer: TRL's KTOTrainer on data src/data/ prepared, made world-size invariant. Everything that reaches
into KTOTrainer's internals lives in this file (a TRL upgrade is this file's work).

Why: TRL 1.16 forms the KL term of KTO's loss from completions cycled inside each device's micro-batch (row i's KL
completion is row i-1's) and estimates the KL per micro-batch (`gather_for_metrics(kl).mean()`), and logs each metric
as a mean of per-micro-batch means. The same global batch on 1, 2 or 4 processes (or with 4, 2 or 1 accumulation
steps) then pairs other completions, gives another KL, another loss and other rewards.

How, keeping TRL's loss code (both loss types, the weights, the metrics):
1. each row's KL completion is fixed at preparation by a seeded derangement over the split (src/data/
   `kl_partners`: the `KL_completion_ids` column), so it depends on the data and the seed only;
2. the KL estimate of an optimizer step is taken over the step's whole global batch, before its micro-steps: the
   step's micro-batches are fetched up front by transformers' loop (`get_batch_samples`), their KL log-ratios computed
   without gradients (as TRL does, the term is detached), summed across processes and divided by the rows; that one
   value is the KL of every micro-batch of the step (`training_loss`; TRL's own `_compute_loss`, which the tests
   compare with, gets it through `_compute_kl_logps`, the one place TRL reads the KL sequences from);
3. the train metrics are kept with their weights (rows of each class, completion tokens) and logged as weighted means
   over the logging window, not as means of micro-batch means; the training step computes TRL's loss (`kto_row_values`,
   checked against TRL's `_compute_loss` in tests/test_kto.py) without a host read (TRL's reads its KL, which its loss
   then uses, and 14 metric values per micro-batch): the metrics stay on the device until a log
   (src/trainers/device_metrics.py);
4. evaluation takes the KL over the whole validation split first, then each row's loss, reward and log-prob
   (`kto_row_values`, TRL's formula, checked against TRL's `_compute_loss` in tests/test_kto.py), gathered without
   accelerate's duplicated rows.
The loss of a micro-batch stays TRL's mean over its rows, so the gradient (mean over micro-steps and processes of equal
micro-batches) is the mean over the global batch's rows: the same on any split of it.

The packed forward (src/packed_dpo.py) serves every forward of the training, each checked against the padded one on
the run's first batch:
- the reference pass (`precompute_ref_log_probs`, the default), prefix-shared: a row's completion and its KL completion
  share the row's prompt, as a pair's two answers do, so the pass computes each prompt once in one forward instead of
  two padded forwards (completions, then KL completions);
- the training step's two passes, padding-free but not prefix-shared: the KL pass (no gradients, the step's whole
  batch first) and the completion pass (with gradients) stay separate calls, as the step's KL must be known before the
  first micro-batch's loss (docs/objectives.md, "KTO's training step"); each is packed on its own, one `[prompt |
  answer]` segment per row, so only padding is dropped. The collator adds both layouts (the KL pass's keys after
  "KL_"); the loss code reads the per-token outputs scattered back into TRL's padded layout.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.nn.functional as F
from accelerate.utils import is_peft_model
from trl import KTOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from src.packed_dpo import PackedPreferenceCollator, attention_cost_of, forward_plan
from src.packed_forward import fused_modules
from src.packed_layout import PACKED_KEYS, padded_counts
from src.run_safety import hang_watch
from src.trainers.base import PairLengthsMixin, ToolkitTrainerMixin
from src.trainers.device_metrics import Mean, MetricWindow, Ratio, RunningTokens
from src.trainers.dpo import drop_reference_after_pass, hashed_whole, reference_cache_pass

# A training micro-batch's values on this rank (`training_values`), kept on the device until a log, and the metrics TRL's
# KTOTrainer logs from them: each a weighted mean over the logging window, weighted by its denominator (rows of its
# class, completion tokens; the KL and aux_loss by micro-batch).
KTO_VALUES = ("kl", "entropy_sum", "tokens", "batch_tokens", "chosen_logits", "chosen_tokens", "rejected_logits",
              "rejected_tokens", "chosen", "rejected", "reward_chosen", "reward_rejected", "logps_chosen",
              "logps_rejected")
KTO_METRICS = {"kl": Mean("kl"), "entropy": Ratio("entropy_sum", "tokens"), "num_tokens": RunningTokens("batch_tokens"),
               "logits/chosen": Ratio("chosen_logits", "chosen_tokens"),
               "logits/rejected": Ratio("rejected_logits", "rejected_tokens"),
               "rewards/chosen": Ratio("reward_chosen", "chosen"), "logps/chosen": Ratio("logps_chosen", "chosen"),
               "rewards/rejected": Ratio("reward_rejected", "rejected"),
               "logps/rejected": Ratio("logps_rejected", "rejected")}


def kto_row_values(policy_logps, reference_logps, labels, kl, beta: float, loss_type: str,
                   desirable_weight: float, undesirable_weight: float) -> dict:
    """Each row's KTO loss and reward, TRL 1.16's formula (KTOTrainer._compute_loss): a desirable row's loss is
    1 - sigmoid(beta (logratio - KL)), an undesirable row's 1 - sigmoid(beta (KL - logratio)), weighted by its class's
    weight (apo_zero_unpaired: without the KL)."""
    logratios = policy_logps - reference_logps
    labels = labels.bool()
    if loss_type == "kto":
        desirable = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable = 1 - F.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        desirable = 1 - F.sigmoid(beta * logratios)
        undesirable = F.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss type {loss_type}")
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return {"loss": losses, "reward": beta * logratios.detach(), "logps": policy_logps.detach()}


COMPLETIONS = ("completion_ids", "KL_completion_ids")  # a row's two answers to its prompt (the reference pass's pair)


def completion_logps(outputs, inputs) -> torch.Tensor:
    """Each row's summed log-prob of its completion (the positions of the real tokens, as TRL keeps them)."""
    return outputs.log_probs[:, -(inputs["input_ids"].size(1) - 1):].sum(-1)


def training_values(outputs, inputs, values: dict, kl) -> list[torch.Tensor]:
    """A training micro-batch's KTO_VALUES on this rank, on the device: the sums and counts TRL 1.16's
    KTOTrainer._compute_loss gathers for its metrics (its boolean indexing by class as masks: no read)."""
    seq_len = inputs["input_ids"].size(1) - 1
    labels = inputs["label"].bool()
    mask = inputs["completion_mask"][:, 1:].bool()
    chosen_mask, rejected_mask = mask & labels[:, None], mask & ~labels[:, None]
    entropy, mean_logits = outputs.entropy[:, -seq_len:].detach(), outputs.mean_logits[:, -seq_len:].detach()

    def by_class(per_row, rows):
        return torch.where(rows, per_row, 0).nansum()

    return [kl, (entropy * mask).sum(), mask.sum(), inputs["attention_mask"].sum(),
            torch.where(chosen_mask, mean_logits, 0).sum(), chosen_mask.sum(),
            torch.where(rejected_mask, mean_logits, 0).sum(), rejected_mask.sum(), labels.sum(), (~labels).sum(),
            by_class(values["reward"], labels), by_class(values["reward"], ~labels),
            by_class(values["logps"], labels), by_class(values["logps"], ~labels)]


def kl_width(batch: dict) -> int:
    return batch["KL_input_ids"].shape[1]


def one_pass(batch: dict, prefix: str) -> dict:
    """One padded pass of a KTO batch (its completions, or with prefix "KL_" its KL completions) as the packed forward
    reads a batch: input_ids, attention_mask, completion_mask and that pass's packed keys."""
    return {key: batch[prefix + key] for key in ("input_ids", "attention_mask", "completion_mask", *PACKED_KEYS)
            if prefix + key in batch}


def without_packed(batch: dict) -> dict:
    """The batch as TRL's loss code takes it (it hands every key it does not know to the model)."""
    return {key: value for key, value in batch.items() if key.removeprefix("KL_") not in PACKED_KEYS}


def completions_width(batch: dict) -> int:
    return max(batch["input_ids"].shape[1], batch["KL_input_ids"].shape[1])


def stacked_completions(batch: dict, pad_token_id: int) -> dict:
    """`[completions; KL completions]` as one right-padded batch: the padded layout the packed forward stands in for."""
    width = completions_width(batch)

    def stack(key: str, value: int):
        return torch.cat([F.pad(batch[name], (0, width - batch[name].shape[1]), value=value)
                          for name in (key, f"KL_{key}")])

    return {"input_ids": stack("input_ids", pad_token_id), "attention_mask": stack("attention_mask", 0),
            "completion_mask": stack("completion_mask", 0)}


def two_pass_counts(batch: dict) -> list[int]:
    """computed, padding, repeated prompt, useful tokens of TRL's two padded reference forwards (completions, then KL
    completions, each padded to its own longest): the KL pass computes every prompt a second time."""
    computed = batch["input_ids"].numel() + batch["KL_input_ids"].numel()
    real = int(batch["attention_mask"].sum() + batch["KL_attention_mask"].sum())
    repeated = int(batch["KL_attention_mask"].sum() - batch["KL_completion_mask"].sum())
    return [computed, computed - real, repeated, real - repeated]


class PreparedKTOTrainer(PairLengthsMixin, ToolkitTrainerMixin, KTOTrainer):
    """KTOTrainer on data tokenized by src/data/ (same ids as its own preparation, plus the fixed KL completions),
    with the step's KL over its global batch, weighted train metrics and per-row eval metrics."""

    reference_cache: dict | None = None

    @staticmethod
    def forward_for(model, tokenizer, trl_config, peft_config, packed: bool = True, attention: str = "auto") -> dict:
        """The trainer arguments of its forward (src/trainers/build.py asks every trainer class that has this)."""
        return {"packed_forward": forward_plan(model, trl_config, peft_config, packed, attention)}

    def __init__(self, *args, packed_forward=None, **kwargs):
        self.packed_forward = packed_forward  # before TRL's __init__, which runs the reference pass
        args_ = kwargs["args"]
        # TRL refuses any sampling but sequential when it estimates the KL, because its KL pairs are neighbours in a
        # fixed-order batch. Here they are fixed in the data, so the rows may be shuffled like any other stage's.
        strategy, args_.train_sampling_strategy = args_.train_sampling_strategy, "sequential"
        self._kl_values: list | None = None  # while _compute_loss runs with a fixed KL: policy's, then reference's
        self._step_kl: torch.Tensor | None = None
        try:
            with hashed_whole(kwargs.get("model"), kwargs.get("ref_model")):
                super().__init__(*args, **kwargs)
        finally:
            args_.train_sampling_strategy = strategy
        drop_reference_after_pass(self, kwargs.get("ref_model"))
        aux = ("aux_loss",) if self.aux_loss_enabled else ()
        self.metric_window = MetricWindow(KTO_VALUES + aux, {**KTO_METRICS, **{name: Mean(name) for name in aux}},
                                          "the KTO training step", lambda trainer: trainer._metrics, weighted=True)
        self.padded_collator = self.data_collator  # TRL's (the reference pass's collator wraps it)
        if self._packs():
            self.data_collator = self.step_collator()
            if self.precompute_ref_logps and not self._packs_reference():  # no KL: the reference pass stays padded
                self.packed_forward.padded_passes = ("reference",)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in dataset.column_names:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    # --- the step's KL, over its global batch -------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.calculate_KL and batch_samples:
            self.model_wrapped.train()  # as in the micro-steps that follow (an evaluation may have left it in eval)
            self._step_kl = self.kl_estimate(self.model_wrapped, batch_samples)
        return batch_samples, num_items_in_batch

    def kl_estimate(self, model, batches) -> torch.Tensor:
        """The KL term of KTO for these batches (this rank's share of a global batch): the mean over every row of
        every process of log π(y'|x) − log π_ref(y'|x) on the rows' KL completions, clamped at 0 (as TRL clamps)."""
        device = self.accelerator.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in batches:
            total += self._kl_sums(model, batch)
        total = self.accelerator.reduce(total, reduction="sum")
        return (total[0] / total[1]).float().clamp(min=0)

    def _kl_sums(self, model, batch) -> torch.Tensor:
        """(sum of the rows' KL log-ratios, rows) of one micro-batch."""
        rows = self._kl_rows(model, batch)
        return torch.stack([rows.sum(), torch.tensor(float(len(rows)), dtype=torch.float64, device=rows.device)])

    def reference_adapter(self):
        """As TRL computes the reference with PEFT and no reference model: adapters off (or the `ref` adapter)."""
        if is_peft_model(self.model) and self.ref_model is None:
            unwrapped = self.accelerator.unwrap_model(self.model)
            return use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        return contextlib.nullcontext()

    def _reference_kl_logps(self, batch) -> torch.Tensor:
        """The reference's log-probs of the KL completions, as TRL's `_compute_loss` computes them (adapters off, or
        the `ref` adapter, with PEFT; the reference model otherwise)."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.reference_adapter():
            return KTOTrainer._compute_kl_logps(self, self.ref_model or self.model, batch)

    def _compute_kl_logps(self, model, batch):
        if self._kl_values is None:
            return super()._compute_kl_logps(model, batch)
        # TRL reads the policy's KL log-probs first, then (reference not cached) the reference's; their mean
        # difference is the KL: the policy call gets the fixed value, the reference call zeros.
        value = self._kl_values.pop(0) if self._kl_values else torch.zeros((), device=self.accelerator.device)
        return value.to(self.accelerator.device).float().expand(batch["KL_input_ids"].shape[0]).clone()

    @contextlib.contextmanager
    def fixed_kl(self, kl: torch.Tensor):
        """TRL's `_compute_loss` uses `kl` as its KL estimate (and runs no KL forward of its own)."""
        self._kl_values = [kl.detach()]
        try:
            yield
        finally:
            self._kl_values = None

    def _compute_loss(self, model, inputs, return_outputs):
        if self.model.training and not return_outputs:
            return self.training_loss(model, inputs)
        # TRL's own loss code (its metrics read on the host), with the same KL: what the toolkit's is checked against
        packed = self.completion_pass(inputs)
        if not self.calculate_KL:
            with packed:
                return super()._compute_loss(model, without_packed(inputs), return_outputs)
        inputs = dict(inputs)
        if "ref_KL_logps" in inputs:
            inputs["ref_KL_logps"] = torch.zeros_like(inputs["ref_KL_logps"])
        with self.fixed_kl(self.kl_estimate(model, [inputs])), packed:
            return super()._compute_loss(model, without_packed(inputs), return_outputs)

    def completion_pass(self, inputs):
        """The completion pass (with gradients; the reference's too when not precomputed), packed where on."""
        kinds = ("policy",) if self.precompute_ref_logps else ("policy", "reference")
        return self.packed_pass(inputs, "", kinds) if not self.aux_loss_enabled else contextlib.nullcontext()

    def training_loss(self, model, inputs) -> torch.Tensor:
        """A training micro-batch's loss, TRL's (`kto_row_values`: the mean of the rows' weighted losses, plus the
        router's auxiliary loss) with the step's KL, and its metrics kept on the device until a log: no host read."""
        if not self.calculate_KL:
            kl = torch.zeros((), device=self.accelerator.device)
        else:
            kl = self._step_kl if self._step_kl is not None else self.kl_estimate(model, [inputs])
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        with self.completion_pass(inputs):
            inputs = without_packed(inputs)
            outputs = self.completion_forward(model, inputs, **router)
            reference = self.reference_completion_logps(inputs)
        values = kto_row_values(completion_logps(outputs, inputs), reference, inputs["label"], kl, self.beta,
                                self.loss_type, self.desirable_weight, self.undesirable_weight)
        loss = values["loss"].nanmean()
        aux = [outputs.aux_loss] if self.aux_loss_enabled else []
        if aux:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        self.metric_window.add(training_values(outputs, inputs, values, kl) + aux)
        return loss

    # --- the packed forward of the training step --------------------------------------------------------------------

    def _packs(self) -> bool:
        return self.packed_forward is not None and self.packed_forward.enabled

    def step_collator(self):
        """TRL's padded batch plus the packed layout of its completions and (after "KL_") of its KL completions: one
        answer per prompt, padding-free."""
        layout, cost = self.packed_forward.layout, attention_cost_of(self.model)
        collator = self.padded_collator
        if self.calculate_KL:
            collator = PackedPreferenceCollator(collator, layout, cost, padded_width=kl_width,
                                                answers=("KL_completion_ids",), prefix="KL_",
                                                attention=self.packed_forward.attention)
        return PackedPreferenceCollator(collator, layout, cost, answers=("completion_ids",),
                                        attention=self.packed_forward.attention)

    def packed_pass(self, batch: dict, prefix: str, kinds: tuple[str, ...]):
        """While the block runs, the fused forward of a padded pass of `batch` (prefix "": its completions; "KL_": its
        KL completions) runs packed when the batch carries that pass's layout; its tokens counted as `kinds`."""
        if self.packed_forward is None:
            return contextlib.nullcontext()
        view = one_pass(batch, prefix)
        return self.packed_forward.running(view, kinds, fused_modules(self), padded_counts(view, answers=1))

    # --- metrics: weighted over the logging window ----------------------------------------------------------------

    def window_means(self) -> dict[str, float]:
        """The training metrics since the last log, each its weighted mean over the window (the metric window's
        `at_log`; none at an evaluation's log), the margin the difference of the chosen and rejected means: in
        `_metrics["train"]`, as TRL's log reads them."""
        means = self.metric_window.at_log(self)
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
            self._metrics["train"]["rewards/margins"] = [means["rewards/margins"]]
        return means

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.window_means()
        super().log(logs, start_time)

    # --- evaluation: the split's KL, then per-row values -----------------------------------------------------------

    def evaluation_loop(self, dataloader, *args, metric_key_prefix: str = "eval", **kwargs):
        """Eval metrics as per-row means with the KL over the whole split: the same on any number of processes and
        any eval batch size."""
        self.metric_window.flush(self)  # eval logs the running count of training tokens
        model = self.model
        self._eval_kl = None
        if self.calculate_KL:
            total = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
            model.eval()
            for batch in dataloader:
                rows = self._kl_rows(model, batch)
                gathered = self.accelerator.gather_for_metrics(rows)  # accelerate's duplicated last rows dropped
                total += torch.stack([gathered.sum(), torch.tensor(float(len(gathered)), dtype=torch.float64,
                                                                   device=gathered.device)])
            self._eval_kl = (total[0] / total[1]).float().clamp(min=0)
        self._row_sums = defaultdict(float)
        output = super().evaluation_loop(dataloader, *args, metric_key_prefix=metric_key_prefix, **kwargs)
        sums = self._row_sums
        chosen, rejected, rows = sums["chosen"], sums["rejected"], sums["rows"]
        metrics = {"loss": sums["loss"] / rows if rows else 0.0,
                   "kl": float(self._eval_kl) if self._eval_kl is not None else 0.0}
        if chosen:
            metrics |= {"rewards/chosen": sums["reward_chosen"] / chosen, "logps/chosen": sums["logps_chosen"] / chosen}
        if rejected:
            metrics |= {"rewards/rejected": sums["reward_rejected"] / rejected,
                        "logps/rejected": sums["logps_rejected"] / rejected}
        if chosen and rejected:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in metrics.items()})
        output.metrics[f"{metric_key_prefix}_num_tokens"] = self._total_train_tokens
        self._metrics["eval"].clear()  # TRL's per-batch means, replaced by the above
        return output

    def _kl_rows(self, model, batch) -> torch.Tensor:
        """Each row's KL log-ratio, log π(y'|x) − log π_ref(y'|x) on its KL completion (no gradients, float64)."""
        batch = {key: (value.to(self.accelerator.device) if torch.is_tensor(value) else value)
                 for key, value in batch.items()}
        with torch.no_grad(), self.packed_pass(batch, "KL_", ("kl",) if self.precompute_ref_logps else
                                               ("kl", "reference")):
            batch = without_packed(batch)
            policy = KTOTrainer._compute_kl_logps(self, model, batch)
            reference = batch["ref_KL_logps"] if self.precompute_ref_logps else self._reference_kl_logps(batch)
        return (policy - reference).double()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            values = self.row_values(model, inputs, self._eval_kl if self._eval_kl is not None else
                                     torch.zeros((), device=self.accelerator.device))
        labels = inputs["label"].bool().double()
        rows = torch.stack([values["loss"].double(), labels, values["reward"].double() * labels,
                            values["reward"].double() * (1 - labels), values["logps"].double() * labels,
                            values["logps"].double() * (1 - labels)], dim=1)
        gathered = self.accelerator.gather_for_metrics(rows)
        for column, name in enumerate(("loss", "chosen", "reward_chosen", "reward_rejected", "logps_chosen",
                                       "logps_rejected")):
            self._row_sums[name] += float(gathered[:, column].sum())
        self._row_sums["rejected"] += float((1 - gathered[:, 1]).sum())
        self._row_sums["rows"] += gathered.shape[0]
        return values["loss"].mean().detach(), None, None

    def row_values(self, model, inputs, kl) -> dict:
        """Each row's loss, reward and log-prob with the given KL (TRL's forward: fused LM head, completion tokens)."""
        policy = completion_logps(self.completion_forward(model, inputs), inputs)
        return kto_row_values(policy, self.reference_completion_logps(inputs), inputs["label"], kl, self.beta,
                              self.loss_type, self.desirable_weight, self.undesirable_weight)

    @staticmethod
    def completion_forward(model, inputs, **extra):
        """TRL's forward of the completions: the fused LM head's per-token log-probs, entropy and mean logits."""
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                     labels=labels, fused_lm_head=True, **extra)

    def reference_completion_logps(self, inputs) -> torch.Tensor:
        """The reference's summed log-probs of the completions: cached, or as TRL computes them (no gradients;
        adapters off, or the `ref` adapter, with PEFT; the reference model otherwise)."""
        if self.precompute_ref_logps:
            return inputs["ref_logps"]
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.reference_adapter():
            return completion_logps(self.completion_forward(self.ref_model or self.model, inputs), inputs)

    # --- the reference log-probs cache ------------------------------------------------------------------------------

    def _precompute_ref_logps(self, dataset, name, batch_size):
        """TRL's cache of the reference log-probs (completion and KL completion) next to the prepared split, keyed by
        the split's fingerprint (src/data/: source, tokenizer, lengths, seed, so the KL partners), the reference's
        weights, and here also what else changes the numbers: precision, device kind, max_length."""
        how = ("kto", self.args.bf16, self.args.fp16, self.accelerator.device.type, self.args.max_length)
        padded_collator = self.data_collator
        if self._packs_reference():  # the packed forward's cache is its own (the padded forward's key is as it was)
            how += (self.packed_forward.cache_tag(),)
            self.data_collator = self.reference_collator()
        try:
            with reference_cache_pass(self, dataset, name, how, trl_key=(self.calculate_KL,)):
                return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            self.data_collator = padded_collator

    def _packs_reference(self) -> bool:
        return self._packs() and self.calculate_KL

    def reference_collator(self):
        """The reference pass's collator: TRL's, plus the packed layout of each row's two completions when packed."""
        padded = getattr(self, "padded_collator", self.data_collator)  # in TRL's __init__: TRL's own
        if not self._packs_reference():
            return padded
        return PackedPreferenceCollator(padded, self.packed_forward.layout, attention_cost_of(self.model),
                                        padded_width=completions_width, answers=COMPLETIONS,
                                        attention=self.packed_forward.attention)

    def compute_ref_log_probs(self, model, inputs):
        with hang_watch.phase("reference", f"a batch of {inputs['input_ids'].shape[0]} rows"):
            return self._reference_log_probs(model, inputs)

    def _reference_log_probs(self, model, inputs):
        """The reference's summed log-probs of each row's completion and KL completion: TRL's two padded forwards, or
        one packed forward (each prompt once) standing in for their stacked padded batch."""
        if "packed_input_ids" not in inputs:
            return super().compute_ref_log_probs(model, inputs)
        rows = inputs["input_ids"].shape[0]
        stacked = stacked_completions(inputs, self._tokenizer.pad_token_id)  # as TRL's collator pads
        labels = stacked["input_ids"].masked_fill(stacked["completion_mask"] == 0, -100)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.reference_adapter(), self.accelerator.autocast(), \
                self.packed_forward.running({**stacked, **{key: inputs[key] for key in PACKED_KEYS}}, ("reference",),
                                            fused_modules(self), two_pass_counts(inputs)) as padded:
            per_token = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], labels=labels,
                              fused_lm_head=True).log_probs
        return per_token[:rows].sum(-1), per_token[rows:].sum(-1)
