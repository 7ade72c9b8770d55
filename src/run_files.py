"""The files of a run directory, `results/<run_name>/`, and how they are written and read.

Every writer and reader of a run directory goes through this module, so the format lives in one place:

- `training_info.json`  the resolved setup, library versions, final summary and judged results (one JSON object).
- `metrics.jsonl`       one JSON object per logged event (train and eval, TRL's metric names, with `step`),
                        appended as training goes; non-finite floats are written as the strings "nan", "inf", "-inf".
- `samples_<split>.jsonl`  one JSON object per judged held-out prompt (see `src/generation.py`).

Appends are one `write` of a whole line followed by a flush, so a crash loses at most the line being written;
readers skip a torn last line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from src.run_safety.disk_space import fail_write_if_injected

TRAINING_INFO = "training_info.json"
# training_info.json's record of which forward trained the run (packed or TRL's padded, src/packed_dpo.py) and the
# tokens it computed; runs before the objectives' table wrote it as "dpo_forward", which readers still take
FORWARD = "forward"
OLD_FORWARD = "dpo_forward"
METRICS = "metrics.jsonl"
PLOTS_DIR = "plots"  # the run's charts; a copy goes beside each saved model, with its card
MODEL_CARD = "README.md"  # beside each saved model (src/reporting/model_card.py)
SAMPLE_IMAGES_DIR = "sample_images"  # thumbnails of the held-out prompts' images, which report.md links

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def samples_file(split: str) -> str:
    return f"samples_{split}.jsonl"


def _encode(value: Any) -> Any:
    """Replace non-finite floats (which strict JSON cannot hold) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(_encode(value), allow_nan=False, default=str)


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    line = dumps(record) + "\n"
    fail_write_if_injected(path)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete records of a JSONL file; a torn last line (a crash mid-write) is skipped."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_decode(json.loads(line)))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the line being written when the process died
            raise ValueError(f"{path}: line {number} is not valid JSON") from None
    return records


def write_json(path: str | os.PathLike, value: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fail_write_if_injected(path)
        temporary.write_text(json.dumps(_encode(value), indent=2, allow_nan=False, default=str) + "\n",
                             encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # a failed write (a full disk) gives its space back


def remove_temporary_files(run_dir: str | os.PathLike) -> list[Path]:
    """`write_json`'s temporary files that a killed writer left in a run directory; only the job holding the
    directory (src/run_safety/run_lock.py) may call this, so none of them can be a write in progress."""
    leftovers = [path for path in Path(run_dir).rglob(".*.tmp*") if path.is_file() and
                 path.name.rsplit(".tmp", 1)[1].isdigit()]
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def read_json(path: str | os.PathLike) -> Any:
    return _decode(json.loads(Path(path).read_text(encoding="utf-8")))


def update_json(path: str | os.PathLike, **fields: Any) -> dict:
    """Merge `fields` into the JSON object at `path` (created if missing) and return the result."""
    path = Path(path)
    current = read_json(path) if path.exists() else {}
    current.update(fields)
    write_json(path, current)
    return current


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """A temporary path beside `path` (same suffix, so writers that go by it still work) that replaces `path` once the
    block has written it: a reader sees the old file or the new one, never half of one, and a crash leaves the old."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        fail_write_if_injected(path)
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` atomically (see `atomic_path`)."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` atomically (see `atomic_path`), its directory made where missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)
