"""Test seams: the one place production code asks whether a test planted a fault (a kill, a failed write, a stall) at a
named moment. One environment variable, PREFKIT_TEST_SEAMS, holds a JSON object {seam name: value}; a production
module calls `seams.get(name)` and never reads a test variable itself. A user's run has no such variable: every seam
answers None, at the cost of one dictionary look-up.

Tests set it with `seams.env(name=value, ...)` (merged into a process's environment; a forked run inherits it, a fresh
process receives it). The seams and what each plants are listed in docs/development.md ("Test seams").
"""

from __future__ import annotations

import json
import os

VARIABLE = "PREFKIT_TEST_SEAMS"

_parsed: tuple[str, dict] = ("", {})


def _table() -> dict:
    global _parsed
    raw = os.environ.get(VARIABLE, "")
    if raw != _parsed[0]:  # read anew when a test changed it (forked runs set it after import)
        _parsed = (raw, json.loads(raw) if raw else {})
    return _parsed[1]


def get(name: str, default=None):
    """The value a test planted for seam `name`, else `default`."""
    return _table().get(name, default)


def env(base: dict | None = None, **planted) -> dict:
    """An environment for a test's process: `base` (or this process's environment) with `planted` seams added to the
    ones already there."""
    environment = dict(os.environ if base is None else base)
    table = json.loads(environment.get(VARIABLE) or "{}")
    table.update(planted)
    environment[VARIABLE] = json.dumps(table)
    return environment
