"""The toolkit's prepared pairs for TRL's reference-free pair trainers (trl.experimental: CPOTrainer for SimPO,
ORPOTrainer), which tokenize the text themselves, padded, in their constructors. Here they take the ids src/data/
prepared (the same prompt / chosen / rejected ids as DPO's, TRL's DPOTrainer's tokenization) and lay them out as
their `tokenize_row` does: prompt + answer, the prompt's labels -100, the answer cut where prompt + answer passes
max_length (a prompt that fills max_length was already dropped in preparation, TRL's DPO rule).

The packed, prefix-shared forward (src/packed_dpo.py, DPO's) serves them too: their `concatenated_forward` (TRL's
padded `[chosen; rejected]` rows, full logits) is replaced by TRL's fused LM head on the same padded batch, which
src/packed_forward.py redirects to the packed layout (each prompt once), checked against the padded forward on the first
batch. What the trainers read from it is the same: the answers' summed or averaged log-probs, the NLL term (ORPO's over
prompt + chosen answer, CPO's over the chosen answer), so the loss, its gradient and every metric but two; the two
`logits/*` metrics become the mean logit over the answers' tokens (TRL's padded forward averages every position of the
padded rows, prompt and padding included, which depends on how the micro-batch is padded). This file owns that
coupling to CPOTrainer's and ORPOTrainer's `concatenated_inputs` / `concatenated_forward` (the five values they return).

A training step's token means are over its global batch (`begin_step`): TRL's NLL term (ORPO's, CPO's) and the answers'
mean logit are means over a micro-batch's tokens, so the step (and the logged NLL and logits) depended on how the global
batch was split into micro-batches (ORPO, measured: 1.7e-5 relative on the first loss between 1 x 8 and 2 x 4 pairs per
micro-batch, 6.7e-4 on the grad norm), while the pair terms, means over equal micro-batches, did not. Each micro-batch's
token sum is scaled by (micro-batches in the step) / (the step's tokens over every rank), so transformers' division by
the accumulation steps and the ranks' gradient mean leave the global batch's token mean, as SFT's num_items_in_batch
does."""

from __future__ import annotations

import torch
from trl.trainer.utils import add_fused_lm_head

from src.packed_dpo import PackedPreferenceCollator, attention_cost_of, forward_plan
from src.packed_forward import fused_modules
from src.packed_layout import PACKED_KEYS
from src.trainers.device_metrics import Mean, MetricWindow

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# What CPOTrainer's get_batch_loss_metrics gathers for its metrics, in its order, each logged as the gathered mean
# (ORPOTrainer's adds two): kept on the device until a log (src/trainers/device_metrics.py)
CPO_GATHERED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
                "logps/chosen", "logits/rejected", "logits/chosen", "nll_loss")
LABEL_PAD = -100


def pair_row(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int) -> dict:
    """One pair as TRL's CPO / ORPO `tokenize_row` writes it (decoder-only models)."""
    row = {"prompt_input_ids": list(prompt), "prompt_attention_mask": [1] * len(prompt)}
    for side, answer in (("chosen", chosen), ("rejected", rejected)):
        answer = list(answer)[:max(0, max_length - len(prompt))]
        row[f"{side}_input_ids"] = list(prompt) + answer
        row[f"{side}_attention_mask"] = [1] * (len(prompt) + len(answer))
        row[f"{side}_labels"] = [LABEL_PAD] * len(prompt) + answer
    return row


def pairs_only(dataset):
    """The prepared split less its text columns (the held-out answers' fields): TRL's constructors would otherwise
    render and tokenize the text again. `length` stays (group_by_length reads it)."""
    if dataset is None or "chosen_ids" not in dataset.column_names:
        return dataset
    return dataset.select_columns([name for name in (*PAIR_COLUMNS, "length") if name in dataset.column_names])


def cut_pairs(examples: list[dict]) -> list[dict]:
    """The rows as `pair_row` cut them, as prompt / chosen / rejected ids (the packed collator's pairs)."""
    pairs = []
    for example in examples:
        prompt = list(example["prompt_input_ids"])
        pairs.append({"prompt_ids": prompt, "chosen_ids": list(example["chosen_input_ids"])[len(prompt):],
                      "rejected_ids": list(example["rejected_input_ids"])[len(prompt):]})
    return pairs


def concatenated_width(batch: dict) -> int:
    """The width of `concatenated_inputs`' rows: chosen and rejected padded to the longer."""
    return max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])


class PreparedPairsMixin:
    """For a trl.experimental pair trainer: prepared pairs in, its own tokenization skipped, and the packed forward
    when build_trainer hands it one (`forward_for`)."""

    packed_forward = None
    nll_covers_prompt = False  # ORPO: its NLL term is over prompt + chosen answer (CPO's over the chosen answer)
    gathered_metrics = CPO_GATHERED  # what its TRL trainer's get_batch_loss_metrics gathers, in its order

    @staticmethod
    def forward_for(model, tokenizer, trl_config, peft_config, packed: bool = True, attention: str = "auto") -> dict:
        """The trainer arguments of its forward (src/trainers/build.py asks every trainer class that has this)."""
        return {"packed_forward": forward_plan(model, trl_config, peft_config, packed, attention)}

    def __init__(self, *args, train_dataset=None, eval_dataset=None, packed_forward=None, **kwargs):
        self.packed_forward = packed_forward
        model = kwargs.get("model")
        if packed_forward is not None and packed_forward.enabled and not isinstance(model, str):
            # TRL's fused LM head, before PEFT wraps the model (as DPOTrainer adds it): per-token log-probs, no logits
            add_fused_lm_head(model, outputs=("log_probs", "mean_logits"))
        super().__init__(*args, train_dataset=pairs_only(train_dataset), eval_dataset=pairs_only(eval_dataset),
                         **kwargs)
        self.metric_window = MetricWindow(self.gathered_metrics, {name: Mean(name) for name in self.gathered_metrics},
                                          "trl.experimental's pair trainer", lambda trainer: trainer._stored_metrics,
                                          weighted=True)
        if packed_forward is not None and packed_forward.enabled:
            self.data_collator = PackedPreferenceCollator(self.data_collator, packed_forward.layout,
                                                          attention_cost_of(self.model), cut_pairs, concatenated_width,
                                                          self.nll_covers_prompt, attention=packed_forward.attention)

    _step_scales = None  # this step's micro-batches over its NLL, chosen and rejected answer tokens, all ranks'

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.begin_step(batch_samples)
        return batch_samples, num_items_in_batch

    def begin_step(self, batches: list[dict]) -> None:
        """An optimizer step's token counts over its global batch: this rank's micro-batches, summed over the ranks in
        one collective, kept on the device (no host read)."""
        if not batches:
            self._step_scales = None
            return
        device = self.accelerator.device
        counts = torch.stack([torch.stack(self.token_counts(batch)).to(device) for batch in batches]).sum(0)
        totals = self.accelerator.reduce(torch.cat([counts, counts.new_tensor([len(batches)])]), reduction="sum")
        self._step_scales = (totals[3] / totals[:3].clamp(min=1)).float()

    def token_counts(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(NLL tokens, chosen answer tokens, rejected answer tokens) of a micro-batch, as the loss and the logits'
        metrics count them: ORPO's NLL every real token of prompt + chosen answer but the first, CPO's the answer's."""
        chosen = batch["chosen_labels"][:, 1:] != LABEL_PAD
        nll = batch["chosen_attention_mask"][:, 1:] == 1 if self.nll_covers_prompt else chosen
        return nll.sum(), chosen.sum(), (batch["rejected_labels"][:, 1:] != LABEL_PAD).sum()

    def global_token_means(self, values: tuple, batch: dict, packed: bool) -> tuple:
        """TRL's `concatenated_forward` values with the micro-batch's token means (the answers' mean logits, the NLL)
        as its token sums x this step's scale: their mean over the step's micro-batches is the global batch's token
        mean. The padded forward's logits (every position, padding included) become the answers' mean logit, as the
        packed forward's."""
        nll_tokens, chosen_tokens, rejected_tokens = self.token_counts(batch)
        if packed:
            chosen_sum, rejected_sum = values[2] * chosen_tokens, values[3] * rejected_tokens
        else:
            labels = self.concatenated_inputs(batch, padding_value=self.pad_value(), device=self.accelerator.device)[
                "concatenated_labels"]
            # the positions that predict an answer token: the first `width` of either's logits (ORPO's leave out
            # the last position, CPO's keep it)
            answer = labels[:, 1:] != LABEL_PAD
            pairs, width = batch["chosen_labels"].shape[0], answer.shape[1]
            chosen_sum = (values[2][:, :width].mean(-1) * answer[:pairs]).sum()
            rejected_sum = (values[3][:, :width].mean(-1) * answer[pairs:]).sum()
        scales = self._step_scales
        return (values[0], values[1], chosen_sum * scales[1], rejected_sum * scales[2],
                values[4] * nll_tokens * scales[0], *values[5:])

    def compute_loss(self, model, inputs, *args, **kwargs):
        with self.metric_window.recording(self):  # a training micro-batch's metrics stay on the device until a log
            return super().compute_loss(model, inputs, *args, **kwargs)

    def log(self, *args, **kwargs):
        # each metric the window's mean over its pairs (the logits and NLL: over its micro-batches' ranks, each a share
        # of its step's global token mean: `global_token_means`), as DPO's
        self.metric_window.at_log(self)
        return super().log(*args, **kwargs)

    def pad_value(self) -> int:
        """The token id that pads input ids (CPOTrainer's `pad_token_id`; ORPOTrainer calls it `padding_value`)."""
        return self.pad_token_id

    def averages_log_probs(self) -> bool:
        """The answers' log-probs averaged per token (SimPO, ORPO) or summed: the trainer's own rule."""
        return True

    def nll_weight(self) -> float:
        """The NLL term's weight in the loss (0: the trainer returns a zero, as CPO with cpo_alpha 0 does)."""
        return 1.0

    def concatenated_forward(self, model, batch):
        forward = self.packed_forward
        packed = forward is not None and forward.enabled and "packed_input_ids" in batch and not self.aux_loss_enabled
        values = self.packed_concatenated_forward(model, batch) if packed else super().concatenated_forward(model, batch)
        if not model.training or self._step_scales is None:  # evaluation: TRL's micro-batch means
            return values
        return self.global_token_means(values, batch, packed)

    def packed_concatenated_forward(self, model, batch):
        """TRL's `concatenated_forward` values (chosen and rejected log-probs, their logits' summary, the NLL) from the
        fused LM head on the padded `[chosen; rejected]` batch, which the packed forward computes packed."""
        concatenated = self.concatenated_inputs(batch, padding_value=self.pad_value(), device=self.accelerator.device)
        input_ids, attention_mask = concatenated["concatenated_input_ids"], concatenated["concatenated_attention_mask"]
        labels = concatenated["concatenated_labels"]
        pairs = batch["chosen_labels"].shape[0]
        scored = labels.clone()
        if self.nll_covers_prompt:  # as ORPOTrainer: every real token of the chosen row
            scored[:pairs] = input_ids[:pairs].masked_fill(attention_mask[:pairs] == 0, -100)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": (labels != -100).long(),
                  **{key: batch[key] for key in PACKED_KEYS}}
        with self.packed_forward.running(inputs, ("policy",), fused_modules(self)) as inputs:
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=scored,
                            use_cache=False, fused_lm_head=True)
        answer = labels[:, 1:] != -100
        per_token = outputs.log_probs
        sums = (per_token * answer).sum(-1)
        logps = sums / answer.sum(-1) if self.averages_log_probs() else sums
        if self.nll_weight() == 0:
            nll = torch.tensor(0.0, device=self.accelerator.device)
        else:
            nll_mask = scored[:pairs, 1:] != -100
            nll = -(per_token[:pairs] * nll_mask).sum() / nll_mask.sum()
        # TRL reads its logits only as `.detach().mean()`: the answers' mean logit, without a boolean index (a
        # device read: its size is only known on the device)
        mean_logits = outputs.mean_logits * answer
        tokens = answer.sum(-1)
        return (logps[:pairs], logps[pairs:], mean_logits[:pairs].sum() / tokens[:pairs].sum(),
                mean_logits[pairs:].sum() / tokens[pairs:].sum(), nll)

    def tokenize_row(self, feature, model=None) -> dict:
        if "chosen_ids" not in feature:  # text the user handed the trainer directly: TRL's own tokenization
            return super().tokenize_row(feature, model)
        return pair_row(feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"], self.max_length)
