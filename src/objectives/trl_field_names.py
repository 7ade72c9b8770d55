"""The field names of each TRL config an objective builds, as the pinned TRL declares them, read without importing TRL.

TRL's configs import transformers and torch (~5 s of CPU): a mistyped flag (`--lerning_rate`) is known to be no TRL
field, and answered in one line, from this table alone; a key that is a TRL field still loads the config for its type.
tests/test_config.py checks the table against the installed TRL; after a TRL upgrade, write it again:

    python -m src.objectives.trl_field_names
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

from src.objectives import OBJECTIVES, load

TABLE = Path(__file__).with_name("trl_field_names.json")


@cache
def field_names() -> dict[str, frozenset[str]]:
    """TRL config path ("trl:DPOConfig") → the names of its init fields."""
    table = json.loads(TABLE.read_text(encoding="utf-8"))
    shared = set(table["shared"])
    return {path: frozenset(shared | set(own)) for path, own in table["configs"].items()}


def live_field_names(path: str) -> frozenset[str]:
    """The installed TRL's init field names of the config at `path` (imports it)."""
    return frozenset(item.name for item in dataclasses.fields(load(path)) if item.init)


def write() -> None:
    """The table from the installed TRL: the names every config shares (TrainingArguments') once, each config's own."""
    paths = sorted({row.training.trl_config for row in OBJECTIVES.values()})
    names = {path: live_field_names(path) for path in paths}
    shared = frozenset.intersection(*names.values())
    table = {"shared": sorted(shared), "configs": {path: sorted(names[path] - shared) for path in paths}}
    TABLE.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write()
    print(f"wrote {TABLE}")
