"""Where the data comes from and what it holds before it is read whole: the embedded default's directory, a local path
or a Hub dataset (its columns probed, loaded with `datasets`), whether it is prompts alone, and the source files'
fingerprint for the prepared data's key.
"""

from __future__ import annotations

from pathlib import Path

from src.config import EMBEDDED, DataArguments
from src.data.errors import DataError
from src.data.files import data_file_error, first_columns, load_files, names_a_split, split_files
from src.data.mixtures import mixture_sources
from src.data.shapes import columns_after_mapping, holds_prompts_only
from src.data_file_kinds import data_file_kind, source_files
from src.embedded.generate import data_dir
from src.hub_access import looks_like_hub_id
from src.objectives import OBJECTIVES, ROUNDS_STAGE, objective


def source_location(data: DataArguments, stage: str) -> str:
    """Where the data comes from: the embedded default resolves to its shipped directory for the stage (a reward
    model learns from the DPO stage's preference pairs)."""
    if data.dataset_name == EMBEDDED:  # KTO converts the default's pairs (_prepare_source)
        return str(data_dir(data.embedded_reasoning) / (objective(stage).embedded_data if stage in OBJECTIVES
                                                        else stage))
    return data.dataset_name


def source_columns(data: DataArguments, stage: str) -> list[str] | None:
    """The column names of a source's training rows, after the --*_column mapping: read from the first row of a file
    (or of a directory's train file), a save_to_disk directory's memory-mapped table, or a Hub dataset's card
    (`_hub_columns`). None where that is not known without loading the data (a JSON array) or the source cannot be
    read (a missing path, an unreachable Hub: the preparation names why)."""
    name = source_location(data, stage)
    location = Path(name)
    if looks_like_hub_id(name):
        columns = _hub_columns(data, stage)
    elif location.is_dir():
        if (location / "dataset_dict.json").exists() or (location / "dataset_info.json").exists():
            loaded = load_source(data, stage)  # memory-mapped: no rows read
            columns = loaded[data.dataset_split].column_names if data.dataset_split in loaded else None
        else:
            files = split_files(location)
            shards = files.get(data.dataset_split) or next(iter(files.values()), None)
            columns = first_columns(Path(shards[0])) if shards else None
    else:
        columns = first_columns(location) if location.is_file() else None
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


def check_source(data: DataArguments, stage: str) -> None:
    """The cheap checks on where the data comes from, before any model or tokenizer is fetched."""
    for source, _ in mixture_sources(data):
        check_source(source, stage)
    if data.dataset_mixture:
        return
    location = source_location(data, stage)
    path = Path(location)
    if path.is_file():
        error = data_file_error(location, path)
        if error:
            raise error
        if path.stat().st_size == 0:
            raise DataError(f"{path} is empty: it needs one row per example")
    elif not path.is_dir() and (data_file_kind(path) or location.startswith((".", "/", "~"))
                                or location.count("/") > 1):
        raise DataError(f"--dataset_name {location}: no such file or directory")


def load_source(data: DataArguments, stage: str):
    """The raw data as a DatasetDict, from a file, a directory (save_to_disk or split files) or the Hub."""
    return load_source_with_origins(data, stage)[0]


def load_source_with_origins(data: DataArguments, stage: str):
    """(the raw DatasetDict, where its rows come from: {split: [(file, the split's row index of its first row)]},
    None where the rows are not read from files here: a save_to_disk directory, the Hub)."""
    import datasets

    check_source(data, stage)
    location = source_location(data, stage)
    path = Path(location)
    if path.is_file():
        return load_files({"train": [location]}, location)
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return (loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded}),
                    None)
        files = split_files(path)
        if len(files) == 1 and data.dataset_split not in files and not names_a_split(next(iter(files))):
            files = {data.dataset_split: next(iter(files.values()))}  # pairs.jsonl alone: the training rows, as datasets
        if not files:
            raise DataError(
                f"--dataset_name {location}: the directory holds neither a save_to_disk dataset nor data files "
                "(train.jsonl, validation.jsonl, data/train-00000-of-00001.parquet, ...)"
            )
        return load_files(files, location)
    try:
        loaded = datasets.load_dataset(location, data.dataset_config)
    except Exception as error:  # the Hub client raises many types; the user needs the reason, not the type
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"--dataset_name {location}: could not load it from the Hugging Face Hub ({reason}); pass a local "
            "file or directory instead if this machine is offline"
        ) from None
    return loaded, None


def source_fingerprint(location: str) -> list:
    """Identity of the source files (path, size, modification time) without reading them."""
    files = source_files(location)
    if files is None:
        return [location]  # a Hub id: keyed by name (and config)
    return [(str(item.resolve()), item.stat().st_size, item.stat().st_mtime_ns) for item in files]
