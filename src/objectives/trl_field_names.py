"""The field names of each TRL config an objective builds, and the values TRL declares for the fields that take a
choice, as the pinned TRL declares them, read without importing TRL.

TRL's configs import transformers and torch (~5 s of CPU): a mistyped flag (`--lerning_rate`) is known to be no TRL
field, and answered in one line, from this table alone; a key that is a TRL field still loads the config for its type.
A value TRL would refuse only when its trainer is built, after the data was prepared and the model loaded (`--stage dpo
--loss_type dapo`, GRPO's; `--truncation_mode keep_middle`), is refused as the config is parsed from the choices here
(src/config_checks.py `refuse_undeclared_choice`). tests/test_config.py checks the table against the installed TRL;
after a TRL upgrade, write it again:

    python -m src.objectives.trl_field_names
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import cache
from pathlib import Path

from src.objectives import OBJECTIVES, load

TABLE = Path(__file__).with_name("trl_field_names.json")
# How TRL's help texts list a field's values where its metadata has no `choices` (DPOConfig's and GRPOConfig's
# loss_type): "Possible values are: `'sigmoid'`, `'hinge'`, ... ." / "Supported values are 'grpo', ..., and 'vespo'."
LISTED_VALUES = re.compile(r"(?:Possible|Supported) values are:?\s+(.+?)\.(?:\s|$)")
QUOTED_VALUE = re.compile(r"'([A-Za-z0-9_]+)'")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The values TRL declares for one of its config's fields, its default, and whether it takes several (a list)."""
    values: tuple[str, ...]
    default: str | tuple[str, ...] | None
    several: bool


@cache
def _table() -> dict:
    return json.loads(TABLE.read_text(encoding="utf-8"))


@cache
def field_names() -> dict[str, frozenset[str]]:
    """TRL config path ("trl:DPOConfig") → the names of its init fields."""
    table = _table()
    shared = set(table["shared"])
    return {path: frozenset(shared | set(own)) for path, own in table["configs"].items()}


@cache
def declared_choices(path: str) -> dict[str, Choice]:
    """TRL config path → {field: the values TRL declares for it} for its fields that take one of a set."""
    choices = _table()["choices"]
    return {name: Choice(tuple(item["values"]), tuple(item["default"]) if item["several"] else item["default"],
                         item["several"])
            for name, item in (choices["shared"] | choices["configs"][path]).items()}


def live_field_names(path: str) -> frozenset[str]:
    """The installed TRL's init field names of the config at `path` (imports it)."""
    return frozenset(item.name for item in dataclasses.fields(load(path)) if item.init)


def live_choices(path: str) -> dict[str, dict]:
    """The installed TRL's declared values of the config at `path`: a field's `choices` metadata, else the values its
    help text lists (imports it)."""
    found = {}
    for item in dataclasses.fields(load(path)):
        listed = LISTED_VALUES.search(item.metadata.get("help", "")) if item.init else None
        values = item.metadata.get("choices") or (QUOTED_VALUE.findall(listed.group(1)) if listed else None)
        if not item.init or not values:
            continue
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        found[item.name] = {"values": [str(value) for value in values], "default": default,
                            "several": isinstance(default, list)}
    return found


def write() -> None:
    """The table from the installed TRL: the names every config shares (TrainingArguments') once, each config's own,
    and each config's declared choices."""
    paths = sorted({row.training.trl_config for row in OBJECTIVES.values()})
    names = {path: live_field_names(path) for path in paths}
    shared = frozenset.intersection(*names.values())
    choices = {path: live_choices(path) for path in paths}
    same = {name: item for name, item in choices[paths[0]].items()
            if all(choices[path].get(name) == item for path in paths)}
    table = {"shared": sorted(shared), "configs": {path: sorted(names[path] - shared) for path in paths},
             "choices": {"shared": same, "configs": {path: {name: item for name, item in choices[path].items()
                                                            if name not in same} for path in paths}}}
    TABLE.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write()
    print(f"wrote {TABLE}")
