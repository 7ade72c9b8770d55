"""A judge's verdict on the data's own pairs: the labels it ranks the other way, and the pairs it cannot tell apart.

    audit, inverted = judge_pairs(judge, prepared.train, source_rows(prepared, "train"), count, seed, world)

Up to `count` training pairs, drawn with the seed, have their chosen and their rejected answer scored by the run's
judge (the embedded check, a reward model, or --judge module:function), every rank its share. A pair whose rejected
answer scores higher is inverted: a swapped label, or a judge that disagrees with the labeller. Published re-judgings
found ~16% of Intel/orca_dpo_pairs swapped and ~31% tied (Argilla, distilabel-intel-orca-dpo-pairs). The inverted pairs
go to a file with their source row, for a person to read and clean.
"""

from __future__ import annotations

import random
import time

from src.distributed import map_across_ranks
from src.judges import JudgeError

INVERTED_FILE = "data_audit_inverted.jsonl"


def answer_text(answer, ids: list[int] | None = None, tokenizer=None) -> str:
    """An answer as the judge reads it: the text, or a chat answer's assistant content; an answer that calls a tool,
    as the template writes it (its ids decoded, special tokens kept), which is how a sampled trajectory is judged
    (src/tools.py): its content alone is empty, and every pair of calls would tie."""
    if isinstance(answer, list):
        if tokenizer is not None and ids and any(isinstance(message, dict) and message.get("tool_calls")
                                                 for message in answer):
            return tokenizer.decode(ids, skip_special_tokens=False)
        return "".join(str(message.get("content") or "") for message in answer if isinstance(message, dict))
    return str(answer)


def drawn_rows(length: int, count: int, seed: int) -> list[int]:
    """The rows judged: all of them, or `count` drawn with the seed (in data order)."""
    if count >= length:
        return list(range(length))
    return sorted(random.Random(seed).sample(range(length), count))


def judge_pairs(judge, train, rows_in_source, source: str, count: int, seed: int, world,
                tokenizer=None) -> tuple[dict, list[dict]]:
    """The judge part of the data audit and the inverted pairs (each with its source and row: `rows_in_source` maps a
    prepared row to its row in `source`, or is None for a mixture). Identical on every rank. `tokenizer`: the
    model's, which writes the answers that call tools as the judge reads them (answer_text)."""
    started = time.monotonic()
    indices = drawn_rows(len(train), count, seed)
    columns = ("prompt", "chosen", "rejected", "meta", "chosen_ids", "rejected_ids")
    sample = train.select_columns([c for c in columns if c in train.column_names])
    rows = [dict(sample[index], index=index) for index in indices]

    def work(share: list[dict]) -> list:
        judged = [{"prompt": row["prompt"], "meta": row.get("meta") or {}} for row in share]
        try:
            chosen, rejected = (judge.scores(judged, [answer_text(row[side], row.get(f"{side}_ids"), tokenizer)
                                                      for row in share]) for side in ("chosen", "rejected"))
        except JudgeError as error:  # said by every rank, whichever rank's share it was in
            return [{"error": str(error)}] * len(share)
        return list(zip(chosen, rejected))

    scores = map_across_ranks(rows, work, world)
    failed = next((result["error"] for result in scores if isinstance(result, dict)), None)
    if failed:
        raise JudgeError(f"data audit: {failed}")
    inverted = [{"source": source, "row": int(rows_in_source[row["index"]]) if rows_in_source is not None else None,
                 "prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
                 "chosen_score": chosen, "rejected_score": rejected}
                for row, (chosen, rejected) in zip(rows, scores) if chosen < rejected]
    ties = sum(chosen == rejected for chosen, rejected in scores)
    judged = len(scores)
    audit = {"judge": getattr(judge, "name", "judge"), "judged_pairs": judged,
             "judge_inverted_share": round(len(inverted) / judged, 6) if judged else None,
             "judge_tie_share": round(ties / judged, 6) if judged else None,
             "judge_seconds": round(time.monotonic() - started, 2)}
    return audit, inverted
