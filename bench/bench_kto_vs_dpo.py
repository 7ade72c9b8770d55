"""KTO's cost per optimizer step against DPO's, on the embedded default's model and pairs (KTO from the same pairs).

    python bench/bench_kto_vs_dpo.py                     # ~10 minutes on 2 CPU cores
    python bench/bench_kto_vs_dpo.py --steps 20 --repeats 3

Arms, each a real one-process run of src/main_distributed.py (no evaluation, no held-out answers, reference log-probs
precomputed and cached as in a normal run; their one-off pass is reported apart from the steps):
  dpo     --stage dpo, global batch 32 pairs (64 sequences through the packed forward, src/packed_dpo.py)
  kto     --stage kto, global batch 32 rows (configs/kto.yaml's setting: 16 pairs' worth of answers)
  kto64   --stage kto, global batch 64 rows (the answers of 32 pairs: the same data per step as dpo)
Each KTO step also runs the KL completions of its rows through the policy without gradients (src/trainers/kto.py).
The arms run interleaved, repeat after repeat; the table gives the median step time (the time between two logged
steps in metrics.jsonl, the first step left out) and its ratio to dpo's.
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

ROOT = Path(__file__).resolve().parent.parent
ARMS = {"dpo": ["--stage", "dpo", "--batch_size", "32", "--loss_type", "sigmoid"],
        "kto": ["--stage", "kto", "--batch_size", "32"],
        "kto64": ["--stage", "kto", "--batch_size", "64"]}


def run_arm(name: str, steps: int, results: Path, repeat: int) -> dict:
    args = [sys.executable, "-m", "src.main_distributed", "--model_name_or_path", "embedded", "--dataset_name",
            "embedded", "--max_length", "64", "--max_steps", str(steps), "--logging_steps", "1", "--eval_strategy",
            "no", "--save_strategy", "no", "--num_samples", "0", "--audit_judge_pairs", "0", "--max_train_samples",
            "1024", "--learning_rate", "8e-5", "--results_dir", str(results), "--run_name", f"{name}-{repeat}",
            "--overwrite", *ARMS[name]]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=os.environ)
    if result.returncode:
        raise SystemExit(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    run_dir = results / f"{name}-{repeat}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Between two logged steps (logging_steps 1): everything a step costs, KTO's KL pass before it included (the
    # throughput meter's perf/step_time_s starts at on_step_begin, after transformers fetched the step's batches).
    stamps = [record["time_s"] for record in records if "loss" in record and "time_s" in record]
    times = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    info = json.loads((run_dir / "training_info.json").read_text())
    reference = sum(item["seconds"] for item in (info.get("reference_log_probs") or {}).values())
    return {"step_times": times, "reference_seconds": reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    results = Path(tempfile.mkdtemp(prefix="bench_kto_"))
    measured = {name: [] for name in ARMS}
    reference = {name: [] for name in ARMS}
    for repeat in range(options.repeats):
        for name in ARMS:
            outcome = run_arm(name, options.steps, results, repeat)
            measured[name] += outcome["step_times"]
            reference[name].append(outcome["reference_seconds"])
            print(f"repeat {repeat + 1} {name}: median step {statistics.median(outcome['step_times']):.3f} s",
                  flush=True)
    base = statistics.median(measured["dpo"])
    print("\n| arm | rows (sequences) per step | median step time | vs dpo | reference pass (first repeat) |")
    print("|---|---|---|---|---|")
    per_step = {"dpo": "32 pairs (64)", "kto": "32 rows (32 + 32 KL, no grad)", "kto64": "64 rows (64 + 64 KL, no grad)"}
    for name in ARMS:
        median = statistics.median(measured[name])
        print(f"| {name} | {per_step[name]} | {median:.3f} s | x{median / base:.2f} | {reference[name][0]:.1f} s |")


if __name__ == "__main__":
    main()
