"""Every file `datasets` reads, the toolkit reads: the table of file variants (docs/data.md lists them).

Each variant of the same 16 pairs (compressed, byte-order mark, CRLF, JSON array, JSON Lines under .json, sharded files,
split folders, the Hub's layouts) trains on the same token ids as the plain JSON Lines file; each broken variant is
answered in one line that names the file and its line or row, inside a compressed file or a shard as well. In-process
preparation (`prepare_data`), no launch.
"""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import lzma
from pathlib import Path

import pytest

from conftest import preference_rows
from src.config import DataArguments, SFTArguments
from src.data_file_kinds import data_file_kind
from src.data import DataError, prepare_data, source_files

ROWS = [{"prompt": row["prompt"][0]["content"], "chosen": row["chosen"][0]["content"],
         "rejected": row["rejected"][0]["content"]} for row in preference_rows(16)]  # text: CSV holds them too
BOM = "\ufeff"


def _prepared(tokenizer, cache: Path, location: Path):
    data = DataArguments(dataset_name=str(location), val_size=2, test_size=2, max_length=64, dataset_num_proc=1)
    return prepare_data(data, SFTArguments(), "dpo", 0, tokenizer, cache)


def _ids(result) -> list:
    return [result.splits[kind][column] for kind in ("train", "validation", "test")
            for column in ("prompt_ids", "chosen_ids", "rejected_ids")]


def _lines(rows, end="\n") -> str:
    return "".join(json.dumps(row) + end for row in rows)


def _csv(rows, end="\n") -> str:
    return "prompt,chosen,rejected" + end + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}{end}" for r in rows)


def _write(path: Path, text: str, opener=open) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wt", encoding="utf-8", newline="") as handle:
        handle.write(text)
    return path


def _parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _arrow(path: Path, rows, stream: bool = True) -> Path:
    """An Arrow IPC file: the stream format datasets writes (its cache files), or the file format."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


# Each builds its variant under the directory given and returns what --dataset_name names.
VARIANTS = {
    "jsonl with a byte-order mark": lambda d: _write(d / "pairs.jsonl", BOM + _lines(ROWS)),
    "jsonl with CRLF line ends": lambda d: _write(d / "pairs.jsonl", _lines(ROWS, "\r\n")),
    "jsonl with both, gzip": lambda d: _write(d / "pairs.jsonl.gz", BOM + _lines(ROWS, "\r\n"), gzip.open),
    "jsonl.bz2": lambda d: _write(d / "pairs.jsonl.bz2", _lines(ROWS), bz2.open),
    "jsonl.xz": lambda d: _write(d / "pairs.jsonl.xz", _lines(ROWS), lzma.open),
    "json array, indented, byte-order mark": lambda d: _write(d / "pairs.json", BOM + json.dumps(ROWS, indent=2)),
    "json array, gzip": lambda d: _write(d / "pairs.json.gz", json.dumps(ROWS), gzip.open),
    "json lines under a .json name": lambda d: _write(d / "pairs.json", _lines(ROWS)),
    "csv with a byte-order mark and CRLF": lambda d: _write(d / "pairs.csv", BOM + _csv(ROWS, "\r\n")),
    "csv.gz": lambda d: _write(d / "pairs.csv.gz", _csv(ROWS), gzip.open),
    "tsv (two shards)": lambda d: (_write(d / "t" / "train-00000-of-00002.tsv", _csv(ROWS[:4]).replace(",", "\t")),
                                   _write(d / "t" / "train-00001-of-00002.tsv", _csv(ROWS[4:]).replace(",", "\t")),
                                   d / "t")[-1],
    "ndjson.gz": lambda d: _write(d / "pairs.ndjson.gz", _lines(ROWS), gzip.open),
    "a directory holding one file not named by split": lambda d: (
        _write(d / "one" / "pairs.jsonl.gz", _lines(ROWS), gzip.open), d / "one")[-1],
    "sharded files": lambda d: (_write(d / "pairs" / "train-00000-of-00002.jsonl", _lines(ROWS[:9])),
                                _write(d / "pairs" / "train-00001-of-00002.jsonl.gz", _lines(ROWS[9:]), gzip.open),
                                d / "pairs")[-1],
    "the Hub's data/ shards (parquet)": lambda d: (
        _parquet(d / "hub" / "data" / "train-00000-of-00002.parquet", ROWS[:5]),
        _parquet(d / "hub" / "data" / "train-00001-of-00002.parquet", ROWS[5:]),
        _write(d / "hub" / "README.md", "---\nlicense: mit\n---\n"), d / "hub")[-1],
    "an Arrow file (datasets' cache format)": lambda d: _arrow(d / "pairs.arrow", ROWS),
    "Arrow shards, the IPC file format": lambda d: (_arrow(d / "a" / "train-00000-of-00002.arrow", ROWS[:6], False),
                                                     _arrow(d / "a" / "train-00001-of-00002.arrow", ROWS[6:], False),
                                                     d / "a")[-1],
    "split folders": lambda d: (_write(d / "splits" / "train" / "part-a.jsonl", _lines(ROWS[:7])),
                                _write(d / "splits" / "train" / "part-b.json", json.dumps(ROWS[7:])), d / "splits")[-1],
    "data/train-*.csv": lambda d: (_write(d / "named" / "data" / "train-first.csv", _csv(ROWS[:8])),
                                   _write(d / "named" / "data" / "train-second.csv", _csv(ROWS[8:])),
                                   d / "named")[-1],
}


@pytest.fixture(scope="module")
def reference(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return _ids(_prepared(tiny_tokenizer, root / "cache", _write(root / "pairs.jsonl", _lines(ROWS))))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_file_variant_trains_on_the_same_rows(variant, reference, tiny_tokenizer, tmp_path):
    location = VARIANTS[variant](tmp_path)
    assert _ids(_prepared(tiny_tokenizer, tmp_path / "cache", location)) == reference


def _wrong_type(rows, index):
    rows = [dict(row) for row in rows]
    rows[index]["chosen"] = 3
    return rows


def _truncated(path: Path) -> Path:
    _write(path, _lines(ROWS * 50), gzip.open)
    path.write_bytes(path.read_bytes()[:-200])
    return path


BROKEN = {
    "a broken line inside .gz": (
        lambda d: _write(d / "pairs.jsonl.gz", _lines(ROWS[:2]) + '{"prompt": "a", "chosen": \n' + _lines(ROWS),
                         gzip.open), "pairs.jsonl.gz line 3: not valid JSON"),
    "a wrong row inside .gz": (
        lambda d: _write(d / "pairs.jsonl.gz", _lines(_wrong_type(ROWS, 2)), gzip.open),
        "pairs.jsonl.gz row 3: 'chosen' must be text"),
    "a wrong row after a byte-order mark": (
        lambda d: _write(d / "pairs.jsonl", BOM + _lines(_wrong_type(ROWS, 0))), "pairs.jsonl row 1: 'chosen'"),
    "a broken JSON array": (
        lambda d: _write(d / "pairs.json", json.dumps(ROWS, indent=1).replace('"chosen"', '"chosen" "', 1)),
        "pairs.json line 4: not valid JSON"),
    "a wrong row in a JSON array": (
        lambda d: _write(d / "pairs.json", json.dumps(_wrong_type(ROWS, 4))), "pairs.json row 5: 'chosen' must be"),
    "a wrong row in the second shard": (
        lambda d: (_write(d / "p" / "train-00000-of-00002.jsonl", _lines(ROWS[:9])),
                   _write(d / "p" / "train-00001-of-00002.jsonl", _lines(ROWS[9:10] + [ROWS[10] | {"chosen": None}])),
                   d / "p")[-1],
        "train-00001-of-00002.jsonl row 2: 'chosen' is missing"),
    "an empty answer in the Hub's second parquet shard": (
        lambda d: (_parquet(d / "h" / "data" / "train-00000-of-00002.parquet", ROWS[:5]),
                   _parquet(d / "h" / "data" / "train-00001-of-00002.parquet",
                            ROWS[5:8] + [ROWS[8] | {"chosen": None}] + ROWS[9:]), d / "h")[-1],
        "train-00001-of-00002.parquet row 4: 'chosen' is missing"),
    "an empty cell in the second .tsv shard": (
        lambda d: (_write(d / "t" / "train-00000-of-00002.tsv", _csv(ROWS[:4]).replace(",", "\t")),
                   _write(d / "t" / "train-00001-of-00002.tsv",
                          _csv(ROWS[4:6] + [ROWS[6] | {"chosen": ""}] + ROWS[7:]).replace(",", "\t")), d / "t")[-1],
        "train-00001-of-00002.tsv row 3: 'chosen' is missing"),
    "an empty answer in the second .arrow shard": (
        lambda d: (_arrow(d / "a" / "train-00000-of-00002.arrow", ROWS[:6]),
                   _arrow(d / "a" / "train-00001-of-00002.arrow", ROWS[6:7] + [ROWS[7] | {"chosen": None}] + ROWS[8:]),
                   d / "a")[-1],
        "train-00001-of-00002.arrow row 2: 'chosen' is missing"),
    "a text file under an .arrow name": (lambda d: _write(d / "pairs.arrow", _lines(ROWS)), "pairs.arrow"),
    "a truncated .gz": (lambda d: _truncated(d / "pairs.jsonl.gz"), "pairs.jsonl.gz: cannot decompress it"),
    "a plain file under a .gz name": (lambda d: _write(d / "pairs.jsonl.gz", _lines(ROWS)),
                                      "pairs.jsonl.gz: cannot decompress it (Not a gzipped file"),
    "a compressed parquet file": (lambda d: _write(d / "pairs.parquet.gz", "x", gzip.open), "unsupported file type"),
}
if importlib.util.find_spec("zstandard") is None:
    BROKEN["a .zst file without zstandard"] = (lambda d: _write(d / "pairs.jsonl.zst", "x"),
                                               "a .zst file needs the zstandard package")


@pytest.mark.parametrize("variant", list(BROKEN))
def test_each_broken_variant_gets_one_line_naming_the_file_and_row(variant, tiny_tokenizer, tmp_path):
    make, line = BROKEN[variant]
    with pytest.raises(DataError) as error:
        _prepared(tiny_tokenizer, tmp_path / "cache", make(tmp_path))
    assert line in str(error.value) and "\n" not in str(error.value)


def test_the_kinds_are_the_ones_datasets_decompresses():
    from datasets.utils.file_utils import SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL

    for extension in SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL:
        assert data_file_kind(f"pairs.jsonl.{extension}") == (".jsonl", f".{extension}")
    assert data_file_kind("train-00000-of-00004.parquet") == (".parquet", "")
    assert data_file_kind("pairs.txt") is None and data_file_kind("pairs.parquet.gz") is None


def test_a_changed_shard_or_compressed_file_is_a_new_source(tmp_path):
    """The prepared-data key and a finished run's fingerprint list the files read: a shard in a folder below the
    directory and a compressed file among them."""
    location = VARIANTS["the Hub's data/ shards (parquet)"](tmp_path)
    assert tmp_path / "hub" / "data" / "train-00001-of-00002.parquet" in source_files(str(location))
    compressed = VARIANTS["jsonl.xz"](tmp_path)
    assert source_files(str(compressed)) == [compressed]
