"""Which files are data files: the file types the toolkit reads, the `datasets` builder for each and the compressions
`datasets` undoes, from a file's name alone (src/data/files.py reads them; the SageMaker channel lookup in
src/config_parse.py recognises them); and the files a local source is made of (what the prepared data's key and a
finished run's data fingerprint read). No project imports: the parser and run safety may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


# Data file types the toolkit reads, and the `datasets` builder for each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv",
                      ".tsv": "tsv", ".arrow": "arrow"}  # tsv: datasets' csv builder with sep="\t", as datasets reads
# a .tsv; .arrow: Arrow IPC files as datasets writes them (its cache files, Dataset.from_file)
# The single-file compressions `datasets` undoes by a name's last suffix (datasets/filesystems/compression.py), and
# the module each needs beyond the standard library. Text formats only: Parquet compresses inside the file.
DATA_FILE_COMPRESSIONS = {".gz": None, ".gzip": None, ".bz2": None, ".xz": None, ".zst": "zstandard",
                          ".zstd": "zstandard", ".lz4": "lz4"}
TEXT_DATA_FORMATS = (".json", ".jsonl", ".ndjson", ".csv", ".tsv")


def data_file_kind(path: str | os.PathLike) -> tuple[str, str] | None:
    """(format suffix, compression suffix or "") of a data file the toolkit reads, from its name as `datasets` reads
    it: train.jsonl → (".jsonl", ""), pairs.jsonl.gz → (".jsonl", ".gz"); None for any other file."""
    name = os.path.basename(os.fspath(path)).lower()
    compression = next((suffix for suffix in DATA_FILE_COMPRESSIONS if name.endswith(suffix)), "")
    stem = name[:len(name) - len(compression)]
    form = os.path.splitext(stem)[1]
    if form not in DATA_FILE_BUILDERS or (compression and form not in TEXT_DATA_FORMATS):
        return None
    return form, compression


def source_files(location: str) -> list[Path] | None:
    """The files of a local source (a file, or every file under a directory, sorted); None for a Hub id."""
    path = Path(location)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(item for item in path.rglob("*") if item.is_file())
    return None
