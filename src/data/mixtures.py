"""--dataset_mixture: the sources of a mixture, each a DataArguments of its own, and their prepared splits mixed into
one (each source's fraction of rows taken with the run's seed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from src.config import DataArguments
from src.data.errors import DataError
from src.data.prepared import prepared_columns, split_file, write_kept


def mixture_sources(data: DataArguments) -> list[tuple[DataArguments, float]]:
    """--dataset_mixture as one DataArguments per source (its name, config, split and column mapping; the rest
    shared) and the fraction of its training rows to take. Empty without a mixture."""
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


def take_fraction(split, fraction: float, seed: int):
    """`fraction` of a source's training rows, drawn with the seed (the rows keep their order in the source)."""
    import numpy as np

    count = max(1, int(round(fraction * len(split))))
    return split.select(np.sort(np.random.default_rng(seed).permutation(len(split))[:count]))


def mix_sources(parts: list, seed: int, target: Path) -> dict:
    """The sources' tokenized splits written as one per kind: concatenated (held-out splits carved per source, so each
    source is evaluated on its own rows), the training rows shuffled with the seed; the counts summed and kept per
    source (the summary's part)."""
    import datasets

    splits: dict[str, list] = {}
    for location, _, _, tokenized, _ in parts:
        for kind, dataset in tokenized.items():
            splits.setdefault(kind, []).append((location, dataset))
    for kind, pieces in splits.items():
        columns = sorted(set.intersection(*(set(prepared_columns(dataset)) for _, dataset in pieces)))
        first_location, first = pieces[0]
        for location, dataset in pieces[1:]:
            different = [column for column in columns if dataset.features[column] != first.features[column]]
            if different:
                raise DataError(
                    f"dataset_mixture: {location} and {first_location} differ in the type of {', '.join(different)} "
                    "after normalisation (e.g. one is text and the other chat messages): mix sources of one kind"
                )
        write_kept([dataset for _, dataset in pieces], columns, split_file(target, kind))
        if kind == "train":
            # datasets' shuffle writes the permutation as an indices file next to the rows (none when it comes out
            # in order): the rows of the in-memory shuffle of the concatenation, without reading them again.
            datasets.Dataset.from_file(str(split_file(target, kind))).shuffle(
                seed=seed, indices_cache_file_name=str(split_file(target, kind, "-indices")))
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
