"""The judged gain of each on-policy round, with its 95% interval, from a finished rounds run's files; and the
headroom the rounds start with (best of K against greedy). docs/rounds.md quotes its output.

    python bench/rounds_gain.py results/iterative_prompts [results/iterative ...] [--split test]

Per round (the round's samples_<split>.jsonl: every held-out prompt answered greedily by the round's starting model
and by its trained model, both judged): the paired gain in the judge's score (and in each boolean sub-criterion, e.g.
correct) and its 95% interval, mean ± 1.96 x the standard deviation of the per-prompt differences / sqrt(n) (a paired
interval: the same prompts before and after, so it is narrower than two independent binomial intervals). The last line
per run is the whole run's gain, from the first round's starting model to the last round's model, paired the same way.
Headroom: a round's `best_of_k_score` (round.json: the mean over the round's train prompts of the best of its K sampled
answers' scores; with a 0/1 judge, how often one of K answers is right) beside the starting model's greedy score.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def paired(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean paired difference (after - before) and the half-width of its 95% interval (normal approximation)."""
    differences = [a - b for b, a in zip(before, after)]
    n = len(differences)
    mean = sum(differences) / n
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1) if n > 1 else 0.0
    return mean, 1.96 * math.sqrt(variance / n)


def _values(samples: list[dict], side: str, key: str) -> list[float]:
    return [float((row["verdict"] or {}).get(side, {}).get(key) or 0.0) for row in samples]


def round_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    """(label, directory) of the DPO stage (when the run had one) and of every round, in order."""
    info = json.loads((run_dir / "training_info.json").read_text())
    return [("DPO (offline pairs)" if entry["round"] == 0 else f"round {entry['round']}",
             run_dir / entry["run_dir"]) for entry in info["rounds"]]


def report(run_dir: Path, split: str) -> list[str]:
    stages = round_dirs(run_dir)
    samples = [_read(directory / f"samples_{split}.jsonl") for _, directory in stages]
    keys = ["score"] + sorted(key for key, value in samples[0][0]["verdict"]["trained"].items()
                              if isinstance(value, bool))
    lines = [f"{run_dir} ({split}, n={len(samples[0])})"]
    for (label, directory), rows in zip(stages, samples):
        cells = []
        for key in keys:
            before, after = _values(rows, "reference", key), _values(rows, "trained", key)
            gain, half = paired(before, after)
            cells.append(f"{key} {100 * sum(before) / len(before):.1f}% -> {100 * sum(after) / len(after):.1f}% "
                         f"({100 * gain:+.1f} ± {100 * half:.1f} pts)")
        record = directory / "round.json"
        counts = json.loads(record.read_text())["counts"] if record.exists() else {}
        best = counts.get("best_of_k_score")
        head = f"; best of K {best:.3f}, mean sample {counts['mean_score']:.3f}" if best is not None else ""
        lines.append(f"  {label}: {'; '.join(cells)}{head}")
    cells = []
    for key in keys:
        gain, half = paired(_values(samples[0], "reference", key), _values(samples[-1], "trained", key))
        cells.append(f"{key} {100 * gain:+.1f} ± {100 * half:.1f} pts")
    lines.append(f"  whole run (start -> last round): {'; '.join(cells)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    for run in args.runs:
        print("\n".join(report(run, args.split)))


if __name__ == "__main__":
    main()
