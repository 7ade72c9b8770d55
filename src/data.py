"""Training data: load it, recognise its shape, check it, split it and tokenize it, once, before training.

The result is a `DatasetDict` (train / validation / test) saved to disk under a key of everything that determines it
(source files, tokenizer, stage, lengths, column mapping, split sizes, seed). One process per machine builds it under
a file lock while the others wait on the lock, not on a collective, so a long tokenization cannot run into NCCL's
timeout; every rank then memory-maps the same files (one Arrow file per split), which also keeps TRL's reference
log-prob precomputation working under several processes.

Tokenization mirrors what TRL's trainers do themselves (same helpers, same prompt/completion boundary, same EOS
rules; `tests/test_data.py` checks the ids are identical), so the trainers receive ready columns and skip it.

Preparation streams: the source stays in memory-mapped Arrow files, splits are carved as row indices, and one
batched `datasets.map` per chunk normalizes, checks and tokenizes (on --dataset_num_proc processes) into int32 id
columns written to disk batch by batch; the kept rows are then streamed from those files into each split's file with
plain reads, never through a memory map (a mapped page once read stays in the resident set), so peak memory follows
the batch size, not the data size (`bench/bench_prepare.py` measures it; docs/data.md has the numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.chat_templates import (THINK_CLOSE, THINK_OPEN, TemplateCannotExpress, conversation_ids, split_reasoning,
                                template_label, template_source, tools_argument)
from src.audit.pairs import AUDIT_COLUMNS, NO_PROMPT, counts_of, row_fields, split_audit
from src.config import DATA_FILE_BUILDERS, DATA_FILE_COMPRESSIONS, EMBEDDED, DataArguments, SFTArguments, data_file_kind
from src.private_api import trl_tokenize
from src.progress import Progress
from src.run_safety import hang_watch
from src.resource_limits import usable_cores
from src.run_safety.build_once import build_once
from src.run_safety.disk_space import fail_write_if_injected
from src.run_safety.parent_watch import (exit_with_parent, forked_children_exit_with_this_process,
                                         kill_starter_if_injected)
from src.objectives import (OBJECTIVES, PAIRED_SHAPES, PAIRS, PROMPTS, ROUNDS_STAGE, SCORED_PAIRS, SEQUENCES, UNPAIRED,
                            objective, shape_of)

SUMMARY_FILE = "summary.json"
# Bump when the prepared layout or ids change, so old caches are not reused (8: chat answers as generation writes them,
# src/chat_templates.py).
PREPARED_FORMAT = 8
# Preparation reads an objective's row's `data_shape` (src/objectives/spec.py), never its name; PROMPTS (prompts alone,
# for on-policy rounds that start from them: src/rounds.py) is a preparation of its own. A shape's name may stand for
# a stage where only the shape matters (detecting a pair's layout).
# Words a thumbs-up / thumbs-down column holds in public feedback sets (compared lower-cased, stripped), beside
# booleans and 1/0.
LABEL_WORDS = {
    True: ("true", "yes", "1", "up", "thumbs_up", "thumbsup", "thumbs up", "👍", "+1", "good", "positive", "desirable",
           "like", "liked", "accept", "accepted", "pos"),
    False: ("false", "no", "0", "down", "thumbs_down", "thumbsdown", "thumbs down", "👎", "-1", "bad", "negative",
            "undesirable", "dislike", "disliked", "reject", "rejected", "neg"),
}
# How each row's KL completion is chosen (src/data.py add_kl_completions): part of the prepared-data key.
KL_PARTNERS = "seeded-derangement-v1"
CHAT_COLUMNS = ("prompt", "chosen", "rejected", "messages", "completion")  # columns that may hold messages
SOURCE_ROW = "_source_row"  # a row's index in its source split, while preparing (_prepare_source)
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
# Message roles TRL and the common chat templates know; chat_roles adds any other role the model's template names
# (developer, ipython, ...).
CHAT_ROLES = ("system", "user", "assistant", "tool")
# How templates name roles: message['role'] == 'user', 'user' != message.role, message['role'] in ['user', 'tool']
_TEMPLATE_ROLE = re.compile(r"""role['"\]]*\s*(?:==|!=)\s*['"](\w+)['"]|['"](\w+)['"]\s*(?:==|!=)\s*[\w.\['"]*role\b""")
_TEMPLATE_ROLE_LIST = re.compile(r"""role['"\]]*\s+(?:not\s+)?in\s+[\[(]([^\])]*)[\])]""")
# How templates that take content as a list of parts tell them apart: content is string, part['type'], part.type
_TEMPLATE_PARTS = re.compile(
    r"""content['"\]]*\s+is\s+(?:not\s+)?(?:string|iterable|sequence|mapping)|\[['"]type['"]\]|\.type\b""")
# ShareGPT's speakers (`from`: ShareGPT, Vicuna, LLaMA-Factory's sharegpt format) → chat roles. TRL's
# maybe_convert_to_chatml renames the keys but keeps the values: "human" / "gpt" would reach the chat template as role
# names (printed as such by most templates), and assistant_only_loss would find no assistant turn to learn from.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool"}


class DataError(ValueError):
    """A problem with the user's data: reported as one line naming the file, row or column."""


@dataclass
class PreparedData:
    path: Path
    splits: Any  # datasets.DatasetDict, file-backed
    summary: dict

    @property
    def train(self):
        return self.splits["train"]

    @property
    def validation(self):
        return self.splits["validation"] if "validation" in self.splits else None

    @property
    def test(self):
        return self.splits["test"] if "test" in self.splits else None


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------


def mixture_sources(data: DataArguments) -> list[tuple[DataArguments, float]]:
    """--dataset_mixture as one DataArguments per source (its name, config, split and column mapping; the rest
    shared) and the fraction of its training rows to take. Empty without a mixture."""
    import dataclasses

    sources = []
    for entry in data.dataset_mixture or []:
        columns = {f"{canonical}_column": column for canonical, column in (entry.get("columns") or {}).items()}
        source = dataclasses.replace(data, dataset_name=entry.get("name") or entry.get("path"),
                                     dataset_config=entry.get("config"), dataset_split=entry.get("split", "train"),
                                     dataset_mixture=None, **columns)
        sources.append((source, float(entry.get("weight", entry.get("fraction", 1.0)))))
    return sources


def source_names(data: DataArguments) -> list[str]:
    """The names the data comes from as the user wrote them: --dataset_name, or each source of a mixture."""
    return [source.dataset_name for source, _ in mixture_sources(data)] or [data.dataset_name]


def source_location(data: DataArguments, stage: str) -> str:
    """Where the data comes from: the embedded default resolves to its shipped directory for the stage (a reward
    model learns from the DPO stage's preference pairs)."""
    if data.dataset_name == EMBEDDED:  # KTO converts the default's pairs (_prepare_source)
        from src.embedded.generate import data_dir

        return str(data_dir(data.embedded_reasoning) / (objective(stage).embedded_data if stage in OBJECTIVES
                                                        else stage))
    return data.dataset_name


UTF8_BOM = b"\xef\xbb\xbf"  # what Windows tools and spreadsheet exports put before UTF-8 text; datasets skips it
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}.*$")  # train-00000-of-00004(-<hash>): one shard of a split (the Hub's names)
SUPPORTED_FILES = (".json, .jsonl, .parquet or .csv (or .ndjson, .tsv, .arrow), the text ones also compressed (" +
                   ", ".join(DATA_FILE_COMPRESSIONS) + ")")


def _data_file_error(location: str, path: Path) -> DataError | None:
    """Why a data file cannot be read at all (its type, a decompressor not installed), or None."""
    kind = data_file_kind(path)
    if kind is None:
        return DataError(f"--dataset_name {location}: unsupported file type; use {SUPPORTED_FILES}")
    module = DATA_FILE_COMPRESSIONS.get(kind[1])
    if module:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            return DataError(f"--dataset_name {location}: a {kind[1]} file needs the {module} package, as datasets "
                             f"does: pip install {module} (or decompress it)")
    return None


def _open_data_file(path: Path):
    """A data file as a binary stream of its (decompressed) bytes."""
    import io

    compression = data_file_kind(path)[1]
    if compression in (".gz", ".gzip"):
        import gzip
        return gzip.open(path, "rb")
    if compression == ".bz2":
        import bz2
        return bz2.open(path, "rb")
    if compression == ".xz":
        import lzma
        return lzma.open(path, "rb")
    if compression in (".zst", ".zstd"):
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True,
                                                                                 closefd=True))
    if compression == ".lz4":
        import lz4.frame
        return lz4.frame.open(path, "rb")
    return open(path, "rb")


def _first_columns(path: Path) -> list[str] | None:
    """A local data file's column names from its first row or schema, without loading it: every kind `data_file_kind`
    reads (compressed, with a byte-order mark, JSON Lines under a .json name). None where that is not cheap (a JSON
    array) or the file cannot be read (the preparation names why)."""
    kind = data_file_kind(path)
    if kind is None or _data_file_error(str(path), path) is not None:
        return None
    form = kind[0]
    if form == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if form == ".arrow":
        try:
            return list(_arrow_reader(path).schema.names)
        except Exception:  # not Arrow after all: datasets' reading of it says why (_load_files)
            return None
    try:
        with _open_data_file(path) as handle:
            if form in (".csv", ".tsv"):
                import csv
                import io

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


def source_columns(data: DataArguments, stage: str) -> list[str] | None:
    """The column names of a source's training rows, after the --*_column mapping: read from the first row of a file
    (or of a directory's train file), a save_to_disk directory's memory-mapped table, or a Hub dataset's card
    (`_hub_columns`). None where that is not known without loading the data (a JSON array) or the source cannot be
    read (a missing path, an unreachable Hub: the preparation names why)."""
    from src.hub_access import looks_like_hub_id

    name = source_location(data, stage)
    location = Path(name)
    if looks_like_hub_id(name):
        columns = _hub_columns(data, stage)
    elif location.is_dir():
        if (location / "dataset_dict.json").exists() or (location / "dataset_info.json").exists():
            loaded = load_source(data, stage)  # memory-mapped: no rows read
            columns = loaded[data.dataset_split].column_names if data.dataset_split in loaded else None
        else:
            files = _split_files(location)
            shards = files.get(data.dataset_split) or next(iter(files.values()), None)
            columns = _first_columns(Path(shards[0])) if shards else None
    else:
        columns = _first_columns(location) if location.is_file() else None
    return None if columns is None else columns_after_mapping(columns, data)


def _hub_columns(data: DataArguments, stage: str) -> list[str] | None:
    """A Hub dataset's column names: from the features its card lists (datasets.load_dataset_builder reads metadata,
    no rows), else from the dataset itself (the download the preparation then reuses from the Hugging Face cache).
    None where it cannot be loaded: the preparation says why in one line."""
    import datasets

    try:
        check_source(data, stage)  # a missing local data file is not looked for on the Hub
    except DataError:
        return None
    try:
        features = datasets.load_dataset_builder(source_location(data, stage), data.dataset_config).info.features
    except Exception:  # the Hub client raises many types; the loading below gives the reason where there is one
        features = None
    if features is not None:
        return list(features)
    try:
        loaded = load_source(data, stage)
    except DataError:
        return None
    split = loaded[data.dataset_split] if data.dataset_split in loaded else next(iter(loaded.values()), None)
    return split.column_names if split is not None else None


def holds_prompts_only(columns: list[str] | None) -> bool:
    """Prompts without answers: a `prompt` column (text or chat) and neither `chosen` nor `rejected`."""
    return bool(columns) and "prompt" in columns and not {"chosen", "rejected"} & set(columns)


def prompts_only(data: DataArguments) -> bool:
    """Whether the DPO stage's data is prompts alone (every source of a mixture: prompts, or none; a mix of the two is
    refused). Asked only with --rounds (a Hub dataset's columns may need its download: see source_columns)."""
    sources = [source for source, _ in mixture_sources(data)] or [data]
    found = [holds_prompts_only(source_columns(source, ROUNDS_STAGE)) for source in sources]
    if any(found) and not all(found):
        names = [source.dataset_name for source, prompts in zip(sources, found) if prompts]
        raise DataError(f"dataset_mixture: {', '.join(names)} hold prompts without answers and the other sources hold "
                        "preference pairs: mix sources of one kind (pairs for a DPO stage, prompts for rounds alone)")
    return all(found)


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
    import lzma
    import zlib

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
        except Exception:  # not Parquet after all: datasets' reading of it says why (_load_files)
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


def _names_a_split(name: str) -> bool:
    """Whether a file's split name is one of datasets' split keywords (train, validation, dev, test, eval, ...)."""
    from datasets.data_files import SPLIT_KEYWORDS

    return any(name == keyword for keywords in SPLIT_KEYWORDS.values() for keyword in keywords)


def _split_files(directory: Path) -> dict[str, list[str]]:
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


def check_source(data: DataArguments, stage: str) -> None:
    """The cheap checks on where the data comes from, before any model or tokenizer is fetched."""
    for source, _ in mixture_sources(data):
        check_source(source, stage)
    if data.dataset_mixture:
        return
    location = source_location(data, stage)
    path = Path(location)
    if path.is_file():
        error = _data_file_error(location, path)
        if error:
            raise error
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty: it needs one row per example")
    elif not path.is_dir() and (data_file_kind(path) or location.startswith((".", "/", "~"))
                                or location.count("/") > 1):
        raise DataError(f"--dataset_name {location}: no such file or directory")


def load_source(data: DataArguments, stage: str):
    """The raw data as a DatasetDict, from a file, a directory (save_to_disk or split files) or the Hub."""
    return _load_source(data, stage)[0]


def _load_source(data: DataArguments, stage: str):
    """(the raw DatasetDict, where its rows come from: {split: [(file, the split's row index of its first row)]},
    None where the rows are not read from files here: a save_to_disk directory, the Hub)."""
    import datasets

    check_source(data, stage)
    location = source_location(data, stage)
    path = Path(location)
    if path.is_file():
        return _load_files({"train": [location]}, location)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return (loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded}),
                    None)
        files = _split_files(path)
        if len(files) == 1 and data.dataset_split not in files and not _names_a_split(next(iter(files))):
            files = {data.dataset_split: next(iter(files.values()))}  # pairs.jsonl alone: the training rows, as datasets
        if not files:
            raise DataError(
                f"--dataset_name {location}: the directory holds neither a save_to_disk dataset nor data files "
                "(train.jsonl, validation.jsonl, data/train-00000-of-00001.parquet, ...)"
            )
        return _load_files(files, location)
    try:
        loaded = datasets.load_dataset(location, data.dataset_config)
    except Exception as error:  # the Hub client raises many types; the user needs the reason, not the type
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"--dataset_name {location}: could not load it from the Hugging Face Hub ({reason}); pass a local "
            "file or directory instead if this machine is offline"
        ) from None
    return loaded, None


def _load_files(files: dict[str, list[str]], location: str):
    """Data files by split → (DatasetDict, the files each split's rows come from), each file checked first."""
    import datasets

    for file in (file for found in files.values() for file in found):
        error = _data_file_error(location if Path(location).is_file() else file, Path(file))
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
    import bisect

    if not origins:
        return where, number
    index = bisect.bisect_right([start for _, start in origins], number - 1) - 1
    return origins[index][0], number - origins[index][1]


# --------------------------------------------------------------------------------------------------------------------
# Shapes: recognise the common layouts and bring them to TRL's
# --------------------------------------------------------------------------------------------------------------------


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "role" in item and "content" in item
                                           for item in value) and len(value) > 0


def _hh_to_messages(transcript: str) -> list[dict]:
    """Anthropic HH transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") → chat messages."""
    parts = _HH_TURN.split("\n\n" + transcript.lstrip("\n"))
    messages = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


# The --*_column flags: each maps a source column to its canonical name
COLUMN_FLAGS = (("prompt_column", "prompt"), ("chosen_column", "chosen"), ("rejected_column", "rejected"),
                ("messages_column", "messages"), ("completion_column", "completion"), ("text_column", "text"),
                ("label_column", "label"))


def _mapped_sources(data: DataArguments) -> set[str]:
    """The source columns a --*_column flag maps."""
    return {getattr(data, flag) for flag, _ in COLUMN_FLAGS if getattr(data, flag, None)}


def columns_after_mapping(columns: list[str], data: DataArguments) -> list[str]:
    """A source's column names as preparation sees them: the --meta_columns gathered into `meta`, the --*_column
    flags' renamed to their canonical names."""
    if data.meta_columns:
        kept = _mapped_sources(data)
        columns = [column for column in columns if column not in data.meta_columns or column in kept]
        columns += [] if "meta" in columns else ["meta"]
    renamed = {getattr(data, flag): canonical for flag, canonical in COLUMN_FLAGS if getattr(data, flag, None)}
    return [renamed.get(column, column) for column in columns]


def prompts_as_chats(raw, location: str):
    """--chat_prompts: each text prompt of prompts alone → a chat of one user message (the model's chat template then
    renders it, as for data that comes as chats); chat prompts stay as they are. Batched over Arrow."""
    columns = raw[next(iter(raw))].column_names
    if not holds_prompts_only(columns):
        raise DataError(f"--chat_prompts turns text prompts alone into chats, and {location} holds "
                        f"{', '.join(columns)}: drop the flag (chat data already renders through the template)")

    def as_chats(batch: dict) -> dict:
        return {"prompt": [[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                           for prompt in batch["prompt"]]}

    return raw.map(as_chats, batched=True, desc="prompts as chats")


def gather_meta(raw, data: DataArguments, location: str):
    """Each row's --meta_columns values gathered into its `meta` (a dict; a `meta` the data has keeps its keys, a
    gathered column of the same name wins), the gathered columns dropped unless a --*_column flag maps them too. One
    line naming the flag for a column the data does not have. Batched over Arrow, as every preparation step."""
    columns = raw[next(iter(raw))].column_names
    missing = [column for column in data.meta_columns if column not in columns]
    if missing:
        raise DataError(f"--meta_columns {' '.join(missing)}: no such column in {location}; the data has "
                        f"{', '.join(columns)}")
    dropped = [column for column in data.meta_columns if column not in _mapped_sources(data) and column != "meta"]

    def gather(batch: dict) -> dict:
        existing = batch.get("meta") or [None] * len(batch[columns[0]])
        return {"meta": [{**(meta if isinstance(meta, dict) else {}),
                          **{column: batch[column][index] for column in data.meta_columns}}
                         for index, meta in enumerate(existing)]}

    return raw.map(gather, batched=True, remove_columns=dropped, desc="gathering meta")


def apply_column_mapping(columns: list[str], data: DataArguments) -> dict[str, str]:
    """{source column: canonical name} from the --*_column flags, checked against what exists."""
    mapping = {}
    for flag, canonical in COLUMN_FLAGS:
        source = getattr(data, flag)
        if source is None or source == canonical:
            continue
        if source not in columns:
            raise DataError(f"--{flag} {source}: no such column; the data has {', '.join(columns)}")
        mapping[source] = canonical
    return mapping


def _shape(stage: str) -> str:
    """The data shape a preparation for `stage` makes: its objective's row's, PROMPTS, or a shape's own name."""
    return shape_of(stage) if stage in OBJECTIVES or stage == PROMPTS else stage


def detect_shape(columns: list[str], first_row: dict, stage: str) -> str:
    """Name the layout of the (column-mapped) data, or explain what is missing."""
    names = set(columns)
    kind = _shape(stage)
    row = OBJECTIVES.get(stage)
    if kind == PROMPTS:
        if row is not None and {"chosen", "rejected"} & names:  # an objective that trains on prompts (GRPO)
            raise DataError(f"--stage {stage} trains on prompts alone and samples its own answers, and the data holds "
                            f"{' and '.join(sorted({'chosen', 'rejected'} & names))} answers: give prompts (a 'prompt' "
                            "column, text or chat, and an optional 'meta' the judge reads), or train on the pairs with "
                            "a pair objective (--stage dpo)")
        if "prompt" in names:
            return PROMPTS
        raise DataError(f"prompts for on-policy rounds need a 'prompt' column (text or chat messages); the data has "
                        f"{', '.join(columns)}; map yours with --prompt_column")
    if kind == UNPAIRED:
        if {"prompt", "completion", "label"} <= names:
            return "unpaired"
        if {"chosen", "rejected"} <= names:
            return "kto_pairs"  # preference pairs; converted to unpaired rows only when asked (_prepare_source)
        missing = [name for name in ("prompt", "completion", "label") if name not in names]
        raise DataError(
            f"KTO data needs prompt, completion and label (thumbs up / down) columns: missing {', '.join(missing)}; "
            f"the data has {', '.join(columns)}; map yours with --prompt_column / --completion_column / "
            "--label_column (preference pairs: --kto_from_pairs)"
        )
    if kind in PAIRED_SHAPES:
        if row is not None and row.on_policy_rounds and holds_prompts_only(columns) and names <= {"prompt", "meta", "tools"}:
            raise DataError(
                "the data holds prompts without chosen and rejected answers: prompts alone train by on-policy rounds "
                "(--rounds N with a --judge that scores answers, e.g. --judge module:function), or give preference "
                "pairs (add chosen and rejected columns)")
        if row is not None and not row.causal_lm and holds_prompts_only(columns):
            raise DataError("a reward model learns from preference pairs, and the data holds prompts without chosen "
                            "and rejected answers: give pairs, or train the policy from these prompts with --stage "
                            "dpo --rounds N and a --judge")
        if {"conversations", "chosen", "rejected"} <= names:
            return "sharegpt_pairs"  # LLaMA-Factory's ShareGPT ranking data: the turns so far, then one answer each
        if {"prompt", "chosen", "rejected"} <= names:
            if _is_chat(first_row["chosen"]) and isinstance(first_row["prompt"], str):
                return "ultrafeedback"  # the prompt column is a text copy of the user turn inside chosen/rejected
            return "explicit_prompt"
        if {"question", "chosen", "rejected"} <= names:
            return "orca"
        if {"chosen", "rejected"} <= names:
            if isinstance(first_row["chosen"], str) and "\n\nHuman: " in "\n\n" + first_row["chosen"].lstrip("\n"):
                return "anthropic_hh"
            return "implicit_prompt"
        missing = [name for name in ("prompt", "chosen", "rejected") if name not in names]
        rounds = "; or, for prompts alone, on-policy rounds: --rounds N and a --judge" if row is not None and \
            row.on_policy_rounds and \
            "prompt" in names else ""
        raise DataError(
            f"preference data needs chosen and rejected answers (and a prompt, explicit or shared): missing "
            f"{', '.join(missing)}; the data has {', '.join(columns)}; map yours with --prompt_column / "
            f"--chosen_column / --rejected_column{rounds}"
        )
    if holds_prompts_only(columns) and "completion" not in names:
        raise DataError("SFT needs answers to learn from, and the data holds prompts alone: with --stage sft_then_dpo "
                        "and prompts for the rounds, give the SFT data in the recipe's sft: block (sft: {dataset_name: "
                        "...}) or as --sft.dataset_name")
    if "messages" in names:
        return "messages"
    if "conversations" in names:
        return "sharegpt"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "text" in names:
        return "text"
    if {"chosen", "rejected"} <= names or {"question", "chosen", "rejected"} <= names:
        return "preference"  # SFT on the preferred answers
    raise DataError(
        f"SFT data needs a 'messages' chat, 'prompt' + 'completion', or 'text' column; the data has "
        f"{', '.join(columns)}; map yours with --messages_column, --prompt_column/--completion_column or --text_column"
    )


def chat_roles(tokenizer) -> list[str]:
    """The message roles a run accepts: TRL's, and any other role the tokenizer's chat template compares with."""
    text = template_source(tokenizer)
    named = {first or second for first, second in _TEMPLATE_ROLE.findall(text)}
    for group in _TEMPLATE_ROLE_LIST.findall(text):
        named |= set(re.findall(r"""['"](\w+)['"]""", group))
    return list(CHAT_ROLES) + sorted(named - set(CHAT_ROLES))


def renders_content_parts(tokenizer) -> bool:
    """Whether the chat template reads message content given as a list of parts ([{"type": "text", "text": ...}]), as
    multimodal templates do; a text-only template prints such a list as its Python repr."""
    return bool(_TEMPLATE_PARTS.search(template_source(tokenizer)))


def check_chat_messages(raw, columns: dict[str, str], tokenizer, location: str, origins: dict | None = None) -> None:
    """Every message of the chat columns ({column: the name the user gave it}) has a role the template knows and
    content it can render. A role no template branch handles ("robot", a typo like "assitant") renders as if it were
    valid, or not at all, and content given as a list of parts reaches a text-only template as a Python repr: either
    way the run trains to the end on it. Checked on the source's Arrow columns before any row is normalized (no row
    reaches Python): the row named is the source file's (`origins`: _load_source's)."""
    import difflib

    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Value

    roles = chat_roles(tokenizer)
    known, parts_rendered = pa.array(roles), renders_content_parts(tokenizer)
    for split, dataset in raw.items():
        where = location if len(raw) == 1 else f"{location} ({split})"
        for column, name in columns.items():
            kind = dataset.features.get(column)
            if not (hasattr(kind, "feature") and isinstance(kind.feature, dict) and "role" in kind.feature):
                continue  # text, or a chat column shaped otherwise (check_row names those)
            parts = not parts_rendered and not isinstance(kind.feature.get("content"), Value)
            offset = 0
            for chunk in dataset.data.column(column).chunks:
                flat = pc.list_flatten(chunk)
                parents = pc.list_parent_indices(chunk)
                unknown = pc.index(pc.invert(pc.is_in(pc.struct_field(flat, "role"), value_set=known)), True).as_py()
                if unknown >= 0:
                    row = parents[unknown].as_py()
                    message = unknown - pc.index(parents, row).as_py() + 1
                    role = pc.struct_field(flat, "role")[unknown].as_py()
                    close = difflib.get_close_matches(str(role), roles, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    file, number = row_origin((origins or {}).get(split), where, offset + row + 1)
                    raise DataError(
                        f"{file} row {number}: '{name}' message {message} has role {role!r}{hint}; the "
                        f"model's chat template and TRL know {', '.join(roles)}: fix the role in the data"
                    )
                listed = pc.index(pc.is_valid(pc.struct_field(flat, "content")), True).as_py() if parts else -1
                if listed >= 0:
                    row = parents[listed].as_py()
                    message = listed - pc.index(parents, row).as_py() + 1
                    file, number = row_origin((origins or {}).get(split), where, offset + row + 1)
                    raise DataError(
                        f"{file} row {number}: '{name}' message {message} has its content as a list of "
                        "parts, which the model's chat template prints as a Python list: write each message's content "
                        "as text"
                    )
                offset += len(chunk)


def _sharegpt_messages(turns, column: str) -> list[dict]:
    """ShareGPT turns ({from, value}; one turn alone as in LLaMA-Factory's ranking data's chosen / rejected) → chat
    messages with the roles chat templates know (SHAREGPT_ROLES)."""
    from trl.data_utils import maybe_convert_to_chatml

    turns = [turns] if isinstance(turns, dict) else turns
    messages = maybe_convert_to_chatml({"conversations": turns})["messages"]
    for message in messages:
        if message.get("role") not in SHAREGPT_ROLES:
            raise DataError(f"'{column}' has a turn from {message.get('role')!r}: the known speakers are "
                            f"{', '.join(SHAREGPT_ROLES)}; rename it in the data")
        message["role"] = SHAREGPT_ROLES[message["role"]]
    return messages


def normalize_row(row: dict, shape: str, system_prompt: str | None, has_chat_template: bool = True) -> dict:
    """One row of a recognised shape → TRL's standard or conversational columns (plus `meta`/`tools` if present).

    Transcript shapes (Anthropic HH, orca) become chats when the tokenizer has a chat template to render them, and
    stay text otherwise, so base models without a template can still train on them."""
    from trl.data_utils import extract_prompt

    extra = {key: row[key] for key in ("meta", "tools") if key in row}
    if shape == "explicit_prompt":
        out = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    elif shape in ("ultrafeedback", "implicit_prompt"):
        out = dict(extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]}))
    elif shape == "anthropic_hh" and has_chat_template:
        out = dict(extract_prompt({"chosen": _hh_to_messages(row["chosen"]),
                                   "rejected": _hh_to_messages(row["rejected"])}))
    elif shape == "anthropic_hh":
        out = dict(extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]}))
    elif shape == "orca" and has_chat_template:
        prompt = [{"role": "user", "content": row["question"]}]
        if row.get("system"):
            prompt.insert(0, {"role": "system", "content": row["system"]})
        out = {"prompt": prompt, "chosen": [{"role": "assistant", "content": row["chosen"]}],
               "rejected": [{"role": "assistant", "content": row["rejected"]}]}
    elif shape == "orca":
        system = f"{row['system']}\n\n" if row.get("system") else ""
        out = {"prompt": f"{system}{row['question']}\n\n", "chosen": row["chosen"], "rejected": row["rejected"]}
    elif shape == PROMPTS:
        out = {"prompt": row["prompt"]}
    elif shape == "messages":
        out = {"messages": row["messages"]}
    elif shape == "sharegpt":
        out = {"messages": _sharegpt_messages(row["conversations"], "conversations")}
    elif shape == "sharegpt_pairs":  # `chosen` / `rejected`: one {from, value} message each (or a list of them)
        out = {"prompt": _sharegpt_messages(row["conversations"], "conversations"),
               "chosen": _sharegpt_messages(row["chosen"], "chosen"),
               "rejected": _sharegpt_messages(row["rejected"], "rejected")}
    elif shape == "prompt_completion":
        out = {"prompt": row["prompt"], "completion": row["completion"]}
        if "label" in row:  # thumbs-up / down rows (the SFT stage of sft_then_kto keeps the thumbs-up ones)
            out["label"] = parse_label(row["label"])
    elif shape == "text":
        out = {"text": row["text"]}
    elif shape == "preference":
        pair = normalize_row(row, detect_shape(list(row), row, PAIRS), system_prompt, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"]}
    elif shape == "unpaired":
        out = {"prompt": row["prompt"], "completion": row["completion"], "label": parse_label(row["label"])}
    elif shape == "kto_pairs":  # the pair, normalised; _prepare_batch makes its two unpaired rows
        out = normalize_row(row, detect_shape(list(row), row, PAIRS), None, has_chat_template)
    else:
        raise ValueError(f"unknown shape {shape}")
    if system_prompt:
        for key in ("prompt", "messages"):
            if _is_chat(out.get(key)) and out[key][0]["role"] != "system":
                out[key] = [{"role": "system", "content": system_prompt}] + out[key]
    return out | extra


# --------------------------------------------------------------------------------------------------------------------
# Checks on rows: each problem names the row and column
# --------------------------------------------------------------------------------------------------------------------


def parse_label(value: Any) -> bool:
    """A thumbs-up / thumbs-down value → True (desirable) / False; anything else is refused (the caller names the row)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        for label, words in LABEL_WORDS.items():
            if word in words:
                return label
    raise DataError(f"'label' is {value!r}, not a thumbs up / down: use true/false, 1/0 or a word like up/down, "
                    "👍/👎, good/bad (KTO learns from two classes only; a score or rating needs thresholding first)")


def unpaired_rows(pair: dict) -> list[dict]:
    """A normalised preference pair as KTO's two unpaired rows: the chosen answer desirable, the rejected one not."""
    extra = {key: pair[key] for key in ("meta", "tools") if key in pair}
    return [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen", **extra}
            for side in ("chosen", "rejected")]


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if _is_chat(value):
        return "".join(str(message["content"] or "") for message in value)
    return ""


def _says_something(value: Any) -> bool:
    """Text, or a chat with some content, reasoning or tool call (an answer that only calls a tool is not empty)."""
    if _text_of(value).strip():
        return True
    return _is_chat(value) and any(message.get("tool_calls") or split_reasoning(message).reasoning
                                   for message in value)


KEPT, EMPTY, IDENTICAL, TOO_LONG, UNDESIRABLE = 0, 1, 2, 3, 4  # a row's fate, stored per row while preparing (int8)


def _answer_columns(row: dict, stage: str = "") -> tuple[str, ...]:
    if _shape(stage) == PROMPTS:
        return ()  # nothing answers yet: the rounds sample the answers
    return ("chosen", "rejected") if "chosen" in row else (
        ("completion",) if "completion" in row else ("messages",) if "messages" in row else ("text",))


def check_row(row: dict, number: int, stage: str, source: str) -> int:
    """Refuse a malformed row (wrong types) naming its number; say whether it carries a training signal (KEPT) or is
    dropped for an empty answer or chosen == rejected."""
    answer_columns = _answer_columns(row, stage)
    for column in ("prompt",) + answer_columns:
        if column not in row or row[column] is None:
            if column == "prompt" and column not in row and _shape(stage) != PROMPTS:
                continue
            raise DataError(f"{source} row {number}: '{column}' is missing; fill it in or remove the row")
        value = row[column]
        if not isinstance(value, str) and not _is_chat(value):
            raise DataError(
                f"{source} row {number}: '{column}' must be text or a list of {{role, content}} messages, "
                f"got {type(value).__name__}"
            )
    paired = _shape(stage) in PAIRED_SHAPES
    if paired and isinstance(row["chosen"], str) != isinstance(row["rejected"], str):
        raise DataError(f"{source} row {number}: 'chosen' and 'rejected' must both be text or both messages")
    for column in answer_columns:
        messages = row[column] if _is_chat(row[column]) else [{"role": "assistant", "content": row[column]}]
        if any(message.get("role") == "assistant" and not split_reasoning(message).closed for message in messages):
            raise DataError(f"{source} row {number}: '{column}' opens {THINK_OPEN} and never closes it (an answer cut "
                            f"inside its reasoning: no final answer to train); close it with {THINK_CLOSE} and the "
                            "answer, or remove the row")
    if any(not _says_something(row[column]) for column in answer_columns or ("prompt",)):
        return EMPTY  # an empty answer, or (prompts alone) an empty prompt
    if paired and row["chosen"] == row["rejected"]:
        return IDENTICAL
    return KEPT


# --------------------------------------------------------------------------------------------------------------------
# Tokenization (mirrors TRL 1.16's DPOTrainer / SFTTrainer / RewardTrainer preparation)
# --------------------------------------------------------------------------------------------------------------------


def _template_kwargs(row: dict, configured: dict | None = None) -> dict:
    """What the chat template is called with for a row: --chat_template_kwargs (e.g. Qwen3's enable_thinking), and
    the row's tool schemas."""
    return {**(configured or {}), **tools_argument(row)}


def tokenize_preference(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """prompt_ids / chosen_ids / rejected_ids: for chats, the prompt as generation starts from it and each answer as
    the model writes it from there (src/chat_templates.py; TRL's ids wherever the template does not rewrite the
    answer); for text, as TRL's DPOTrainer builds them (EOS appended, the completion where the two diverge)."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    if is_conversational(row):
        prompt_ids, chosen_ids, rejected_ids = conversation_ids(
            tokenizer, row["prompt"], row["chosen"], row["rejected"], keep_reasoning=keep_reasoning,
            **_template_kwargs(row, template_kwargs))
        return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    eos = tokenizer.eos_token
    chosen = row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos
    rejected = row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos
    prompt_ids = _tokenize(tokenizer, row["prompt"])["input_ids"]
    chosen_full = _tokenize(tokenizer, row["prompt"] + chosen)["input_ids"]
    rejected_full = _tokenize(tokenizer, row["prompt"] + rejected)["input_ids"]
    # The completion starts where prompt and prompt+completion diverge (a text prompt's last word may merge with the
    # answer's first).
    prompt_length = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return {
        "prompt_ids": prompt_ids[:prompt_length],
        "chosen_ids": chosen_full[prompt_length:],
        "rejected_ids": rejected_full[prompt_length:],
    }


def tokenize_unpaired(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """prompt_ids / completion_ids: a chat's as generation sees them (src/chat_templates.py); text as TRL's
    KTOTrainer builds them (EOS appended, the completion where prompt and prompt+completion diverge)."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    if is_conversational(row):
        prompt_ids, completion_ids = conversation_ids(tokenizer, row["prompt"], row["completion"],
                                                      keep_reasoning=keep_reasoning,
                                                      **_template_kwargs(row, template_kwargs))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    eos = tokenizer.eos_token
    completion = row["completion"] if row["completion"].endswith(eos) else row["completion"] + eos
    prompt_ids = _tokenize(tokenizer, row["prompt"])["input_ids"]
    full = _tokenize(tokenizer, row["prompt"] + completion)["input_ids"]
    prompt_length = common_prefix_length(prompt_ids, full)
    return {"prompt_ids": prompt_ids[:prompt_length], "completion_ids": full[prompt_length:]}


def tokenize_reward(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """chosen_ids / rejected_ids (whole sequences: prompt and answer), the DPO pair's ids joined: what the reward
    model scores is the prompt as generation starts from it followed by the answer as generated."""
    return reward_ids(tokenize_preference(row, tokenizer, keep_reasoning, template_kwargs))


def reward_ids(pair: dict) -> dict:
    """A DPO pair's ids (tokenize_preference) joined into the reward model's two whole sequences."""
    return {"chosen_ids": pair["prompt_ids"] + pair["chosen_ids"],
            "rejected_ids": pair["prompt_ids"] + pair["rejected_ids"]}


def sft_chat_template(tokenizer, sft: SFTArguments) -> str | None:
    """The template TRL's SFTTrainer tokenizes with: its training template when assistant-only loss needs
    generation markers the model's own template lacks."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if sft.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        return get_training_chat_template(tokenizer)
    return None


def tokenize_sft(row: dict, tokenizer, assistant_only_loss: bool, chat_template: str | None,
                 keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """input_ids (+ completion_mask / assistant_masks). A chat's answer is the one generation writes
    (src/chat_templates.py): TRL's SFTTrainer ids (and its assistant masks) where the template renders the answer
    as written; where it rewrites the last assistant turn, the prompt as generation starts from it and that turn as
    generated (earlier turns stay as the prompt renders them, as generation sees them)."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    kwargs = {"chat_template": chat_template, **_template_kwargs(row, template_kwargs)}
    eos = tokenizer.eos_token
    if is_conversational(row):
        if "prompt" in row:
            prompt, answer = row["prompt"], row["completion"]
        else:
            assistant = [i for i, message in enumerate(row["messages"]) if message["role"] == "assistant"]
            if not assistant:  # nothing the model answers: the chat trains as the template renders it
                full = _tokenize(tokenizer, row["messages"], return_assistant_tokens_mask=assistant_only_loss, **kwargs)
                return {key: full[key] for key in ("input_ids", "assistant_masks") if key in full}
            prompt, answer = row["messages"][:assistant[-1]], row["messages"][assistant[-1]:]
        prompt_ids, answer_ids = conversation_ids(tokenizer, prompt, answer, keep_reasoning=keep_reasoning, **kwargs)
        input_ids = prompt_ids + answer_ids
        output = {"input_ids": input_ids}
        if "prompt" in row:
            output["completion_mask"] = [0] * len(prompt_ids) + [1] * len(answer_ids)
        if assistant_only_loss:
            # TRL's masks (the template's generation blocks) where its rendering of the chat is this very sequence;
            # where the template rewrote the answer, the answer's tokens are the assistant's.
            full = _tokenize(tokenizer, prompt + answer, return_assistant_tokens_mask=True, **kwargs)
            output["assistant_masks"] = (full["assistant_masks"] if full["input_ids"] == input_ids
                                         and "assistant_masks" in full else
                                         [0] * len(prompt_ids) + [1] * len(answer_ids))
        return output
    if "prompt" in row:
        completion = row["completion"] if row["completion"].endswith(eos) else row["completion"] + eos
        prompt_ids = _tokenize(tokenizer, row["prompt"], chat_template=chat_template)["input_ids"]
        full = _tokenize(tokenizer, row["prompt"] + completion, chat_template=chat_template)
        prompt_length = common_prefix_length(prompt_ids, full["input_ids"])
        return {"input_ids": full["input_ids"],
                "completion_mask": [0] * prompt_length + [1] * (len(full["input_ids"]) - prompt_length)}
    text = row["text"] if row["text"].endswith(eos) else row["text"] + eos
    return {"input_ids": _tokenize(tokenizer, text, chat_template=chat_template)["input_ids"]}


def sample_fields(row: dict, tokenizer, template_kwargs: dict | None = None) -> dict:
    """What the sample outputs need for a held-out row: the prompt as the model sees it and the dataset's answer."""
    from trl.data_utils import is_conversational

    if "chosen" in row:
        prompt, reference, rejected = row["prompt"], row["chosen"], row["rejected"]
    elif "completion" in row and row.get("label") is False:  # a thumbs-down row: its answer is the one to avoid
        prompt, reference, rejected = row["prompt"], "", row["completion"]
    elif "completion" in row:
        prompt, reference, rejected = row["prompt"], row["completion"], None
    elif "prompt" in row and "messages" not in row:  # prompts alone (rounds from prompts): no answer to show
        prompt, reference, rejected = row["prompt"], None, None
    elif "messages" in row and any(message["role"] == "assistant" for message in row["messages"]):
        last_assistant = max(i for i, message in enumerate(row["messages"]) if message["role"] == "assistant")
        prompt, reference, rejected = row["messages"][:last_assistant], row["messages"][last_assistant:], None
    elif "messages" in row:  # a chat with no assistant turn trains as text; nothing to answer
        return {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": _text_of(row["messages"]),
                "sample_rejected": None, "judge_prompt": None}
    else:
        return {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": _text_of(row["text"]),
                "sample_rejected": None, "judge_prompt": ""}
    if is_conversational({"prompt": prompt}):
        rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                 **_template_kwargs(row, template_kwargs))
    else:
        rendered = prompt
    prompt_ids = tokenizer(rendered, add_special_tokens=not is_conversational({"prompt": prompt}))["input_ids"]
    return {
        "sample_prompt": rendered,
        "sample_prompt_ids": prompt_ids,
        "sample_chosen": None if reference is None else _text_of(reference),
        "sample_rejected": None if rejected is None else _text_of(rejected),
        # The prompt as the data has it (messages or text): a judge renders it with its own tokenizer, the way a
        # reward model trained on this kind of data saw it (src/judges.py).
        "judge_prompt": prompt,
    }


# --------------------------------------------------------------------------------------------------------------------
# Splits and the prepared, cached result
# --------------------------------------------------------------------------------------------------------------------


def _find_split(names: list[str], train_split: str, kind: str) -> str | None:
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
    import random

    import numpy as np

    names = list(raw.keys())
    if data.dataset_split not in names:
        raise DataError(f"--dataset_split {data.dataset_split}: no such split; the data has {', '.join(names)}")
    splits = {"train": raw[data.dataset_split]}
    for kind in ("validation", "test"):
        found = _find_split(names, data.dataset_split, kind)
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


def source_files(location: str) -> list[Path] | None:
    """The files of a local source (a file, or every file under a directory, sorted); None for a Hub id."""
    path = Path(location)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(item for item in path.rglob("*") if item.is_file())
    return None


def source_fingerprint(location: str) -> list:
    """Identity of the source files (path, size, modification time) without reading them."""
    files = source_files(location)
    if files is None:
        return [location]  # a Hub id: keyed by name (and config)
    return [(str(item.resolve()), item.stat().st_size, item.stat().st_mtime_ns) for item in files]


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token,
                        type(tokenizer).__name__], default=str)
    return hashlib.sha256((state + extra).encode()).hexdigest()[:16]


def prepared_key(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer) -> str:
    parts = {
        "format": PREPARED_FORMAT,
        "stage": stage,
        "source": source_fingerprint(source_location(data, stage)) if not data.dataset_mixture else
        [source_fingerprint(source_location(source, stage)) for source, _ in mixture_sources(data)],
        "mixture": data.dataset_mixture,
        "data": {key: getattr(data, key) for key in ("dataset_config", "dataset_split", "prompt_column",
                                                   "chosen_column", "rejected_column", "messages_column",
                                                   "completion_column", "text_column", "meta_columns",
                                                   "system_prompt", "chat_prompts", "val_size",
                                                   "test_size", "max_train_samples", "max_length",
                                                   "label_column", "kto_from_pairs", "reasoning",
                                                   "chat_template_kwargs")},
        "kl_partners": KL_PARTNERS if _shape(stage) == UNPAIRED else None,
        "assistant_only_loss": sft.assistant_only_loss if _shape(stage) == SEQUENCES else None,
        "seed": seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------------
# Streaming preparation: batched `datasets.map` over memory-mapped Arrow, token ids as int32 columns
# --------------------------------------------------------------------------------------------------------------------

CHUNK_ROWS_PER_PROCESS = 4096  # rows a process tokenizes between two progress updates
MIN_ROWS_PER_PROCESS = 1000  # below this a worker process costs more to start than it saves
MAP_BATCH_ROWS = 256  # rows per batch of the map function and per Arrow write: peak memory follows this


def _normalized_features(features, shape: str, has_chat_template: bool, pair_shape: str | None = None) -> dict:
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
        pair = _normalized_features(features, pair_shape, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"]}
    elif shape == "unpaired":
        out = {"prompt": features["prompt"], "completion": features["completion"], "label": Value("bool")}
    elif shape == "kto_pairs":
        pair = _normalized_features(features, pair_shape, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"], "label": Value("bool")}
    else:
        raise ValueError(f"unknown shape {shape}")
    if "meta" in features:
        out["meta"] = features["meta"]
    if "tools" in features:
        out["tools"] = text  # _serializable: JSON text
    return out


def _sharegpt_features(feature):
    """The Arrow type of _sharegpt_messages' output: the turns' struct with `from` / `value` renamed; a single turn
    (a struct, not a list of them) becomes a list of one."""
    from datasets import List

    message = dict(feature.feature) if hasattr(feature, "feature") else dict(feature)
    renamed = {{"from": "role", "value": "content"}.get(key, key): value for key, value in message.items()}
    return type(feature)(renamed) if hasattr(feature, "feature") else List(renamed)


def _output_features(normalized: dict, token_columns: list[str], held_out: bool):
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


def _prepare_batch(batch: dict, *, shape: str, stage: str, location: str, source: str, rows_in: str, tokenizer,
                   data: DataArguments, sft: SFTArguments, chat_template: str | None,
                   has_chat_template: bool, held_out: bool, output_columns: list[str],
                   origins: list | None = None) -> dict:
    """normalize → check → tokenize → keep-or-drop of one batch of source rows (datasets.map, batched).

    Dropped rows stay in the batch with their reason in `_status` (so the counts and the first dropped row numbers
    come out of one pass) and are filtered out afterwards. A bad row is named by its number in `rows_in`, the source
    it was read from (SOURCE_ROW), not by its place in a carved split: in a split of several files, the file and its
    row (`origins`)."""
    source_rows = batch.pop(SOURCE_ROW)
    columns = list(batch)
    out = {column: [] for column in output_columns}
    for values, source_row in zip(zip(*(batch[column] for column in columns)), source_rows):
        where, number = row_origin(origins, rows_in, source_row + 1)
        try:
            normalized = normalize_row(dict(zip(columns, values)), shape, data.system_prompt, has_chat_template)
        except DataError as error:
            raise DataError(f"{where} row {number}: {error}") from None
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
                         has_chat_template=has_chat_template, held_out=held_out, output_columns=output_columns)
    return out


def _prepare_row(row: dict, status: int | None, out: dict, number: int, source_row: int, *, stage: str,
                 location: str, where: str, tokenizer, data: DataArguments, sft: SFTArguments,
                 chat_template: str | None, has_chat_template: bool, held_out: bool, output_columns: list[str]) -> None:
    """One normalised row checked, tokenized and appended to `out` (a held-out row with its sample fields; a KTO pair's
    undesirable row is held out without them: each pair's prompt is answered once)."""
    row_status = check_row(row, number, stage, where)
    status = row_status if status is None or row_status != KEPT else status
    kind = _shape(stage)
    if kind == SEQUENCES and row.pop("label", True) is False:
        status = UNDESIRABLE  # SFT before KTO learns from the thumbs-up rows only
    if not has_chat_template and any(_is_chat(value) for value in row.values()):
        raise DataError(
            f"{location}: the data is a chat but the model's tokenizer has no chat template to "
            "render it; use a chat/instruct model, text data (prompt/chosen/rejected as strings), or give the "
            "model a template with --chat_template_path (a Jinja file or a tokenizer directory)"
        )
    item, ids, length = {}, {}, 0
    keep, kwargs = data.reasoning != "drop", data.chat_template_kwargs
    with _template_refusals(where, number, tokenizer):
        if status == KEPT:
            if kind == UNPAIRED:
                item = ids = tokenize_unpaired(row, tokenizer, keep, kwargs)
                length = len(item["prompt_ids"]) + len(item["completion_ids"])
                kept = len(item["prompt_ids"]) < data.max_length  # TRL's KTO rule, as for DPO
            elif kind == PAIRS:
                item = ids = tokenize_preference(row, tokenizer, keep, kwargs)
                length = len(item["prompt_ids"]) + max(len(item["chosen_ids"]), len(item["rejected_ids"]))
                # TRL's rule: a prompt that fills max_length leaves no completion token to learn from.
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
                item = ids = tokenize_sft(row, tokenizer, sft.assistant_only_loss, chat_template, keep, kwargs)
                length = len(item["input_ids"])
                kept = _has_trainable_token(item, data.max_length, sft)
            status = KEPT if kept else TOO_LONG
            if not keep and kind in PAIRED_SHAPES and ids["chosen_ids"] == ids["rejected_ids"]:
                status = IDENTICAL  # the answers differed only in their reasoning, which --reasoning drop removes
        record = {**_serializable(row), **item, "length": length, "_status": status,
                  **row_fields(row, ids, source_row, tokenizer)}
        if "sample_prompt" in output_columns:
            record.update(sample_fields(row, tokenizer, kwargs) if status == KEPT and held_out else
                          {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": "",
                           "sample_rejected": None, "judge_prompt": None})
    for column in output_columns:
        out[column].append(record.get(column, [] if column.endswith(("_ids", "_mask", "_masks")) else None))


@contextmanager
def _template_refusals(source: str, number: int, tokenizer=None):
    """A chat template that raises on a row (raise_exception("Conversation roles must alternate ..."), an undefined
    field): one line naming the row, not a Jinja traceback from inside the tokenizing map."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateCannotExpress as error:
        raise DataError(f"{source} row {number}: {template_label(tokenizer)}: {error}") from None
    except TemplateError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{source} row {number}: the chat template refused it ({reason}); fix the row or the "
                        "template (--chat_template_path)") from None


def _in_pool(batch: dict, *, _function, _starter: int, **kwargs) -> dict:
    """`_function` in a pool worker of datasets.map, which exits at once if the preparing process is gone (the pool's
    workers outlive a killed parent otherwise: src/run_safety/parent_watch.py)."""
    exit_with_parent(_starter)  # forked_children_exit_with_this_process watches it already where pools fork
    kill_starter_if_injected("preparation", starter=_starter)  # a test seam
    hang_watch.stall_if_planted("data_worker")  # a test seam: a worker that blocks
    return _function(batch, **kwargs)


def _map_with_progress(dataset, function, fn_kwargs: dict, features, label: str, num_proc: int, work: Path):
    """dataset.map(function) in chunks, each on up to `num_proc` processes, with one progress line between chunks.

    The chunks' Arrow files go to `work` (not datasets' global cache) and are concatenated without copying."""
    import datasets

    chunk_rows = CHUNK_ROWS_PER_PROCESS * num_proc
    if num_proc > 1:
        forked_children_exit_with_this_process()  # the pool's workers, idle ones too, end with this process
    # One chunk is a few seconds of work: data that fits in one needs no progress line.
    progress = Progress(label, total=len(dataset), enabled=len(dataset) > chunk_rows)
    pieces = []
    for number, start in enumerate(range(0, len(dataset), chunk_rows)):
        chunk = dataset.select(range(start, min(start + chunk_rows, len(dataset))))
        processes = min(num_proc, max(1, len(chunk) // MIN_ROWS_PER_PROCESS))
        hang_watch.beat(f"{label}: rows {start + 1:,}-{start + len(chunk):,} of {len(dataset):,}"
                        + (f" in {processes} pool workers" if processes > 1 else ""))
        pieces.append(chunk.map(
            _in_pool if processes > 1 else function,
            fn_kwargs=fn_kwargs | {"_function": function, "_starter": os.getpid()} if processes > 1 else fn_kwargs,
            batched=True, batch_size=MAP_BATCH_ROWS,
            writer_batch_size=MAP_BATCH_ROWS, remove_columns=chunk.column_names,
            features=features, num_proc=processes if processes > 1 else None,
            cache_file_name=str(work / f"{label.replace(' ', '_')}-{number:05d}.arrow"),
            new_fingerprint=f"{work.name}-{label}-{number}",  # no hashing of the tokenizer for every chunk
        ))
        if start + chunk_rows < len(dataset):
            progress.update(len(chunk))
        else:
            progress.done += len(chunk)  # counted, not shown: close() tells the last chunk, once
    progress.close()
    return datasets.concatenate_datasets(pieces)


def _counts(prepared, stage: str, source: str, max_length: int) -> dict:
    """Kept / dropped / truncated counts of a split from its `_status` and `length` columns (read as arrays, a few
    bytes a row), with the same refusals as before: nothing left after the checks, or after the length rule."""
    import numpy as np

    status = prepared.data.column("_status").to_numpy()
    lengths = prepared.data.column("length").to_numpy()
    empty, identical = np.flatnonzero(status == EMPTY), np.flatnonzero(status == IDENTICAL)
    label = prepared.data.column("label").to_numpy(zero_copy_only=False) if _shape(stage) == UNPAIRED else None
    checked, kept = (status == KEPT) | (status == TOO_LONG), status == KEPT
    if not checked.any():
        reason = "chosen identical to rejected" if len(identical) and not len(empty) else "an empty answer"
        raise DataError(f"{source}: every one of its {len(status)} rows has {reason}: nothing to learn from")
    if not kept.any():
        what = "pair is over" if _shape(stage) == SCORED_PAIRS else "prompt is at least"
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
            "dropped_too_long" if _shape(stage) == SCORED_PAIRS else "dropped_prompt_too_long": int((status == TOO_LONG).sum()),
            "truncated": int((kept & (lengths > max_length)).sum()), "longest_tokens": int(lengths[checked].max())}


def _build(target: Path, data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer) -> None:
    import shutil

    num_proc = data.dataset_num_proc or usable_cores()  # a container's CPU quota too
    if num_proc > 1:  # forked workers tokenize one text at a time: no thread pool to fight over, no warning
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = target / ".work"
    work.mkdir()
    summary = {"stage": stage, "max_length": data.max_length, "reasoning": data.reasoning}
    sources = mixture_sources(data)
    if not sources:
        location, shape, tokenized, counts = _prepare_source(data, sft, stage, seed, tokenizer, num_proc, work)
        for kind, dataset in tokenized.items():
            _write_kept([dataset], _prepared_columns(dataset), _split_file(target, kind))
            _write_source_rows(dataset, target, kind)
            if _shape(stage) == UNPAIRED:
                add_kl_completions(_split_file(target, kind), seed, kind, location)
        summary |= {"source": location, "shape": shape, "splits": counts,
                    "audit": _audit({kind: [dataset] for kind, dataset in tokenized.items()}, counts, stage,
                                    data.max_length, data.reasoning != "drop")}
    else:
        parts = []
        for number, (source, fraction) in enumerate(sources):
            location, shape, tokenized, counts = _prepare_source(source, sft, stage, seed, tokenizer, num_proc,
                                                                 work / str(number), fraction)
            parts.append((location, shape, fraction, tokenized, counts))
        summary |= _mix(parts, seed, target)
        if _shape(stage) == UNPAIRED:
            for kind in summary["splits"]:
                add_kl_completions(_split_file(target, kind), seed, kind, summary["source"])
        pieces = {}
        for _, _, _, tokenized, _ in parts:
            for kind, dataset in tokenized.items():
                pieces.setdefault(kind, []).append(dataset)
        summary["audit"] = _audit(pieces, summary["splits"], stage, data.max_length, data.reasoning != "drop")
    if _shape(stage) == UNPAIRED:
        check_kto_classes(summary["splits"]["train"], summary["source"])
    shutil.rmtree(work)
    (target / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def _prepare_source(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, num_proc: int,
                    work: Path, fraction: float = 1.0):
    """One source, recognised in its own shape and columns: (location, shape, tokenized splits, counts per split).

    The tokenized splits still hold the dropped rows, with their reason in `_status` (`_write_kept` leaves them out)."""
    import datasets
    import numpy as np

    location = source_location(data, stage)
    work.mkdir(parents=True, exist_ok=True)
    raw, origins = _load_source(data, stage)
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
    columns = raw[next(iter(raw))].column_names
    features = raw[next(iter(raw))].features
    first_row = raw[next(iter(raw))][0]
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
    # Each row carries its number in its source split, so an error names the row a user finds in the file, not its
    # place in the training split once the held-out rows are carved out.
    raw = datasets.DatasetDict({name: split.add_column(SOURCE_ROW, np.arange(len(split), dtype=np.int64))
                                for name, split in raw.items()})
    chat_template = sft_chat_template(tokenizer, sft) if _shape(stage) == SEQUENCES else None
    has_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pair_shape = detect_shape(columns, first_row, PAIRS) if shape in ("preference", "kto_pairs") else None
    normalized = _normalized_features(features, shape, has_chat_template, pair_shape)
    try:
        first = normalize_row(first_row, shape, data.system_prompt, has_chat_template)
    except DataError as error:
        raise DataError(f"{location} row 1: {error}") from None
    token_columns = list(_token_columns(first, stage, tokenizer, sft, chat_template))
    tokenized, counts = {}, {}
    # The source split each kind's rows come from: its own (validation, test), else carved from the training split.
    split_names = {kind: _find_split(list(raw), data.dataset_split, kind) or data.dataset_split
                   for kind in ("validation", "test")} | {"train": data.dataset_split}
    for kind, split in split_datasets(raw, data, seed).items():
        if kind == "train" and fraction < 1:
            split = _take_fraction(split, fraction, seed)
        held_out = kind != "train"
        output = _output_features(normalized, token_columns, held_out)
        kwargs = {"shape": shape, "stage": stage, "location": location, "source": f"{location} ({kind})",
                  "rows_in": location if len(raw) == 1 else f"{location} ({split_names[kind]})",
                  "origins": (origins or {}).get(split_names[kind]),
                  "tokenizer": tokenizer, "data": data, "sft": sft, "chat_template": chat_template,
                  "has_chat_template": has_chat_template, "held_out": held_out, "output_columns": list(output)}
        tokenized[kind] = _map_with_progress(split, _prepare_batch, kwargs, output, f"tokenizing {kind}", num_proc,
                                             work)
        counts[kind] = _counts(tokenized[kind], stage, kwargs["source"], data.max_length)
    return location, shape, tokenized, counts


def _prepared_columns(dataset) -> list[str]:
    """The tokenizing map's columns that the prepared files keep: not the row's fate nor the audit's columns."""
    return [column for column in dataset.column_names if not column.startswith("_")]


def _write_source_rows(dataset, target: Path, kind: str) -> None:
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


def _audit(pieces: dict[str, list], counts: dict, stage: str, max_length: int, reasoning_kept: bool = True) -> dict:
    """The data audit of every split (src/audit/pairs.py) from the tokenizing map's output, train first: a held-out
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


def _split_file(target: Path, kind: str, suffix: str = "") -> Path:
    return target / f"{kind}{suffix}.arrow"


def _write_kept(pieces: list, columns: list[str], path: Path) -> None:
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


def _take_fraction(split, fraction: float, seed: int):
    """`fraction` of a source's training rows, drawn with the seed (the rows keep their order in the source)."""
    import numpy as np

    count = max(1, int(round(fraction * len(split))))
    return split.select(np.sort(np.random.default_rng(seed).permutation(len(split))[:count]))


def _mix(parts: list, seed: int, target: Path) -> dict:
    """The sources' tokenized splits written as one per kind: concatenated (held-out splits carved per source, so each
    source is evaluated on its own rows), the training rows shuffled with the seed; the counts summed and kept per
    source (the summary's part)."""
    import datasets

    splits: dict[str, list] = {}
    for location, _, _, tokenized, _ in parts:
        for kind, dataset in tokenized.items():
            splits.setdefault(kind, []).append((location, dataset))
    for kind, pieces in splits.items():
        columns = sorted(set.intersection(*(set(_prepared_columns(dataset)) for _, dataset in pieces)))
        first_location, first = pieces[0]
        for location, dataset in pieces[1:]:
            different = [column for column in columns if dataset.features[column] != first.features[column]]
            if different:
                raise DataError(
                    f"dataset_mixture: {location} and {first_location} differ in the type of {', '.join(different)} "
                    "after normalisation (e.g. one is text and the other chat messages): mix sources of one kind"
                )
        _write_kept([dataset for _, dataset in pieces], columns, _split_file(target, kind))
        if kind == "train":
            # datasets' shuffle writes the permutation as an indices file next to the rows (none when it comes out
            # in order): the rows of the in-memory shuffle of the concatenation, without reading them again.
            datasets.Dataset.from_file(str(_split_file(target, kind))).shuffle(
                seed=seed, indices_cache_file_name=str(_split_file(target, kind, "-indices")))
    counts = {}
    for kind in splits:
        per_source = [part[4][kind] for part in parts if kind in part[4]]
        total = {key: sum(item[key] for item in per_source) for key in per_source[0]
                 if isinstance(per_source[0][key], int) and key != "longest_tokens"}
        total["longest_tokens"] = max(item["longest_tokens"] for item in per_source)
        # Row numbers count rows of one source: the summary names them per source.
        total["first_empty_rows"] = [f"{location}:{row}" for location, _, _, _, c in parts if kind in c
                                     for row in c[kind]["first_empty_rows"]][:5]
        total["first_identical_rows"] = [f"{location}:{row}" for location, _, _, _, c in parts if kind in c
                                         for row in c[kind]["first_identical_rows"]][:5]
        counts[kind] = total
    return {
        "source": " + ".join(part[0] for part in parts),
        "shape": "mixture",
        "splits": counts,
        "sources": [{"source": location, "shape": shape, "fraction": fraction,
                     "rows_taken": {kind: c[kind]["kept"] for kind in c}, "splits": c}
                    for location, shape, fraction, _, c in parts],
        "held_out": "carved per source",
    }


def _token_columns(first_row: dict, stage: str, tokenizer, sft: SFTArguments, chat_template: str | None):
    """The id and mask columns the stage's tokenization writes (SFT's depend on the data and the loss)."""
    kind = _shape(stage)
    if kind == PAIRS:
        return ("prompt_ids", "chosen_ids", "rejected_ids")
    if kind == PROMPTS:
        return ("prompt_ids",)
    if kind == UNPAIRED:
        return ("prompt_ids", "completion_ids")
    if kind == SCORED_PAIRS:
        return ("chosen_ids", "rejected_ids")
    if "prompt" in first_row:
        from trl.data_utils import is_conversational

        masks = ("assistant_masks",) if sft.assistant_only_loss and is_conversational(first_row) else ()
        return ("input_ids", "completion_mask") + masks
    if "messages" in first_row:
        return ("input_ids",) + (("assistant_masks",) if sft.assistant_only_loss else ())
    return ("input_ids",)


def _has_trainable_token(item: dict, max_length: int, sft: SFTArguments) -> bool:
    """Whether an SFT row keeps a token that contributes to the loss after truncation to max_length."""
    masks = [item[key] for key in ("completion_mask", "assistant_masks") if key in item]
    if "completion_mask" in item and sft.completion_only_loss is False:
        masks = [item[key] for key in ("assistant_masks",) if key in item]
    if not masks:
        return True
    return any(all(bits) for bits in zip(*(mask[:max_length] for mask in masks)))


def _serializable(row: dict) -> dict:
    """Chat columns go through JSON where their message dicts differ in keys (tool calls), which Arrow can't mix."""
    return {key: (json.dumps(value) if key == "tools" and not isinstance(value, str) else value)
            for key, value in row.items()}


def prepared_path(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, cache_dir: Path) -> Path:
    """Where the prepared data of these settings lives in the cache (complete once built: build_once's marker)."""
    return Path(cache_dir) / f"{stage}-{prepared_key(data, sft, stage, seed, tokenizer)}"


def prepare_data(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, cache_dir: Path) -> PreparedData:
    """Build (once per machine) or reuse the tokenized splits, and open them file-backed in this process."""
    import datasets

    path = prepared_path(data, sft, stage, seed, tokenizer, cache_dir)
    def build(temporary: Path) -> None:
        fail_write_if_injected(path)
        _build(temporary, data, sft, stage, seed, tokenizer)

    with hang_watch.phase("data", f"the {stage} data"):
        target = build_once(path, build)
    summary = json.loads((target / SUMMARY_FILE).read_text())
    splits = datasets.DatasetDict({kind: _open_split(target, kind) for kind in summary["splits"]})
    return PreparedData(path=target, splits=splits, summary=summary)


def _open_split(target: Path, kind: str):
    """A prepared split, memory-mapped (zero-copy), its types from the file's datasets metadata. Its fingerprint is
    its cache key, the same on every machine and in every run: TRL names its reference log-prob cache after it."""
    from datasets import Dataset
    from datasets.table import MemoryMappedTable

    indices = _split_file(target, kind, "-indices")
    return Dataset(MemoryMappedTable.from_file(str(_split_file(target, kind))),
                   indices_table=MemoryMappedTable.from_file(str(indices)) if indices.exists() else None,
                   fingerprint=f"{target.name}-{kind}")


def format_summary(summary: dict) -> str:
    """A few lines for rank 0: what was recognised and what was dropped or truncated, per split."""
    lines = [f"  data: {summary['source']} ({summary['shape']}, {summary['stage']})"]
    for source in summary.get("sources", []):
        taken = ", ".join(f"{kind} {rows}" for kind, rows in source["rows_taken"].items())
        lines.append(f"    {source['source']} ({source['shape']}, fraction {source['fraction']:g}): {taken} rows")
    for kind, counts in summary["splits"].items():
        notes = []
        if counts["empty_answers"]:
            empty = "prompt" if _shape(summary["stage"]) == PROMPTS else "answer"
            notes.append(f"{counts['empty_answers']} rows with an empty {empty} dropped (first: rows "
                         f"{counts['first_empty_rows']})")
        if counts["identical_pairs"]:
            by_drop = ((summary.get("audit") or {}).get(kind) or {}).get("identical_by_reasoning_drop")
            notes.append(f"{counts['identical_pairs']} pairs with chosen == rejected dropped"
                         + (f" ({by_drop} differ only in their reasoning, which --reasoning drop removes)"
                            if by_drop else "") + f" (first: rows {counts['first_identical_rows']})")
        if counts.get("dropped_prompt_too_long"):
            notes.append(f"{counts['dropped_prompt_too_long']} prompts of --max_length {summary['max_length']}+ "
                         "tokens dropped")
        if counts.get("dropped_too_long"):
            notes.append(f"{counts['dropped_too_long']} pairs over --max_length {summary['max_length']} tokens dropped")
        if counts["truncated"]:
            notes.append(f"{counts['truncated']} rows truncated to {summary['max_length']} tokens")
        suffix = f"; {'; '.join(notes)}" if notes else ""
        lines.append(f"  {kind:<10} {counts['kept']:>7} rows (longest {counts['longest_tokens']} tokens){suffix}")
    reasoning = reasoning_line(summary)
    return "\n".join(lines + ([reasoning] if reasoning else []))


def reasoning_line(summary: dict) -> str | None:
    """Which reasoning is trained and why, when the training answers reason: the flag in force, how many answers
    reason and how long."""
    train = (summary.get("audit") or {}).get("train") or {}
    side = next((side for side in ("chosen", "completion") if train.get(f"{side}_reasoning_share")), None)
    if side is None:
        return None
    share, tokens = train[f"{side}_reasoning_share"], train[f"{side}_reasoning_tokens"]["mean"]
    held = f"{share:.0%} of the {side} answers reason (mean {tokens:g} tokens)"
    if summary.get("reasoning") == "drop":
        return (f"  reasoning: dropped (--reasoning drop): {held}; the final answers alone are trained, after an empty "
                "reasoning block where the template writes one")
    return (f"  reasoning: kept (--reasoning keep, the default): {held}, trained as the model writes them after its "
            "generation prompt; --reasoning drop trains the final answers alone")
