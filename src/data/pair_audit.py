"""What the pairs can teach, per split, from the preparation pass (src/data/prepare.py) makes anyway.

    fields = row_fields(row, item, stage)            # inside the tokenizing map: a few numbers a row
    audit = split_audit(tokenized_pieces, stage, max_length, train_prompts)   # after it: the split's statistics

Each row of the tokenizing map carries the AUDIT_COLUMNS below (hashes of the row and of its prompt, token counts,
the answers' shared leading tokens, its source row); they stay in the map's working files and never reach the
prepared data. The statistics read those columns as arrays, 40 bytes a row (40 MB at a million pairs), so the audit
costs no second read of the data. Shares are fractions in [0, 1]: of the split's rows for what is dropped or repeated,
of the pairs that train for lengths, truncation and overlap.
"""

from __future__ import annotations

import hashlib
import io
import json
import math

from src.chat_templates import split_reasoning, tools_argument
from src.objectives import PROMPTS, SEQUENCES, UNPAIRED, objective, shape_of
from src.tool_calls import schema_problem
from src.vision import IMAGE_COLUMN

# column → Arrow type, in the tokenizing map's output (src/data/prepared.py leaves every "_" column out of the prepared files)
AUDIT_COLUMNS = {"_row_hash": "int64", "_prompt_hash": "int64", "_prompt_tokens": "int32", "_chosen_tokens": "int32",
                 "_rejected_tokens": "int32", "_shared_tokens": "int32", "_source_row": "int64", "_label": "int8",
                 "_chosen_reasoning_tokens": "int32", "_rejected_reasoning_tokens": "int32", "_pair_difference": "int8",
                 "_tool_calls": "int32", "_tool_unparsed": "int32", "_tool_unknown": "int32", "_tool_schema": "int32",
                 # a row's images (src/data/images.py): how many, their tokens and pixels, their content's hash, and the
                 # hashes of its question (the prompt without the images) and its answer (the answer ignores the image)
                 "_images": "int16", "_image_tokens": "int32", "_image_pixels": "int64", "_image_hash": "int64",
                 "_question_hash": "int64", "_answer_hash": "int64"}
TOOL_PROBLEMS = ("unparsed", "unknown", "schema")  # what the data audit counts of the rows' tool calls
# How a pair's answers differ when either reasons (_pair_difference): a pair that differs only in its reasoning
# teaches which reasoning, not which answer (and --reasoning drop leaves it identical); one that differs only in its
# final answer rests on the last tokens after a shared reasoning.
NO_REASONING, BOTH_DIFFER, ONLY_REASONING_DIFFERS, ONLY_ANSWER_DIFFERS = -1, 0, 1, 2
NO_LABEL = -1  # the _label of a row that is not a KTO row (1: thumbs up, 0: thumbs down)
# A pair whose answers share more than this fraction of the shorter answer's tokens from the start is near-identical:
# the gradient pushes almost the same tokens up and down, and the chosen log-prob tends to fall (Pal et al. 2024,
# "Smaug: Fixing Failure Modes of Preference Optimisation with DPO-Positive", arXiv 2402.13228).
NEAR_IDENTICAL = 0.8
NO_PROMPT = 0  # the prompt hash of a row without a prompt (plain text): not counted among prompts
HISTOGRAM_BINS = 30
FIRST_ROWS = 5  # row numbers named per finding


def _hash(value) -> int:
    """A stable signed 64-bit hash of a JSON-able value (the same in every process and run)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _common_prefix(first: list[int], second: list[int]) -> int:
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def prompt_of(row: dict):
    """What a row asks: its prompt, a chat's turns before the last assistant turn, or None (plain text)."""
    if row.get("prompt") is not None:
        return row["prompt"]
    messages = row.get("messages") or []
    answers = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
    return messages[:answers[-1]] if answers else None


def _parts(value) -> tuple[str, str]:
    """An answer's reasoning and final answer (text, or the assistant messages of a chat)."""
    messages = value if isinstance(value, list) else [{"role": "assistant", "content": value}]
    parts = [split_reasoning(message) for message in messages
             if isinstance(message, dict) and message.get("role") == "assistant"]
    return "".join(part.reasoning or "" for part in parts), "".join(part.content for part in parts)


def reasoning_fields(row: dict, tokenizer) -> dict:
    """The reasoning columns of a row: each answer's reasoning tokens (0: none), and how a pair's answers differ."""
    answers = {"chosen": row.get("chosen", row.get("completion", row.get("messages"))), "rejected": row.get("rejected")}
    fields = {"_chosen_reasoning_tokens": 0, "_rejected_reasoning_tokens": 0, "_pair_difference": NO_REASONING}
    parts = {side: _parts(value) for side, value in answers.items() if value is not None}
    for side, (reasoning, _) in parts.items():
        if reasoning and tokenizer is not None:
            fields[f"_{side}_reasoning_tokens"] = len(tokenizer(reasoning, add_special_tokens=False)["input_ids"])
    if len(parts) == 2 and (parts["chosen"][0] or parts["rejected"][0]):
        same_reasoning = parts["chosen"][0].strip() == parts["rejected"][0].strip()
        same_answer = parts["chosen"][1].strip() == parts["rejected"][1].strip()
        fields["_pair_difference"] = (ONLY_REASONING_DIFFERS if same_answer and not same_reasoning else
                                      ONLY_ANSWER_DIFFERS if same_reasoning and not same_answer else BOTH_DIFFER)
    return fields


def tool_fields(row: dict) -> dict:
    """The row's tool calls (in every message: the prompt's earlier turns and the answers) and their problems: the
    arguments are text that does not parse as JSON, the call names a tool the row's `tools` schemas lack, or its
    arguments break that tool's schema (src/tool_calls.py schema_problem). Without a `tools` column only the first is
    checked."""

    tools = tools_argument(row)["tools"] or []
    schemas = {(tool.get("function") or tool).get("name"): tool for tool in tools if isinstance(tool, dict)}
    counts = dict.fromkeys(("calls", *TOOL_PROBLEMS), 0)
    for key in ("prompt", "chosen", "rejected", "completion", "messages"):
        messages = row.get(key)
        for message in messages if isinstance(messages, list) else []:
            for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
                counts["calls"] += 1
                function = (call.get("function") or call) if isinstance(call, dict) else {}
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        counts["unparsed"] += 1
                        continue
                if not schemas:
                    continue
                if function.get("name") not in schemas:
                    counts["unknown"] += 1
                elif schema_problem(schemas[function["name"]], arguments):
                    counts["schema"] += 1
    return {f"_tool_{name}": count for name, count in counts.items()}


def image_fields(row: dict, ids: dict, processing) -> dict:
    """A row's image columns (AUDIT_COLUMNS): its images' count, tokens (`processing`: a vision model's, src/vision.py)
    and pixels (read from their headers), the hash of their content, of its question and of its answer."""
    images = row.get(IMAGE_COLUMN) or []
    if not images:
        return {"_images": 0, "_image_tokens": 0, "_image_pixels": 0, "_image_hash": NO_PROMPT,
                "_question_hash": NO_PROMPT, "_answer_hash": NO_PROMPT}
    from PIL import Image

    pixels = 0
    for data in images:
        with Image.open(io.BytesIO(data)) as image:  # the header alone: its size
            pixels += image.width * image.height
    prompt_ids = ids.get("prompt_ids") or ids.get("input_ids") or []
    answer = next((row[key] for key in ("chosen", "completion", "messages") if key in row), None)
    return {"_images": len(images), "_image_tokens": processing.image_token_count(prompt_ids) if processing else 0,
            "_image_pixels": pixels, "_image_hash": _hash([hashlib.sha256(data).hexdigest() for data in images]),
            "_question_hash": _hash(prompt_of(row)), "_answer_hash": _hash(answer)}


def images_audit(pieces: list, kept) -> dict:
    """What a split's images are (rows with images only): how many a row holds, their tokens and size, rows whose
    images repeat an earlier row's (by content), and rows whose answer ignores the image: the same question answered
    the same way for different images (a set that teaches the model to answer without looking)."""
    import numpy as np

    count = _column(pieces, "_images")[kept].astype(np.int64)
    shown = count > 0
    if not shown.any():
        return {}
    image_hash = _column(pieces, "_image_hash")[kept][shown]
    _, first = np.unique(image_hash, return_index=True)
    question, answer = _column(pieces, "_question_hash")[kept][shown], _column(pieces, "_answer_hash")[kept][shown]
    groups: dict = {}
    for key, image in zip(zip(question.tolist(), answer.tolist()), image_hash.tolist()):
        groups.setdefault(key, set()).add(image)
    ignoring = sum(1 for key in zip(question.tolist(), answer.tolist()) if len(groups[key]) > 1)
    pixels = _column(pieces, "_image_pixels")[kept][shown] / count[shown] / 1e6
    return {"images": {"rows_with_images_share": _share(shown.sum(), len(count)),
                       "images_per_row": _stats(count[shown]),
                       "image_tokens": _stats(_column(pieces, "_image_tokens")[kept][shown]),
                       "megapixels_per_image": _stats(pixels),
                       "duplicate_image_share": _share(len(image_hash) - len(first), len(image_hash)),
                       "answer_ignores_image_share": _share(ignoring, len(image_hash))}}


def row_fields(row: dict, ids: dict, source_row: int, tokenizer=None, processing=None) -> dict:
    """The audit columns of one normalised row and its token ids (`ids`: a pair's prompt_ids / chosen_ids /
    rejected_ids, an SFT row's input_ids and completion_mask, or nothing for a row dropped before tokenizing);
    `tokenizer` counts the answers' reasoning tokens."""
    answers = {key: row[key] for key in ("chosen", "rejected", "completion", "messages", "text") if key in row}
    prompt = prompt_of(row)
    # A prompt shows its images too: the same question about two images is two prompts (its images' digests).
    images = [hashlib.sha256(data).hexdigest() for data in row.get(IMAGE_COLUMN) or []]
    fields = {"_row_hash": _hash([row.get("prompt"), answers] + ([images] if images else [])),
              "_prompt_hash": NO_PROMPT if prompt is None else _hash([prompt, images] if images else prompt),
              "_prompt_tokens": 0, "_chosen_tokens": 0, "_rejected_tokens": 0, "_shared_tokens": 0,
              "_source_row": source_row, "_label": NO_LABEL if row.get("label") is None else int(bool(row["label"])),
              **reasoning_fields(row, tokenizer), **tool_fields(row), **image_fields(row, ids, processing)}
    if "completion_ids" in ids:  # a KTO row: its completion's tokens count as "chosen"
        fields.update(_prompt_tokens=len(ids["prompt_ids"]), _chosen_tokens=len(ids["completion_ids"]))
    elif "chosen_ids" in ids:
        fields.update(_prompt_tokens=len(ids["prompt_ids"]), _chosen_tokens=len(ids["chosen_ids"]),
                      _rejected_tokens=len(ids["rejected_ids"]),
                      _shared_tokens=_common_prefix(ids["chosen_ids"], ids["rejected_ids"]))
    elif "prompt_ids" in ids:  # prompts alone (rounds from prompts): no answer yet
        fields.update(_prompt_tokens=len(ids["prompt_ids"]))
    elif "input_ids" in ids:
        mask = ids.get("completion_mask") or ()
        fields.update(_chosen_tokens=len(ids["input_ids"]), _prompt_tokens=len(mask) - sum(mask))
    return fields


def _stats(values) -> dict:
    import numpy as np

    if not len(values):
        return {"mean": None, "median": None, "p95": None}
    return {"mean": round(float(np.mean(values)), 2), "median": round(float(np.median(values)), 2),
            "p95": round(float(np.percentile(values, 95)), 2)}


def _share(count, total) -> float | None:
    return round(float(count) / total, 6) if total else None


def _column(pieces: list, name: str):
    import numpy as np

    return np.concatenate([piece.data.column(name).to_numpy() for piece in pieces]) if pieces else np.array([])


def histogram(values_by_name: dict, bins: int = HISTOGRAM_BINS, low: float = 0.0, high: float | None = None) -> dict:
    """Counts of each series over shared bins from `low` to `high` (default: the largest 99th percentile, at least
    low + 1); values outside fall in the first or last bin."""
    import numpy as np

    if high is None:
        high = max([float(np.percentile(values, 99)) for values in values_by_name.values() if len(values)] or [low])
        high = max(high, low + 1.0)
    edges = np.linspace(low, high, bins + 1)
    return {"edges": [round(float(edge), 3) for edge in edges],
            **{name: np.histogram(np.clip(values, edges[0], edges[-1]), edges)[0].tolist()
               for name, values in values_by_name.items()}}


def split_audit(pieces: list, stage: str, max_length: int, statuses, kept_status: int,
                train_prompts=None, reasoning_kept: bool = True) -> dict:
    """A split's statistics from the tokenizing map's output (`pieces`: its datasets, in order; `statuses`: their
    `_status` values). `train_prompts`: the training split's prompt hashes, for a held-out split (how many of its
    prompts the model trains on)."""
    import numpy as np

    kept = statuses == kept_status
    audit = _rows_audit(pieces, kept, train_prompts) | images_audit(pieces, kept)
    pairs = audit["pairs"]
    prompt = _column(pieces, "_prompt_tokens")[kept].astype(np.int64)
    chosen = _column(pieces, "_chosen_tokens")[kept].astype(np.int64)
    shape = shape_of(stage)
    if shape == PROMPTS:  # no answers: what the prompts are (repeats, lengths, held-out ones also in train)
        audit.update(prompt_tokens=_stats(prompt), length_histogram=histogram({"prompt": prompt}))
        return audit
    chosen_reasoning = _column(pieces, "_chosen_reasoning_tokens")[kept].astype(np.int64)
    if shape == UNPAIRED:
        prompt_hashes, labels = _column(pieces, "_prompt_hash")[kept], _column(pieces, "_label")[kept]
        return audit | kto_audit(prompt_hashes, labels, prompt, chosen, max_length) | \
            reasoning_audit(prompt, {"completion": chosen_reasoning}, max_length, None, reasoning_kept)
    if shape == SEQUENCES:
        audit.update(sequence_tokens=_stats(chosen), truncated_share=_share((chosen > max_length).sum(), pairs),
                     suggested_max_length=_suggested_max_length(chosen),
                     length_histogram=histogram({"sequence": chosen}),
                     **reasoning_audit(prompt, {"completion": chosen_reasoning}, max_length, None, reasoning_kept))
        return audit
    if not reasoning_kept:  # pairs --reasoning drop made identical (dropped as chosen == rejected): named apart
        audit["identical_by_reasoning_drop"] = int((_column(pieces, "_pair_difference") == ONLY_REASONING_DIFFERS).sum())
    # DPO truncates prompt + answer to max_length (TRL keeps the start); a reward pair over it was dropped instead
    limit = max_length if objective(stage).training.truncates_to_max_length else math.inf
    return audit | _pairs_audit(pieces, kept, prompt, chosen, chosen_reasoning, limit, reasoning_kept)


def _rows_audit(pieces: list, kept, train_prompts) -> dict:
    """What every row of a split is, kept or not: how many, distinct prompts, repeated rows, held-out prompts also in
    train, tool calls and their problems."""
    import numpy as np

    row_hash, source_row = _column(pieces, "_row_hash"), _column(pieces, "_source_row")
    rows, pairs = len(row_hash), int(kept.sum())
    _, first_index = np.unique(row_hash, return_index=True)
    repeated = np.ones(rows, dtype=bool)
    repeated[first_index] = False
    prompts = _column(pieces, "_prompt_hash")
    asked = prompts != NO_PROMPT
    audit = {"rows": rows, "pairs": pairs,
             "distinct_prompts": int(len(np.unique(prompts[asked]))) if asked.any() else None,
             "duplicate_pairs": int(repeated.sum()), "duplicate_share": _share(repeated.sum(), rows),
             "first_duplicate_rows": [int(row) + 1 for row in source_row[repeated][:FIRST_ROWS]]}
    if train_prompts is not None and asked.any():
        held_out = prompts[kept & asked]
        audit["prompts_in_train_share"] = _share(np.isin(held_out, train_prompts).sum(), len(held_out))
    calls = int(_column(pieces, "_tool_calls").sum()) if pieces and "_tool_calls" in pieces[0].column_names else 0
    if calls:  # the rows' tool calls, and what is wrong with them (every row, kept or not)
        audit["tool_calls"] = calls
        audit.update({f"tool_{name}": int(_column(pieces, f"_tool_{name}").sum()) for name in TOOL_PROBLEMS})
    return audit


def _pairs_audit(pieces: list, kept, prompt, chosen, chosen_reasoning, limit: float, reasoning_kept: bool) -> dict:
    """The kept pairs: lengths, which side is longer, what `limit` cuts (prompt + answer over it), the answers' shared
    start, and their reasoning."""
    import numpy as np

    pairs = int(kept.sum())
    rejected = _column(pieces, "_rejected_tokens")[kept].astype(np.int64)
    shared = _column(pieces, "_shared_tokens")[kept].astype(np.int64)
    overlap = shared / np.maximum(np.minimum(chosen, rejected), 1)
    return dict(
        prompt_tokens=_stats(prompt), chosen_tokens=_stats(chosen), rejected_tokens=_stats(rejected),
        chosen_longer_share=_share((chosen > rejected).sum(), pairs),
        chosen_shorter_share=_share((chosen < rejected).sum(), pairs),
        equal_length_share=_share((chosen == rejected).sum(), pairs),
        mean_length_ratio=round(float(chosen.sum() / max(rejected.sum(), 1)), 4) if pairs else None,
        chosen_truncated_share=_share((prompt + chosen > limit).sum(), pairs),
        rejected_truncated_share=_share((prompt + rejected > limit).sum(), pairs),
        truncated_share=_share((prompt + np.maximum(chosen, rejected) > limit).sum(), pairs),  # either answer cut
        suggested_max_length=_suggested_max_length(prompt + np.maximum(chosen, rejected)),
        overlap_median=round(float(np.median(overlap)), 4) if pairs else None,
        near_identical_share=_share((overlap > NEAR_IDENTICAL).sum(), pairs),
        length_histogram=histogram({"chosen": chosen, "rejected": rejected}),
        **reasoning_audit(prompt, {"chosen": chosen_reasoning,
                                   "rejected": _column(pieces, "_rejected_reasoning_tokens")[kept].astype(np.int64)},
                          limit, _column(pieces, "_pair_difference")[kept], reasoning_kept),
    )


def reasoning_audit(prompt_tokens, reasoning_by_side: dict, max_length: float, differences,
                    kept: bool = True) -> dict:
    """How much the answers reason and what --max_length leaves of it: per side (chosen / rejected, or a completion)
    the share of answers that reason, their reasoning tokens, and the share whose reasoning --max_length cuts (the
    trained answer stops before its final answer); for pairs, the shares that differ only in their reasoning or only
    in their final answer. Empty when no answer reasons; no cut shares when the reasoning is dropped (`kept` False)."""
    import numpy as np

    rows = len(prompt_tokens)
    if not rows or not any((tokens > 0).any() for tokens in reasoning_by_side.values()):
        return {}
    audit = {}
    for side, tokens in reasoning_by_side.items():
        reasons = tokens > 0
        audit[f"{side}_reasoning_share"] = _share(reasons.sum(), rows)
        audit[f"{side}_reasoning_tokens"] = _stats(tokens[reasons])
        if kept:
            audit[f"{side}_reasoning_cut_share"] = _share((reasons & (prompt_tokens + tokens >= max_length)).sum(),
                                                          rows)
    if differences is not None:
        audit["only_reasoning_differs_share"] = _share((differences == ONLY_REASONING_DIFFERS).sum(), rows)
        audit["only_answer_differs_share"] = _share((differences == ONLY_ANSWER_DIFFERS).sum(), rows)
    return audit


def kto_audit(prompts, labels, prompt_tokens, completion_tokens, max_length: int) -> dict:
    """A KTO split's balance: desirable / undesirable rows, and per prompt: how many prompts have both kinds of answer,
    only thumbs up, only thumbs down, and the answers per prompt (the KTO paper's weights follow the row counts;
    a prompt with both kinds is what pair data would give)."""
    import numpy as np

    desirable = labels == 1
    rows = len(labels)
    audit = {"desirable": int(desirable.sum()), "undesirable": int(rows - desirable.sum()),
             "desirable_share": _share(desirable.sum(), rows),
             "completion_tokens": _stats(completion_tokens), "prompt_tokens": _stats(prompt_tokens),
             "truncated_share": _share((prompt_tokens + completion_tokens > max_length).sum(), rows),
             "suggested_max_length": _suggested_max_length(prompt_tokens + completion_tokens),
             "length_histogram": histogram({"desirable": completion_tokens[desirable],
                                            "undesirable": completion_tokens[~desirable]})}
    asked = prompts != NO_PROMPT
    if asked.any():
        unique, inverse = np.unique(prompts[asked], return_inverse=True)
        up = np.bincount(inverse, weights=desirable[asked], minlength=len(unique))
        down = np.bincount(inverse, weights=~desirable[asked], minlength=len(unique))
        audit.update(prompts_both=int(((up > 0) & (down > 0)).sum()), prompts_only_desirable=int((down == 0).sum()),
                     prompts_only_undesirable=int((up == 0).sum()),
                     answers_per_prompt=round(float(asked.sum() / len(unique)), 3))
    return audit


def _suggested_max_length(lengths) -> int | None:
    """The 99th percentile of the full sequence lengths, rounded up to a multiple of 64: what keeps 99% of pairs whole."""
    import numpy as np

    if not len(lengths):
        return None
    return int(math.ceil(float(np.percentile(lengths, 99)) / 64) * 64)


def counts_of(splits: dict) -> dict:
    """The counts the prepared summary already names, carried into the audit of each split (dropped rows)."""
    return {kind: {"identical_pairs": counts["identical_pairs"], "empty_answers": counts["empty_answers"],
                   "prompts_dropped": counts.get("dropped_prompt_too_long", counts.get("dropped_too_long", 0)),
                   "identical_share": _share(counts["identical_pairs"], counts["rows"])}
            for kind, counts in splits.items()}
