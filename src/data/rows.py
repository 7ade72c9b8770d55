"""The tokenizing map's function: a batch of raw rows normalised, checked and tokenized, each row out with its status,
token columns and audit columns; and the Arrow features of what goes in and comes out.
"""

from __future__ import annotations

import json

from src.config import DataArguments, SFTArguments
from src.data.checks import IDENTICAL, KEPT, TOO_LONG, UNDESIRABLE, check_row
from src.data.errors import DataError
from src.data.files import row_origin
from src.data.images import gather_images, image_base
from src.data.pair_audit import AUDIT_COLUMNS, row_fields
from src.data.shapes import is_chat, stage_shape, normalize_row, unpaired_rows
from src.data.templates import template_refusals
from src.data.tokenization import (has_trainable_token, reward_ids, sample_fields, tokenize_preference, tokenize_sft,
                                   tokenize_unpaired)
from src.objectives import PAIRED_SHAPES, PAIRS, PROMPTS, SCORED_PAIRS, SEQUENCES, UNPAIRED


SOURCE_ROW = "_source_row"  # a row's index in its source split, while preparing (_prepare_source)


def normalized_features(features, shape: str, has_chat_template: bool, pair_shape: str | None = None) -> dict:
    """Arrow types of normalize_row's columns, from the source's: batches written one after another must agree even
    where one batch holds only None in a field (a tool call no row of it has)."""
    from datasets import List, Value

    text = Value("string")
    chat = List({"role": text, "content": text})  # the messages normalize_row builds from transcripts
    if shape == "explicit_prompt":
        out = {key: features[key] for key in ("prompt", "chosen", "rejected")}
    elif shape in ("ultrafeedback", "implicit_prompt"):
        out = {"prompt": features["chosen"], "chosen": features["chosen"], "rejected": features["rejected"]}
    elif shape in ("anthropic_hh", "orca"):
        out = dict.fromkeys(("prompt", "chosen", "rejected"), chat if has_chat_template else text)
    elif shape == PROMPTS:
        out = {"prompt": features["prompt"]}
    elif shape == "messages":
        out = {"messages": features["messages"]}
    elif shape == "sharegpt":
        out = {"messages": _sharegpt_features(features["conversations"])}
    elif shape == "sharegpt_pairs":
        out = {"prompt": _sharegpt_features(features["conversations"]),
               "chosen": _sharegpt_features(features["chosen"]), "rejected": _sharegpt_features(features["rejected"])}
    elif shape == "prompt_completion":
        out = {"prompt": features["prompt"], "completion": features["completion"]}
        if "label" in features:
            out["label"] = Value("bool")
    elif shape == "text":
        out = {"text": features["text"]}
    elif shape == "preference":
        pair = normalized_features(features, pair_shape, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"]}
    elif shape == "unpaired":
        out = {"prompt": features["prompt"], "completion": features["completion"], "label": Value("bool")}
    elif shape == "kto_pairs":
        pair = normalized_features(features, pair_shape, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"], "label": Value("bool")}
    else:
        raise ValueError(f"unknown shape {shape}")
    if "meta" in features:
        out["meta"] = features["meta"]
    if "tools" in features:
        out["tools"] = text  # serializable: JSON text
    return out


def _sharegpt_features(feature):
    """The Arrow type of _sharegpt_messages' output: the turns' struct with `from` / `value` renamed; a single turn
    (a struct, not a list of them) becomes a list of one."""
    from datasets import List

    message = dict(feature.feature) if hasattr(feature, "feature") else dict(feature)
    renamed = {{"from": "role", "value": "content"}.get(key, key): value for key, value in message.items()}
    return type(feature)(renamed) if hasattr(feature, "feature") else List(renamed)


def output_features(normalized: dict, token_columns: list[str], held_out: bool):
    from datasets import Features, List, Value

    features = dict(normalized)
    for column in token_columns:
        features[column] = List(Value("int8") if "mask" in column else Value("int32"))
    features["length"] = Value("int64")
    if held_out:
        judge = normalized.get("prompt", normalized.get("messages", Value("string")))
        features.update(sample_prompt=Value("string"), sample_prompt_ids=List(Value("int32")),
                        sample_chosen=Value("string"), sample_rejected=Value("string"), judge_prompt=judge)
    features["_status"] = Value("int8")
    features.update({column: Value(kind) for column, kind in AUDIT_COLUMNS.items()})
    return Features(features)


def prepare_batch(batch: dict, *, shape: str, stage: str, location: str, source: str, rows_in: str, tokenizer,
                   data: DataArguments, sft: SFTArguments, chat_template: str | None,
                   has_chat_template: bool, held_out: bool, output_columns: list[str],
                   origins: list | None = None, processing=None, images: bool = False) -> dict:
    """normalize → check → tokenize → keep-or-drop of one batch of source rows (datasets.map, batched).

    Dropped rows stay in the batch with their reason in `_status` (so the counts and the first dropped row numbers
    come out of one pass) and are filtered out afterwards. A bad row is named by its number in `rows_in`, the source
    it was read from (SOURCE_ROW), not by its place in a carved split: in a split of several files, the file and its
    row (`origins`). `images`: the source's rows carry images (src/data/images.py), read into each row here and
    tokenized with `processing` (a vision model's: src/vision.py)."""
    source_rows = batch.pop(SOURCE_ROW)
    columns = list(batch)
    out = {column: [] for column in output_columns}
    for values, source_row in zip(zip(*(batch[column] for column in columns)), source_rows):
        where, number = row_origin(origins, rows_in, source_row + 1)
        try:
            normalized = normalize_row(dict(zip(columns, values)), shape, data.system_prompt, has_chat_template)
        except DataError as error:
            raise DataError(f"{where} row {number}: {error}") from None
        if images:
            normalized = gather_images(normalized, image_base(where, location), where, number)
        if shape == "kto_pairs":  # one source pair → its desirable and its undesirable row
            identical = normalized["chosen"] == normalized["rejected"]
            check_row(normalized, number, PAIRS, where)
            for row in unpaired_rows(normalized):
                _prepare_row(row, IDENTICAL if identical else None, out, number, source_row, stage=stage,
                             location=location, where=where, tokenizer=tokenizer, data=data, sft=sft,
                             chat_template=chat_template, has_chat_template=has_chat_template,
                             held_out=held_out and row["label"], output_columns=output_columns)
        else:
            _prepare_row(normalized, None, out, number, source_row, stage=stage, location=location, where=where,
                         tokenizer=tokenizer, data=data, sft=sft, chat_template=chat_template,
                         has_chat_template=has_chat_template, held_out=held_out, output_columns=output_columns,
                         processing=processing)
    return out


def _prepare_row(row: dict, status: int | None, out: dict, number: int, source_row: int, *, stage: str,
                 location: str, where: str, tokenizer, data: DataArguments, sft: SFTArguments,
                 chat_template: str | None, has_chat_template: bool, held_out: bool, output_columns: list[str],
                 processing=None) -> None:
    """One normalised row checked, tokenized and appended to `out` (a held-out row with its sample fields; a KTO pair's
    undesirable row is held out without them: each pair's prompt is answered once)."""
    row_status = check_row(row, number, stage, where)
    status = row_status if status is None or row_status != KEPT else status
    kind = stage_shape(stage)
    if kind == SEQUENCES and row.pop("label", True) is False:
        status = UNDESIRABLE  # SFT before KTO learns from the thumbs-up rows only
    if not has_chat_template and any(is_chat(value) for value in row.values()):
        raise DataError(
            f"{location}: the data is a chat but the model's tokenizer has no chat template to "
            "render it; use a chat/instruct model, text data (prompt/chosen/rejected as strings), or give the "
            "model a template with --chat_template_path (a Jinja file or a tokenizer directory)"
        )
    item, ids, length = {}, {}, 0
    keep, kwargs = data.reasoning != "drop", data.chat_template_kwargs
    with template_refusals(where, number, tokenizer):
        if status == KEPT:
            if kind == UNPAIRED:
                item = ids = tokenize_unpaired(row, tokenizer, keep, kwargs)
                length = len(item["prompt_ids"]) + len(item["completion_ids"])
                kept = len(item["prompt_ids"]) < data.max_length  # TRL's KTO rule, as for DPO
            elif kind == PAIRS:
                item = ids = tokenize_preference(row, tokenizer, keep, kwargs, processing)
                length = len(item["prompt_ids"]) + max(len(item["chosen_ids"]), len(item["rejected_ids"]))
                # TRL's rule: a prompt that fills max_length leaves no completion token to learn from. (A kept
                # pair's images are whole: their tokens are the prompt's, and only the answers are ever cut.)
                kept = len(item["prompt_ids"]) < data.max_length
            elif kind == PROMPTS:  # the prompt as generation sees it (chat template, generation prompt)
                item = ids = {"prompt_ids": sample_fields(row, tokenizer, kwargs)["sample_prompt_ids"]}
                length = len(item["prompt_ids"])
                kept = length < data.max_length  # room for an answer within max_length, as for a DPO prompt
            elif kind == SCORED_PAIRS:
                ids = tokenize_preference(row, tokenizer, keep, kwargs)
                item = reward_ids(ids)
                length = max(len(item["chosen_ids"]), len(item["rejected_ids"]))
                # TRL's rule for reward models: a pair over max_length is dropped, not truncated (truncating would
                # cut the answer whose last token the score is read from).
                kept = length <= data.max_length
            else:
                item = ids = tokenize_sft(row, tokenizer, sft.assistant_only_loss, chat_template, keep, kwargs,
                                          processing)
                length = len(item["input_ids"])
                # Never cut inside an image's tokens: its features would outnumber them (the row is dropped, counted).
                kept = has_trainable_token(item, data.max_length, sft) and not (
                    processing is not None and processing.last_image_position(item["input_ids"]) >= data.max_length)
            status = KEPT if kept else TOO_LONG
            if not keep and kind in PAIRED_SHAPES and ids["chosen_ids"] == ids["rejected_ids"]:
                status = IDENTICAL  # the answers differed only in their reasoning, which --reasoning drop removes
        record = {**serializable(row), **item, "length": length, "_status": status,
                  **row_fields(row, ids, source_row, tokenizer, processing)}
        if "sample_prompt" in output_columns:
            record.update(sample_fields(row, tokenizer, kwargs, processing) if status == KEPT and held_out else
                          {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": "",
                           "sample_rejected": None, "judge_prompt": None})
    for column in output_columns:
        out[column].append(record.get(column, [] if column.endswith(("_ids", "_mask", "_masks")) else None))


def serializable(row: dict) -> dict:
    """Chat columns go through JSON where their message dicts differ in keys (tool calls), which Arrow can't mix."""
    return {key: (json.dumps(value) if key == "tools" and not isinstance(value, str) else value)
            for key, value in row.items()}
