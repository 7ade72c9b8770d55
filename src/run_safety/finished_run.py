"""A finished run relaunched: the same command finishes what a kill left of the run's end and exits 0; a different one
is refused, naming what differs.

A kill can land after training finished (a Slurm --requeue, a lost node, Ctrl-C twice), while the run writes its last
report, index or model card, or releases its hold. The scheduler then relaunches the same command. That command must
neither train again nor fail: it finishes the end and exits 0 (docs/reliability.md).

"The same command" means, for every stage of the run, against what its training_info.json recorded:

- the configuration (`config`, the resolved flags and recipe), every key but LAUNCH_ONLY_KEYS: those say how this
  launch runs, where it writes copies or who watches it, never what is trained or what the run directory holds;
- the plan's resolved values that change results (PLAN_KEYS): a different number of processes is the same run with a
  global --batch_size, a different one with --per_device_batch_size (its global batch changes);
- the data: each source file's bytes (size and sha256; a file whose size and modification time are unchanged is not
  read again); a Hub dataset is known by its name (and --dataset_config, a config key) only;
- the code: the toolkit's git commit (with `-dirty` for uncommitted changes) when both the run and this launch know
  one. Library versions are not compared: they are the machine's, not the command's.

The model's weights are known by --model_name_or_path alone (hashing them would cost minutes on a large model).
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

from src import run_files, seams
from src.data_file_kinds import source_files

# Keys of a run's `config` that do not make it another run: what this launch does (--overwrite, --dry_run), where
# results are found (--results_dir, --run_name: the directory itself, which may be moved or given another way), which
# trackers watch it, how long a lost node is waited for, how many processes tokenize (the same prepared data), and
# the copies made after the run (--final_model_dir, --push_to_hub and its repository): a relaunch makes those.
LAUNCH_ONLY_KEYS = frozenset({
    "overwrite", "dry_run", "results_dir", "run_name", "report_to", "node_timeout", "hang_timeout", "dataset_num_proc",
    "final_model_dir", "push_to_hub", "hub_model_id", "hub_private_repo",
})
# The plan's resolved values (src/config.py Plan) that change what is trained.
PLAN_KEYS = ("global_batch_size", "learning_rate", "precision")

# The steps of a stage's end, in order: training finished, the final model saved, the held-out samples written, the
# status "completed" recorded, then the pages (report and plots, results/index.md, the model cards). A kill before
# "completed" is resumed from the final checkpoint (no step is trained again); after it, the relaunch redoes the
# pages, which are pure functions of the run directory. The hold is released when the process ends.
END_STEPS = ("trained", "final_model", "samples", "completed", "report", "index", "model_card")


def end_step_done(step: str) -> None:
    """Mark an end step as done; tests/test_finished_run.py kills the process here (the test seam kill_after_end_step,
    src/seams.py) to prove a relaunch recovers from a kill at each of END_STEPS."""
    assert step in END_STEPS, step
    if seams.get("kill_after_end_step") == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_fingerprint(locations: list[str]) -> dict[str, Any]:
    """{location: [{file, bytes, mtime_ns, sha256}, ...]} for local data (a directory: each file in it, by its path
    inside); {location: "hub"} for a Hub dataset."""
    found: dict[str, Any] = {}
    for location in locations:
        files = source_files(location)
        if files is None:
            found[location] = "hub"
            continue
        root = Path(location) if Path(location).is_dir() else Path(location).parent
        found[location] = [{"file": str(item.relative_to(root)), "bytes": item.stat().st_size,
                            "mtime_ns": item.stat().st_mtime_ns, "sha256": _sha256(item)} for item in files]
    return found


def _data_differences(recorded: dict | None, locations: list[str]) -> list[str]:
    """What differs between the recorded fingerprint and the data now; a file unchanged in size and modification time
    is taken as unchanged without reading it."""
    if recorded is None:
        return ["data: the finished run recorded no fingerprint of its data (an older toolkit) → cannot tell"]
    differences = []
    for location in locations:
        before, files = recorded.get(location), source_files(location)
        if before is None:
            differences.append(f"data: {location} was not among the finished run's sources "
                               f"({', '.join(recorded) or 'none'})")
            continue
        if before == "hub" or files is None:
            if (before == "hub") != (files is None):
                differences.append(f"data: {location}: {'a Hub dataset' if before == 'hub' else 'local files'} → "
                                   f"{'local files' if files is None else 'a Hub dataset'}")
            continue
        root = Path(location) if Path(location).is_dir() else Path(location).parent
        now = {str(item.relative_to(root)): item for item in files}
        then = {entry["file"]: entry for entry in before}
        for name in sorted(then.keys() | now.keys()):
            entry, item = then.get(name), now.get(name)
            if entry is None or item is None:
                differences.append(f"data: {root / name}: {'absent' if entry is None else 'present'} → "
                                   f"{'absent' if item is None else 'present'}")
                continue
            stat = item.stat()
            if stat.st_size == entry["bytes"] and stat.st_mtime_ns == entry["mtime_ns"]:
                continue
            if stat.st_size != entry["bytes"] or _sha256(item) != entry["sha256"]:
                differences.append(f"data: {root / name}: {entry['bytes']:,} bytes, sha256 {entry['sha256'][:12]} → "
                                   f"{stat.st_size:,} bytes, sha256 {_sha256(item)[:12]}")
    return differences


def _shown(value: Any) -> str:
    return run_files.dumps(value)


def differences(recorded: dict, config: dict, plan: dict, locations: list[str], commit: str | None,
                label: str = "") -> list[str]:
    """What makes this launch another run than the finished one `recorded` (a stage's training_info.json): one
    `key: recorded → now` entry per difference; empty when it is the same command. `label` prefixes a pipeline stage's
    keys."""
    prefix = f"{label} stage: " if label else ""
    if not recorded.get("config"):
        return [f"{prefix}configuration: not recorded by the finished run → cannot tell"]
    found = []
    then = recorded["config"]
    for key in sorted((then.keys() | config.keys()) - LAUNCH_ONLY_KEYS):
        if key not in then or key not in config or _shown(then[key]) != _shown(config[key]):
            found.append(f"{prefix}{key}: {_shown(then[key]) if key in then else '(not set)'} → "
                         f"{_shown(config[key]) if key in config else '(not set)'}")
    for key in PLAN_KEYS:  # a resolved value that differs only because its flag does is said once, by the flag
        if key in recorded and _shown(recorded[key]) != _shown(plan.get(key)) and not any(
                line.startswith(f"{prefix}{key}:") for line in found):
            found.append(f"{prefix}{key} (resolved): {_shown(recorded[key])} → {_shown(plan.get(key))}")
    found += [prefix + line for line in _data_differences(recorded.get("data_fingerprint"), locations)]
    if recorded.get("git_commit") and commit and recorded["git_commit"] != commit:
        found.append(f"{prefix}code (git commit): {recorded['git_commit']} → {commit}")
    return found


def refusal(run_dir: Path, found: list[str]) -> str:
    """The one line that refuses another configuration on a finished run."""
    return (f"{run_dir} already holds a finished run of another configuration ({'; '.join(found)}): pass "
            "--overwrite to replace it, or --run_name to keep both")


def finished_line(run_dir: Path, record: dict, verdict: str | None) -> str:
    """The one line a relaunch of a finished run prints: where, when, its verdict."""
    summary = record.get("summary") or {}
    when = record.get("finished_at") or f"started {record.get('started_at', '?')}"
    steps = summary.get("completed_steps")
    return (f"{run_dir} is already finished (at {when}{f', {steps} steps' if steps is not None else ''}): "
            f"{verdict or 'see its report.md'} Nothing to train: exiting 0.")
