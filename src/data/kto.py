"""KTO's data: both classes present in training, and each row's KL partner (a seeded derangement of the split's
completions, written as extra columns) as TRL's KTOTrainer pairs them.
"""

from __future__ import annotations

import os
from pathlib import Path

from src.data.errors import DataError
from src.data.pool import MAP_BATCH_ROWS


# How each row's KL completion is chosen (add_kl_completions below): part of the prepared-data key.
KL_PARTNERS = "seeded-derangement-v1"


def check_kto_classes(train: dict, location: str) -> None:
    """KTO learns from thumbs up against thumbs down: a training split with one class only is refused."""
    for present, missing in (("desirable", "undesirable"), ("undesirable", "desirable")):
        if not train[missing]:
            raise DataError(f"{location}: every training row is {present} ({train[present]} rows, none "
                            f"{missing}); KTO needs both thumbs up and thumbs down (check --label_column and its "
                            "values)")


def kl_partners(rows: int, seed: int):
    """Row i's KL partner for KTO's KL estimate (an index array): a seeded derangement with one cycle, so no row is its
    own partner and the pairing depends on the data and the seed alone, not on which rows share a device's batch (TRL
    1.16 cycles completions inside each device batch: not world-size invariant)."""
    import numpy as np

    if rows < 2:  # a held-out split of one row: its own completion (the eval's KL then measures the matched pair)
        return np.zeros(rows, dtype=np.int64)
    order = np.random.default_rng([seed, rows]).permutation(rows)
    partners = np.empty(rows, dtype=np.int64)
    partners[order] = np.roll(order, -1)
    return partners


def add_kl_completions(path: Path, seed: int, kind: str, location: str) -> None:
    """KTO's mismatched completion of every row, written as the split's `KL_completion_ids` column: row i's is the
    completion of row kl_partners(...)[i] (a prompt paired with another row's answer estimates the KL term)."""
    import pyarrow as pa
    from datasets import Dataset, Features
    from datasets.arrow_writer import ArrowWriter

    dataset = Dataset.from_file(str(path))
    if len(dataset) < 2 and kind == "train":
        raise DataError(f"{location} ({kind}): KTO needs at least 2 rows (each row's KL term pairs its prompt with "
                        f"another row's completion); this split has {len(dataset)}")
    partners = pa.array(kl_partners(len(dataset), seed))
    features = Features({**dataset.features, "KL_completion_ids": dataset.features["completion_ids"]})
    temporary = path.with_suffix(".kl.arrow")
    with ArrowWriter(features=features, path=str(temporary)) as writer:
        for start in range(0, len(dataset), MAP_BATCH_ROWS * 16):
            table = dataset.data.slice(start, MAP_BATCH_ROWS * 16).table
            kl = dataset.data.table.column("completion_ids").take(partners[start:start + table.num_rows])
            writer.write_table(table.append_column("KL_completion_ids", kl))
        writer.finalize()
    del dataset
    os.replace(temporary, path)
