"""Train / validation / test: the source's own splits where it has them, otherwise carved from the training split by
--val_size / --test_size with the run's seed.
"""

from __future__ import annotations

import random

from src.config import DataArguments
from src.data.errors import DataError


def find_split(names: list[str], train_split: str, kind: str) -> str | None:
    candidates = {"validation": ["validation", "valid", "val", "dev"], "test": ["test"]}[kind]
    for candidate in [train_split.replace("train", name) for name in candidates] + candidates:
        if candidate in names and candidate != train_split:
            return candidate
    return None


def _split_count(size: float, rows: int) -> int:
    return int(size) if size >= 1 else int(round(size * rows))


def split_datasets(raw, data: DataArguments, seed: int) -> dict:
    """train / validation / test Datasets: the source's own splits where it has them, else carved with `seed`.

    Carving selects row indices (the rows stay in their memory-mapped Arrow files); the order is that of
    `random.Random(seed).shuffle`, so a seed carves the same rows it always has."""
    import numpy as np

    names = list(raw.keys())
    if data.dataset_split not in names:
        raise DataError(f"--dataset_split {data.dataset_split}: no such split; the data has {', '.join(names)}")
    splits = {"train": raw[data.dataset_split]}
    for kind in ("validation", "test"):
        found = find_split(names, data.dataset_split, kind)
        if found:
            splits[kind] = raw[found]
    carve = [kind for kind in ("validation", "test") if kind not in splits]
    if carve:
        train = splits["train"]
        counts = {kind: _split_count(getattr(data, f"{'val' if kind == 'validation' else 'test'}_size"), len(train))
                  for kind in carve}
        if sum(counts.values()) >= len(train):
            raise DataError(
                f"{len(train)} training rows cannot give {counts} held-out rows: lower --val_size / --test_size"
            )
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        order = np.asarray(order, dtype=np.int64)  # 8 bytes a row instead of a Python int's 36
        start = 0
        for kind in carve:
            splits[kind] = train.select(order[start:start + counts[kind]])
            start += counts[kind]
        splits["train"] = train.select(np.sort(order[start:]))
    if data.max_train_samples:
        splits["train"] = splits["train"].select(range(min(data.max_train_samples, len(splits["train"]))))
    return {kind: dataset for kind, dataset in splits.items() if len(dataset)}
