"""The toolkit's prepared pairs for TRL's reference-free pair trainers (trl.experimental: CPOTrainer for SimPO,
ORPOTrainer), which tokenize the text themselves, padded, in their constructors. Here they take the ids src/data.py
prepared (the same prompt / chosen / rejected ids as DPO's, TRL's DPOTrainer's tokenization) and lay them out as
their `tokenize_row` does: prompt + answer, the prompt's labels -100, the answer cut where prompt + answer passes
max_length (a prompt that fills max_length was already dropped in preparation, TRL's DPO rule)."""

from __future__ import annotations

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
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


class PreparedPairsMixin:
    """For a trl.experimental pair trainer: prepared pairs in, its own tokenization skipped."""

    def __init__(self, *args, train_dataset=None, eval_dataset=None, **kwargs):
        super().__init__(*args, train_dataset=pairs_only(train_dataset), eval_dataset=pairs_only(eval_dataset),
                         **kwargs)

    def tokenize_row(self, feature, model=None) -> dict:
        if "chosen_ids" not in feature:  # text the user handed the trainer directly: TRL's own tokenization
            return super().tokenize_row(feature, model)
        return pair_row(feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"], self.max_length)
