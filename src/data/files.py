"""Every file kind the data may come in, as `datasets` reads it: JSON lines, JSON arrays, Parquet, CSV/TSV, Arrow,
compressed text, a UTF-8 BOM, a directory of shards or split files (the Hub's layouts); each unreadable file refused in
one line before `datasets` meets it, and each row's origin (file, line) for the messages that name a row.

tests/test_data_files.py is the table of variants.
"""

from __future__ import annotations

import bisect
import bz2
import csv
import gzip
import importlib.util
import io
import json
import lzma
import re
import zlib
from contextlib import contextmanager
from pathlib import Path

from src.data.errors import DataError
from src.data_file_kinds import DATA_FILE_BUILDERS, DATA_FILE_COMPRESSIONS, data_file_kind


UTF8_BOM = b"\xef\xbb\xbf"  # what Windows tools and spreadsheet exports put before UTF-8 text; datasets skips it
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}.*$")  # train-00000-of-00004(-<hash>): one shard of a split (the Hub's names)
SUPPORTED_FILES = (".json, .jsonl, .parquet or .csv (or .ndjson, .tsv, .arrow), the text ones also compressed (" +
                   ", ".join(DATA_FILE_COMPRESSIONS) + ")")


def data_file_error(location: str, path: Path) -> DataError | None:
    """Why a data file cannot be read at all (its type, a decompressor not installed), or None."""
    kind = data_file_kind(path)
    if kind is None:
        return DataError(f"--dataset_name {location}: unsupported file type; use {SUPPORTED_FILES}")
    module = DATA_FILE_COMPRESSIONS.get(kind[1])
    if module:
        if importlib.util.find_spec(module) is None:
            return DataError(f"--dataset_name {location}: a {kind[1]} file needs the {module} package, as datasets "
                             f"does: pip install {module} (or decompress it)")
    return None


def _open_data_file(path: Path):
    """A data file as a binary stream of its (decompressed) bytes."""
    compression = data_file_kind(path)[1]
    if compression in (".gz", ".gzip"):
        return gzip.open(path, "rb")
    if compression == ".bz2":
        return bz2.open(path, "rb")
    if compression == ".xz":
        return lzma.open(path, "rb")
    if compression in (".zst", ".zstd"):
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True,
                                                                                 closefd=True))
    if compression == ".lz4":
        import lz4.frame
        return lz4.frame.open(path, "rb")
    return open(path, "rb")


def first_columns(path: Path) -> list[str] | None:
    """A local data file's column names from its first row or schema, without loading it: every kind `data_file_kind`
    reads (compressed, with a byte-order mark, JSON Lines under a .json name). None where that is not cheap (a JSON
    array) or the file cannot be read (the preparation names why)."""
    kind = data_file_kind(path)
    if kind is None or data_file_error(str(path), path) is not None:
        return None
    form = kind[0]
    if form == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if form == ".arrow":
        try:
            return list(_arrow_reader(path).schema.names)
        except Exception:  # not Arrow after all: datasets' reading of it says why (load_files)
            return None
    try:
        with _open_data_file(path) as handle:
            if form in (".csv", ".tsv"):
                lines = io.TextIOWrapper(handle, encoding="utf-8-sig", errors="replace", newline="")
                return next(csv.reader(lines, delimiter="\t" if form == ".tsv" else ","), None)
            for number, raw in enumerate(handle):
                raw = raw.removeprefix(UTF8_BOM) if number == 0 else raw
                if raw.strip():
                    if raw.lstrip()[:1] == b"[":
                        return None  # a JSON array: read whole by the preparation
                    row = json.loads(raw)
                    return list(row) if isinstance(row, dict) else None
    except (OSError, EOFError, ValueError):
        return None  # the preparation names the file and line
    return None


def _check_text_lines(path: Path, json_lines: bool) -> int:
    """Find the first line of a text data file that is not UTF-8, or (JSON Lines) does not parse: the errors of
    datasets and Python say neither the file nor the line ("UnicodeDecodeError ... position 339"). A byte-order mark
    and CRLF line ends are read as datasets reads them; a compressed file is read decompressed. Returns the number of
    rows (JSON Lines: its non-blank lines)."""
    rows = 0
    with _unreadable_named(path), _open_data_file(path) as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path} line {number}: not UTF-8 text (byte 0x{raw[error.start]:02x}, the line's byte "
                    f"{error.start + 1}); save the file as UTF-8 (iconv -f <its encoding, e.g. latin1> -t utf-8)"
                ) from None
            if json_lines and line.strip():
                rows += 1
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno}); fix or "
                        "remove that line"
                    ) from None
    return rows


@contextmanager
def _unreadable_named(path: Path):
    """A file the system cannot read, or a truncated or corrupt archive (gzip, bz2, xz, zstd, lz4): one line."""
    try:
        yield
    except DataError:
        raise
    except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError, RuntimeError) as error:
        reason = str(error).strip() or type(error).__name__
        if data_file_kind(path)[1]:
            raise DataError(f"{path}: cannot decompress it ({reason}); download or compress it again") from None
        raise DataError(f"{path}: cannot read it ({reason})") from None


def _is_json_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (else JSON Lines, as datasets reads both under that name)."""
    with _unreadable_named(path), _open_data_file(path) as handle:
        head = handle.read(4096)
    return head.removeprefix(UTF8_BOM).lstrip()[:1] == b"["


def _check_data_file(path: Path) -> int | None:
    """The cheap, line-naming checks of one data file; its number of rows where the check counted them."""
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty: it needs one row per example")
    form, _ = data_file_kind(path)
    if form == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # not Parquet after all: datasets' reading of it says why (load_files)
            return None
    if form == ".arrow":
        try:
            return _arrow_reader(path).read_all().num_rows  # memory-mapped: no copy of the rows
        except Exception:
            return None
    json_lines = form in (".jsonl", ".ndjson") or (form == ".json" and not _is_json_array(path))
    rows = _check_text_lines(path, json_lines=json_lines)
    return rows if json_lines else None


def _arrow_reader(path: Path):
    """An Arrow IPC file, memory-mapped, as datasets' arrow builder reads it: the stream format (what datasets writes),
    else the file format."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(str(path)))


def _json_array_error(path: Path) -> DataError | None:
    """The line of a JSON array file that does not parse (datasets' error names neither file nor line)."""
    with _unreadable_named(path), _open_data_file(path) as handle:
        text = handle.read().removeprefix(UTF8_BOM)
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return DataError(f"{path} line {error.lineno}: not valid JSON ({error.msg} at column {error.colno}); fix "
                         "that row")
    except UnicodeDecodeError:
        return None  # _check_text_lines names the line
    return None


def _split_name(path: Path) -> str:
    """The split a top-level file holds: its name before suffixes and shard number (validation.jsonl.gz →
    validation, train-00001-of-00004.parquet → train)."""
    form, compression = data_file_kind(path)
    stem = path.name[:len(path.name) - len(form) - len(compression)]
    return _SHARD_NAME.sub("", stem) or stem


def names_a_split(name: str) -> bool:
    """Whether a file's split name is one of datasets' split keywords (train, validation, dev, test, eval, ...)."""
    from datasets.data_files import SPLIT_KEYWORDS

    return any(name == keyword for keywords in SPLIT_KEYWORDS.values() for keyword in keywords)


def split_files(directory: Path) -> dict[str, list[str]]:
    """A directory's data files by split, in order. Files at its top are named by split (train.jsonl,
    validation.jsonl.gz, train-00000-of-00004.parquet, ...); with none there, the layouts of the Hub below it
    (data/train-00000-of-00004.parquet, train/*.jsonl, data/train-*.jsonl, ...) are found by datasets' own patterns."""
    files: dict[str, list[str]] = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and data_file_kind(path):
            files.setdefault(_split_name(path), []).append(str(path))
    if not files:
        from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

        try:
            resolved = DataFilesDict.from_patterns(get_data_patterns(str(directory)), base_path=str(directory))
        except (EmptyDatasetError, FileNotFoundError):
            resolved = {}
        files = {str(split): found for split, found in
                 ((split, [file for file in found if data_file_kind(file)]) for split, found in resolved.items())
                 if found}
    # train first: datasets takes the column types from the first split it reads, and a held-out split may hold only
    # nulls in a column the training rows fill (an on-policy round's scores, src/rounds.py)
    return dict(sorted(files.items(), key=lambda item: item[0] != "train"))


def load_files(files: dict[str, list[str]], location: str):
    """Data files by split → (DatasetDict, the files each split's rows come from), each file checked first."""
    import datasets

    for file in (file for found in files.values() for file in found):
        error = data_file_error(location if Path(location).is_file() else file, Path(file))
        if error:
            raise error
    builders = {DATA_FILE_BUILDERS[data_file_kind(file)[0]] for found in files.values() for file in found}
    if len(builders) > 1:
        raise DataError(f"--dataset_name {location}: split files of one format please, found {sorted(builders)}")
    builder = builders.pop()
    builder, options = ("csv", {"sep": "\t"}) if builder == "tsv" else (builder, {})
    rows = {file: _check_data_file(Path(file)) for found in files.values() for file in found}
    try:
        loaded = datasets.load_dataset(builder, data_files=files, **options)
    except Exception as error:  # malformed files surface as several datasets/pyarrow error types
        for file in (file for found in files.values() for file in found):
            if data_file_kind(file)[0] == ".json" and rows[file] is None:
                named = _json_array_error(Path(file))
                if named:
                    raise named from None
        raise DataError(f"--dataset_name {location}: could not read it ({str(error).strip().splitlines()[0]})") from None
    return loaded, {split: _origins(found, rows, len(loaded[split]), builder, options)
                    for split, found in files.items()}


def _origins(files: list[str], rows: dict[str, int | None], total: int, builder: str,
             options: dict) -> list[tuple[str, int]] | None:
    """[(file, the split's row index of its first row)] for a split read from `files` in order; None where the rows
    per file are unknown (then a row is named by its place in the split)."""
    if len(files) == 1:
        return [(files[0], 0)]
    import datasets

    origins, start = [], 0
    for file in files:
        count = rows[file]
        if count is None:  # a CSV or JSON array shard: its rows are known once read
            count = len(datasets.load_dataset(builder, data_files={"train": file}, split="train", **options))
        origins.append((file, start))
        start += count
    return origins if start == total else None


def row_origin(origins: list[tuple[str, int]] | None, where: str, number: int) -> tuple[str, int]:
    """(file, its row number) of a split's row `number` (1-based); (where, number) when the files are unknown."""
    if not origins:
        return where, number
    index = bisect.bisect_right([start for _, start in origins], number - 1) - 1
    return origins[index][0], number - origins[index][1]
