"""Where a run's numbers came from: the library versions and the code's git commit, as training_info.json records
them and a finished run's relaunch compares them (src/run_safety/finished_run.py). Light: no torch."""

from __future__ import annotations

import subprocess
import sys

from src.config import PROJECT_ROOT

LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for library in LIBRARIES:
        try:
            found[library] = version(library)
        except PackageNotFoundError:
            found[library] = "not installed"
    return found


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'-dirty' if dirty else ''}" if commit else None
