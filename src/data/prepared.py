"""The prepared directory's files: one Arrow file per split, written from the kept rows batch by batch and memory-mapped
back by every rank (`PreparedData`), summary.json, and each split's source row numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.data.checks import KEPT


SUMMARY_FILE = "summary.json"


@dataclass
class PreparedData:
    path: Path
    splits: Any  # datasets.DatasetDict, file-backed
    summary: dict
    # A vision-language model's processor (src/vision.py ImageProcessing) that tokenized the rows and turns their
    # images (IMAGE_COLUMN) into the model's tensors; None for a text model
    processing: Any = None

    @property
    def train(self):
        return self.splits["train"]

    @property
    def validation(self):
        return self.splits["validation"] if "validation" in self.splits else None

    @property
    def test(self):
        return self.splits["test"] if "test" in self.splits else None


def prepared_columns(dataset) -> list[str]:
    """The tokenizing map's columns that the prepared files keep: not the row's fate nor the audit's columns."""
    return [column for column in dataset.column_names if not column.startswith("_")]


def write_source_rows(dataset, target: Path, kind: str) -> None:
    """Each prepared row's number in its source file (1-based), in the prepared order: what a finding names."""
    import numpy as np

    kept = dataset.data.column("_status").to_numpy() == KEPT
    np.save(source_rows_file(target, kind), dataset.data.column("_source_row").to_numpy()[kept] + 1)


def source_rows_file(target: Path, kind: str) -> Path:
    return target / f"{kind}-source-rows.npy"


def source_rows(prepared: "PreparedData", kind: str):
    """The prepared split's rows' numbers in the source (a memory-mapped array), or None (a mixture: rows of several
    files)."""
    import numpy as np

    path = source_rows_file(prepared.path, kind)
    return np.load(path, mmap_mode="r") if path.exists() else None


def split_file(target: Path, kind: str, suffix: str = "") -> Path:
    return target / f"{kind}{suffix}.arrow"


def write_kept(pieces: list, columns: list[str], path: Path) -> None:
    """The KEPT rows of tokenized datasets (file-backed, in order) as one Arrow file with `columns` and their datasets
    types, streamed record batch by record batch from the files the tokenizing map wrote. The files are read with
    plain reads, not memory-mapped: every mapped page this process reads would stay in its resident set (that made
    `save_to_disk` of the filtered splits grow the peak with the data), while a read batch is freed once written."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Features
    from datasets.arrow_writer import ArrowWriter

    features = Features({column: pieces[0].features[column] for column in columns})
    with ArrowWriter(features=features, path=str(path)) as writer:
        for piece in pieces:
            for cache_file in piece.cache_files:
                with pa.OSFile(cache_file["filename"]) as source:
                    for batch in pa.ipc.open_stream(source):
                        kept = batch.filter(pc.equal(batch.column("_status"), KEPT)).select(columns)
                        if kept.num_rows:
                            writer.write_table(pa.Table.from_batches([kept]))
        writer.finalize()


def open_split(target: Path, kind: str):
    """A prepared split, memory-mapped (zero-copy), its types from the file's datasets metadata. Its fingerprint is
    its cache key, the same on every machine and in every run: TRL names its reference log-prob cache after it."""
    from datasets import Dataset
    from datasets.table import MemoryMappedTable

    indices = split_file(target, kind, "-indices")
    return Dataset(MemoryMappedTable.from_file(str(split_file(target, kind))),
                   indices_table=MemoryMappedTable.from_file(str(indices)) if indices.exists() else None,
                   fingerprint=f"{target.name}-{kind}")
