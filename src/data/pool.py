"""Tokenizing on --dataset_num_proc processes: `datasets.map` in chunks with a progress line between them, workers that
exit with their parent, and the batch sizes that bound peak memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from src.progress import Progress
from src.run_safety import hang_watch
from src.run_safety.parent_watch import (exit_with_parent, forked_children_exit_with_this_process,
                                         kill_starter_if_injected)


CHUNK_ROWS_PER_PROCESS = 4096  # rows a process tokenizes between two progress updates
MIN_ROWS_PER_PROCESS = 1000  # below this a worker process costs more to start than it saves
MAP_BATCH_ROWS = 256  # rows per batch of the map function and per Arrow write: peak memory follows this


def _in_pool(batch: dict, *, _function, _starter: int, **kwargs) -> dict:
    """`_function` in a pool worker of datasets.map, which exits at once if the preparing process is gone (the pool's
    workers outlive a killed parent otherwise: src/run_safety/parent_watch.py)."""
    exit_with_parent(_starter)  # forked_children_exit_with_this_process watches it already where pools fork
    kill_starter_if_injected("preparation", starter=_starter)  # a test seam
    hang_watch.stall_if_planted("data_worker")  # a test seam: a worker that blocks
    return _function(batch, **kwargs)


def map_with_progress(dataset, function, fn_kwargs: dict, features, label: str, num_proc: int, work: Path):
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
