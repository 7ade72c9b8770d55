"""What the data audit adds to data preparation: this tree against a checkout from before the audit, same file, same
arm of bench/bench_prepare.py (time and peak memory of the preparation call), the two trees interleaved.

    git worktree add /tmp/before-audit c17c94c          # the commit before the audit
    python bench/bench_audit_cost.py --before /tmp/before-audit --pairs 200000 --repeats 2

The data file is bench/ultrafeedback_like.py's (short answers by default: the audit's per-row work is then the
largest share it can be). Prints every run and, per tree, the median time and peak memory, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]


def prepare_once(tree: Path, data_file: Path, workdir: Path, arm: str, max_length: int, env: dict) -> dict:
    output = subprocess.run([sys.executable, str(tree / "bench" / "bench_prepare.py"), "--arm", arm, "--data_file",
                             str(data_file), "--workdir", str(workdir), "--max_length", str(max_length)],
                            env=env, capture_output=True, text=True, cwd=tree)
    subprocess.run(["rm", "-rf", str(workdir)])
    if output.returncode:
        raise SystemExit(f"{tree}: {output.stderr.strip().splitlines()[-3:]}")
    return json.loads(output.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="A checkout of the commit before the audit.")
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arm", default="toolkit-all", choices=("toolkit-1", "toolkit-all"))
    parser.add_argument("--prompt_words", type=float, default=20)
    parser.add_argument("--answer_words", type=float, default=40)
    parser.add_argument("--max_length", type=int, default=256)
    args = parser.parse_args()
    from ultrafeedback_like import write

    root = Path(tempfile.mkdtemp(prefix="bench_audit_cost_"))
    data_file = root / "pairs.jsonl"
    write(data_file, args.pairs, prompt_words=args.prompt_words, answer_words=args.answer_words)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(root / "hf_home"),
                        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    trees = {"before": args.before.resolve(), "audit": HERE.parent}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    print(f"{args.pairs:,} pairs, arm {args.arm}, data {data_file.stat().st_size / 1e6:.0f} MB")
    print(f"{'repeat':>6} {'tree':<7} {'seconds':>8} {'peak MB':>8}")
    for repeat in range(args.repeats):
        for name, tree in (trees.items() if repeat % 2 == 0 else reversed(trees.items())):
            result = prepare_once(tree, data_file, root / f"work-{name}-{repeat}", args.arm, args.max_length, env)
            results[name].append(result)
            print(f"{repeat:>6} {name:<7} {result['seconds']:>8.1f} {result['peak_mb']:>8.0f}", flush=True)
    median = {name: {key: statistics.median(item[key] for item in items) for key in ("seconds", "peak_mb")}
              for name, items in results.items()}
    for name, values in median.items():
        print(f"median {name:<7} {values['seconds']:>8.1f} s {values['peak_mb']:>8.0f} MB")
    print(f"audit / before: time x{median['audit']['seconds'] / median['before']['seconds']:.3f}, "
          f"peak memory x{median['audit']['peak_mb'] / median['before']['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
