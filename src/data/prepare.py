"""prepare_data: a stage's data built once under its key (one process per machine, under a file lock) and opened by
every rank; per source: load, recognise, split, check and tokenize in one streaming map; the counts and the data audit
of each split.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from src.config import EMBEDDED, DataArguments, SFTArguments
from src.data.cache_key import prepared_path
from src.data.checks import EMPTY, IDENTICAL, KEPT, TOO_LONG, UNDESIRABLE
from src.data.errors import DataError
from src.data.images import (changed_images, has_images, image_column, normalized_image_features, undecoded,
                              write_image_files)
from src.data.kto import add_kl_completions, check_kto_classes
from src.data.mixtures import mix_sources, take_fraction, mixture_sources
from src.data.pair_audit import NO_PROMPT, counts_of, split_audit
from src.data.pool import map_with_progress
from src.data.prepared import (PreparedData, SUMMARY_FILE, open_split, prepared_columns, split_file, write_kept,
                               write_source_rows)
from src.data.rows import SOURCE_ROW, normalized_features, output_features, prepare_batch
from src.data.shapes import (CHAT_COLUMNS, stage_shape, apply_column_mapping, detect_shape, gather_meta, normalize_row,
                             prompts_as_chats)
from src.data.sources import load_source_with_origins, source_location
from src.data.splits import find_split, split_datasets
from src.data.templates import check_chat_messages
from src.data.tokenization import token_columns_of, sft_chat_template
from src.objectives import PAIRS, SCORED_PAIRS, SEQUENCES, UNPAIRED
from src.resource_limits import usable_cores
from src.run_safety import hang_watch
from src.run_safety.build_once import build_once
from src.run_safety.disk_space import fail_write_if_injected


def _counts(prepared, stage: str, source: str, max_length: int) -> dict:
    """Kept / dropped / truncated counts of a split from its `_status` and `length` columns (read as arrays, a few
    bytes a row), with the same refusals as before: nothing left after the checks, or after the length rule."""
    import numpy as np

    status = prepared.data.column("_status").to_numpy()
    lengths = prepared.data.column("length").to_numpy()
    empty, identical = np.flatnonzero(status == EMPTY), np.flatnonzero(status == IDENTICAL)
    label = prepared.data.column("label").to_numpy(zero_copy_only=False) if stage_shape(stage) == UNPAIRED else None
    checked, kept = (status == KEPT) | (status == TOO_LONG), status == KEPT
    if not checked.any():
        reason = "chosen identical to rejected" if len(identical) and not len(empty) else "an empty answer"
        raise DataError(f"{source}: every one of its {len(status)} rows has {reason}: nothing to learn from")
    if not kept.any():
        what = "pair is over" if stage_shape(stage) == SCORED_PAIRS else "prompt is at least"
        raise DataError(f"{source}: every {what} --max_length {max_length} tokens long; raise --max_length")
    kto = {}
    if label is not None:
        desirable = int((kept & (label == True)).sum())  # noqa: E712 - an array of booleans (None where dropped)
        kto = {"desirable": desirable, "undesirable": int(kept.sum()) - desirable}
    elif (status == UNDESIRABLE).any():
        kto = {"undesirable_dropped": int((status == UNDESIRABLE).sum())}
    return kto | {"rows": len(status), "empty_answers": len(empty), "identical_pairs": len(identical),
            "kept": int(kept.sum()), "first_empty_rows": [int(i) + 1 for i in empty[:5]],
            "first_identical_rows": [int(i) + 1 for i in identical[:5]],
            "dropped_too_long" if stage_shape(stage) == SCORED_PAIRS else "dropped_prompt_too_long":
                int((status == TOO_LONG).sum()),
            "truncated": int((kept & (lengths > max_length)).sum()), "longest_tokens": int(lengths[checked].max())}


def _build(target: Path, data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer,
           processing=None) -> None:
    num_proc = data.dataset_num_proc or usable_cores()  # a container's CPU quota too
    if num_proc > 1:  # forked workers tokenize one text at a time: no thread pool to fight over, no warning
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = target / ".work"
    work.mkdir()
    summary = {"stage": stage, "max_length": data.max_length, "reasoning": data.reasoning}
    sources = mixture_sources(data)
    if not sources:
        location, shape, tokenized, counts = _prepare_source(data, sft, stage, seed, tokenizer, num_proc, work,
                                                             processing=processing)
        for kind, dataset in tokenized.items():
            write_kept([dataset], prepared_columns(dataset), split_file(target, kind))
            write_source_rows(dataset, target, kind)
            if stage_shape(stage) == UNPAIRED:
                add_kl_completions(split_file(target, kind), seed, kind, location)
        summary |= {"source": location, "shape": shape, "splits": counts,
                    "audit": _audit({kind: [dataset] for kind, dataset in tokenized.items()}, counts, stage,
                                    data.max_length, data.reasoning != "drop")}
    else:
        parts = []
        for number, (source, fraction) in enumerate(sources):
            location, shape, tokenized, counts = _prepare_source(source, sft, stage, seed, tokenizer, num_proc,
                                                                 work / str(number), fraction, processing)
            parts.append((location, shape, fraction, tokenized, counts))
        summary |= mix_sources(parts, seed, target)
        if stage_shape(stage) == UNPAIRED:
            for kind in summary["splits"]:
                add_kl_completions(split_file(target, kind), seed, kind, summary["source"])
        pieces = {}
        for _, _, _, tokenized, _ in parts:
            for kind, dataset in tokenized.items():
                pieces.setdefault(kind, []).append(dataset)
        summary["audit"] = _audit(pieces, summary["splits"], stage, data.max_length, data.reasoning != "drop")
    if stage_shape(stage) == UNPAIRED:
        check_kto_classes(summary["splits"]["train"], summary["source"])
    write_image_files(target, [dataset for pieces in _work_datasets(tokenized if not sources else parts)
                               for dataset in pieces])
    shutil.rmtree(work)
    (target / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _work_datasets(tokenized) -> list[list]:
    """The tokenizing map's outputs: of one source ({kind: dataset}), or of a mixture's parts."""
    if isinstance(tokenized, dict):
        return [list(tokenized.values())]
    return [list(part[3].values()) for part in tokenized]


def _prepare_source(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, num_proc: int,
                    work: Path, fraction: float = 1.0, processing=None):
    """One source, recognised in its own shape and columns: (location, shape, tokenized splits, counts per split).

    The tokenized splits still hold the dropped rows, with their reason in `_status` (`write_kept` leaves them out)."""
    import datasets
    import numpy as np

    location = source_location(data, stage)
    work.mkdir(parents=True, exist_ok=True)
    raw, origins, mapping = _load_with_columns_mapped(data, stage, location)
    images = _check_images(raw, location, processing, tokenizer)
    columns = raw[next(iter(raw))].column_names
    features = raw[next(iter(raw))].features
    first_row = raw[next(iter(raw))][0]
    shape = _recognised_shape(raw, columns, first_row, mapping, data, stage, tokenizer, location, origins)
    # Each row carries its number in its source split, so an error names the row a user finds in the file, not its
    # place in the training split once the held-out rows are carved out.
    raw = datasets.DatasetDict({name: split.add_column(SOURCE_ROW, np.arange(len(split), dtype=np.int64))
                                for name, split in raw.items()})
    chat_template = sft_chat_template(tokenizer, sft) if stage_shape(stage) == SEQUENCES else None
    has_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pair_shape = detect_shape(columns, first_row, PAIRS) if shape in ("preference", "kto_pairs") else None
    normalized = normalized_features(features, shape, has_chat_template, pair_shape)
    if images:
        normalized = normalized_image_features(normalized)
    try:
        first = normalize_row(first_row, shape, data.system_prompt, has_chat_template)
    except DataError as error:
        raise DataError(f"{location} row 1: {error}") from None
    token_columns = list(token_columns_of(first, stage, tokenizer, sft, chat_template))
    tokenized, counts = {}, {}
    # The source split each kind's rows come from: its own (validation, test), else carved from the training split.
    split_names = {kind: find_split(list(raw), data.dataset_split, kind) or data.dataset_split
                   for kind in ("validation", "test")} | {"train": data.dataset_split}
    for kind, split in split_datasets(raw, data, seed).items():
        if kind == "train" and fraction < 1:
            split = take_fraction(split, fraction, seed)
        held_out = kind != "train"
        output = output_features(normalized, token_columns, held_out)
        kwargs = {"shape": shape, "stage": stage, "location": location, "source": f"{location} ({kind})",
                  "rows_in": location if len(raw) == 1 else f"{location} ({split_names[kind]})",
                  "origins": (origins or {}).get(split_names[kind]),
                  "tokenizer": tokenizer, "data": data, "sft": sft, "chat_template": chat_template,
                  "has_chat_template": has_chat_template, "held_out": held_out, "output_columns": list(output),
                  "processing": processing, "images": images}
        tokenized[kind] = map_with_progress(split, prepare_batch, kwargs, output, f"tokenizing {kind}", num_proc,
                                             work)
        counts[kind] = _counts(tokenized[kind], stage, kwargs["source"], data.max_length)
    return location, shape, tokenized, counts


def _check_images(raw, location: str, processing, tokenizer) -> bool:
    """Whether the source's rows carry images (src/data/images.py); a text-only model given them is refused."""
    if not has_images(raw):
        return False
    if processing is None:
        column = image_column(raw[next(iter(raw))].column_names)
        held = f"an '{column}' column" if column else "image parts in its messages"
        raise DataError(f"{location}: the data has images ({held}), and {getattr(tokenizer, 'name_or_path', '')} is a "
                        "text-only model: train a vision-language model on it (docs/vision.md), or drop the images")
    return True


def _load_with_columns_mapped(data: DataArguments, stage: str, location: str):
    """The source's splits as the flags shape them: --meta_columns gathered, the --*_column flags' renamings (returned
    as {source column: canonical name}), --chat_prompts; and where its rows came from (files, for error lines)."""
    with hang_watch.phase("data", f"loading {location}", hang_watch.UNWATCHED):  # a download: not judged
        raw, origins = load_source_with_origins(data, stage)
    raw = undecoded(raw)  # images as their files' bytes or paths (src/data/images.py)
    first_split = raw[next(iter(raw))]
    if len(first_split) == 0:
        raise DataError(f"--dataset_name {location}: the data has no rows")
    if data.meta_columns:  # before the renaming: the flag names the source's own columns
        raw = gather_meta(raw, data, location)
    mapping = apply_column_mapping(first_split.column_names, data)
    if mapping:
        raw = raw.rename_columns(mapping)
    if data.chat_prompts:
        raw = prompts_as_chats(raw, location)
    return raw, origins, mapping


def _recognised_shape(raw, columns: list[str], first_row: dict, mapping: dict[str, str], data: DataArguments,
                      stage: str, tokenizer, location: str, origins) -> str:
    """The source's shape for this stage (one line naming the source when it has none), pairs refused for KTO unless
    asked for, and its chat messages checked against the tokenizer's template."""
    try:
        shape = detect_shape(columns, first_row, stage)
    except DataError as error:
        raise DataError(f"{location}: {error}") from None
    if shape == "kto_pairs" and not (data.kto_from_pairs or data.dataset_name == EMBEDDED):
        raise DataError(f"{location}: preference pairs (chosen / rejected), not thumbs up / down rows: add "
                        "--kto_from_pairs to train KTO on them as unpaired rows, or use --stage dpo")
    named = {canonical: source for source, canonical in mapping.items()}
    check_chat_messages(raw, {column: named.get(column, column) for column in CHAT_COLUMNS if column in columns},
                        tokenizer, location, origins)
    return shape


def _audit(pieces: dict[str, list], counts: dict, stage: str, max_length: int, reasoning_kept: bool = True) -> dict:
    """The data audit of every split (src/data/pair_audit.py) from the tokenizing map's output, train first: a held-out
    split is also measured against the training prompts."""
    import numpy as np

    audits, train_prompts = {}, None
    dropped = counts_of(counts)
    for kind in sorted(pieces, key=lambda kind: kind != "train"):
        statuses = np.concatenate([piece.data.column("_status").to_numpy() for piece in pieces[kind]])
        audits[kind] = split_audit(pieces[kind], stage, max_length, statuses, KEPT,
                                   None if kind == "train" else train_prompts, reasoning_kept) | dropped[kind]
        if kind == "train":
            hashes = np.concatenate([piece.data.column("_prompt_hash").to_numpy() for piece in pieces[kind]])
            train_prompts = np.unique(hashes[(statuses == KEPT) & (hashes != NO_PROMPT)])
    return audits


def prepare_data(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, cache_dir: Path,
                 processing=None) -> PreparedData:
    """Build (once per machine) or reuse the tokenized splits, and open them file-backed in this process.
    `processing`: a vision model's (src/vision.py ImageProcessing; None for a text model)."""
    import datasets

    path = prepared_path(data, sft, stage, seed, tokenizer, cache_dir, processing)
    def build(temporary: Path) -> None:
        fail_write_if_injected(path)
        _build(temporary, data, sft, stage, seed, tokenizer, processing)

    with hang_watch.phase("data", f"the {stage} data"):
        target = build_once(path, build)
        changed = changed_images(target)
        if changed:  # image files changed under the same data files: prepared again, under their own key
            path = path.with_name(f"{path.name}-images-{changed}")
            target = build_once(path, build)
    summary = json.loads((target / SUMMARY_FILE).read_text())
    splits = datasets.DatasetDict({kind: open_split(target, kind) for kind in summary["splits"]})
    return PreparedData(path=target, splits=splits, summary=summary, processing=processing)
