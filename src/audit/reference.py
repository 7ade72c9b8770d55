"""How the reference model already ranks the training pairs: the share it ranks the labels' way and the margin.

    audit = reference_audit(trainer.train_dataset, max_length)     # the log-probs the DPO trainer computed or reused
    chosen, rejected = sample_logps(model, pairs, max_length)      # standalone (python -m src.audit): on a sample

DPO moves the policy away from the reference by the pairs' margins; a reference that already ranks most pairs the
labels' way leaves little to teach, and pairs it ranks the other way are rarely flipped by training (Chen et al. 2024,
"Preference Learning Algorithms Do Not Learn Preference Rankings", arXiv 2405.19534: reference ranking accuracy is
mostly below 60%). Summed log-probs favour the shorter answer; per-token means do not: the two shares side by side
say how much of the reference's ranking is length.
"""

from __future__ import annotations

from src.data.pair_audit import histogram
from src.generation import padded_batches

READ_ROWS = 8192  # rows read at a time from the trainer's dataset: memory stays flat with the data


def agreement(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens) -> dict:
    """The shares the reference ranks the labels' way (summed and per-token log-probs) and the margin's spread."""
    import numpy as np

    chosen_logps, rejected_logps = np.asarray(chosen_logps, float), np.asarray(rejected_logps, float)
    margin = chosen_logps - rejected_logps
    per_token = chosen_logps / np.maximum(chosen_tokens, 1) - rejected_logps / np.maximum(rejected_tokens, 1)
    if not len(margin):
        return {"reference_pairs": 0, "reference_agreement": None, "reference_agreement_per_token": None}
    quantiles = np.percentile(margin, [5, 25, 50, 75, 95])
    low, high = np.percentile(margin, [1, 99])
    half_width = max(abs(low), abs(high), 1e-6)
    return {
        "reference_pairs": int(len(margin)),
        "reference_agreement": round(float((margin > 0).mean()), 6),
        "reference_agreement_per_token": round(float((per_token > 0).mean()), 6),
        "reference_margin": {"mean": round(float(margin.mean()), 4),
                             **{name: round(float(value), 4) for name, value in
                                zip(("p5", "p25", "median", "p75", "p95"), quantiles)}},
        # symmetric around 0, so the plot shows which side of zero the pairs fall on
        "reference_margin_histogram": histogram({"margin": margin}, low=-half_width, high=half_width),
    }


def answer_tokens(prompt_tokens, answer_lengths, max_length: int | None):
    """The answer tokens the DPO loss sees: TRL keeps the start of prompt + answer, up to max_length."""
    import numpy as np

    answer_lengths = np.asarray(answer_lengths)
    if not max_length:
        return answer_lengths
    return np.clip(np.minimum(answer_lengths, max_length - np.asarray(prompt_tokens)), 0, None)


def reference_audit(dataset, max_length: int | None) -> dict | None:
    """From the DPO trainer's training dataset once its reference log-probs are attached (ref_chosen_logps,
    ref_rejected_logps: TRL's precompute pass, computed or read from its cache); None without them."""
    import numpy as np
    import pyarrow.compute as pc

    if dataset is None or "ref_chosen_logps" not in getattr(dataset, "column_names", ()):
        return None
    columns = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"]
    parts = {name: [] for name in ("chosen", "rejected", "chosen_tokens", "rejected_tokens")}
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=READ_ROWS):
        prompt = pc.list_value_length(batch["prompt_ids"]).to_numpy()
        parts["chosen"].append(batch["ref_chosen_logps"].to_numpy())
        parts["rejected"].append(batch["ref_rejected_logps"].to_numpy())
        parts["chosen_tokens"].append(answer_tokens(prompt, pc.list_value_length(batch["chosen_ids"]).to_numpy(),
                                                    max_length))
        parts["rejected_tokens"].append(answer_tokens(prompt, pc.list_value_length(batch["rejected_ids"]).to_numpy(),
                                                      max_length))
    joined = {name: np.concatenate(values) if values else np.array([]) for name, values in parts.items()}
    return agreement(joined["chosen"], joined["rejected"], joined["chosen_tokens"], joined["rejected_tokens"])


def sample_logps(model, pairs: list[dict], max_length: int, batch_size: int = 16) -> tuple[list[float], list[float]]:
    """Summed log-probs of each pair's chosen and rejected answer given its prompt (token ids: prompt_ids,
    chosen_ids, rejected_ids), truncated as DPO truncates: the standalone audit's reference part, one process."""
    import torch

    sequences, starts = [], []
    for pair in pairs:
        for answer in (pair["chosen_ids"], pair["rejected_ids"]):
            sequences.append((list(pair["prompt_ids"]) + list(answer))[:max_length])
            starts.append(len(pair["prompt_ids"]))
    totals = [0.0] * len(sequences)
    model.eval()
    with torch.inference_mode():
        for batch, input_ids, attention_mask in padded_batches(model, sequences, batch_size, 0, left=False):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
            logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
            for row, index in enumerate(batch):
                end = len(sequences[index])
                totals[index] = float(logps[row, starts[index] - 1:end - 1].sum())
    return totals[0::2], totals[1::2]
