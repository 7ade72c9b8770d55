"""A preflight that passed is not redone: the model-side checks and the prepared data of a `--dry_run`, recorded.

run_distributed.sh checks every launch in one process first (`--dry_run`). On a warm cache most of that check's time
was imports: the tokenizer (transformers, which imports torch), the model's config.json, the prepared data's cache
key (the tokenizer's fingerprint): ~4 s of CPU for an answer that cannot have changed. The record is one small JSON
file in the cache, named by a hash of everything those steps read:
- the toolkit's code (every src/**/*.py) and the versions of the libraries the checks run;
- the whole configuration, and each stage's;
- the model directory's files (name, size, modification time), the --chat_template_path file or directory, a reward
  model --judge's directory, and the data sources as the prepared data's key sees them (src/data/
  `source_fingerprint`).
A launch whose inputs cannot all be read that way (a Hub model or template) is checked in full every time, as is
every launch without a record. A `module:function` judge is no input of the recorded checks: run() imports it on
every launch, recorded or not (input_checks.check_judge), and only training calls it. The record holds what the
checks said (model warnings, the DPO forward's refusal) and where the prepared data is; a hit is used only while
that data is still complete in the cache. Workers never read it: they load the tokenizer and data themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from src.data import SUMMARY_FILE, mixture_sources, source_fingerprint, source_location
from src.judges import names_a_reward_model
from src.run_safety.build_once import is_complete

FORMAT = 1
SOURCE = Path(__file__).resolve().parent  # src/: the code the checks run
LIBRARIES = ("transformers", "tokenizers", "trl", "datasets", "huggingface_hub", "jinja2")


def _files(path: Path) -> list | None:
    """(relative name, size, mtime) of a local file or of every file under a directory; None when not local."""
    if path.is_file():
        stat = path.stat()
        return [(path.name, stat.st_size, stat.st_mtime_ns)]
    if not path.is_dir():
        return None
    return sorted((str(item.relative_to(path)), item.stat().st_size, item.stat().st_mtime_ns)
                  for item in path.rglob("*") if item.is_file())


def _code() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE.rglob("*.py")):
        digest.update(str(path.relative_to(SOURCE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def record_key(config, stages, model_path: str) -> str | None:
    """The hash of every input of the preflight's model-side checks and data preparation; None when one of them
    cannot be read without loading it (a Hub model or chat template)."""
    model = _files(Path(model_path))
    template = config.model.chat_template_path
    template_files = _files(Path(template).expanduser()) if template else []
    judge = config.training.judge
    if model is None or template_files is None:
        return None
    judge_files = (_files(Path(judge).expanduser()) or judge) if names_a_reward_model(judge) else []
    data = [[source_fingerprint(location) for location in
             ([source_location(source, stage.data_stage) for source, _ in mixture_sources(stage.config.data)]
              or [source_location(stage.config.data, stage.data_stage)])] for stage in stages]
    parts = {
        "format": FORMAT,
        "code": _code(),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "config": config.values(),
        "stages": [[stage.name, stage.data_stage, stage.config.values()] for stage in stages],
        "model": [model_path, model],
        "chat_template": template_files,
        "judge": judge_files,
        "data": data,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "preflight" / f"{key}.json"


def recorded(cache_dir: Path, key: str | None) -> dict | None:
    """The record of a passed preflight with these inputs, while its prepared data is complete; else None."""
    if key is None:
        return None
    try:
        record = json.loads(_path(cache_dir, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    prepared = {stage: cache_dir / "datasets" / name for stage, name in record["prepared"].items()}
    if not all(is_complete(path) for path in prepared.values()):
        return None
    record["summaries"] = {stage: json.loads((path / SUMMARY_FILE).read_text()) for stage, path in prepared.items()}
    return record


def record(cache_dir: Path, key: str | None, prepared: dict, model_warnings: dict, padded_reason: str | None) -> None:
    """Keep what a passed preflight found (atomically). The record only saves time: one that cannot be written is not
    an error, the next launch checks in full."""
    if key is None:
        return
    path = _path(cache_dir, key)
    value = {"prepared": {stage: Path(data.path).name for stage, data in prepared.items()},
             "model_warnings": model_warnings, "padded_reason": padded_reason}
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(value), encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
