"""The objectives against each other on the embedded default: KTO's cost per optimizer step against DPO's, and (with
--judged) DPO, SimPO, ORPO and KTO from the same SFT model, judged on the same held-out test prompts.

    python bench/bench_objectives.py                     # cost per step, ~10 minutes on 2 CPU cores
    python bench/bench_objectives.py --steps 20 --repeats 3
    ./run_distributed.sh && python bench/bench_objectives.py --judged    # judged: ~15 minutes on 2 idle CPU cores

Cost per step. Arms, each a real one-process run of src/main_distributed.py (no evaluation, no held-out answers,
reference log-probs precomputed and cached as in a normal run; their one-off pass is reported apart from the steps):
  dpo     --stage dpo, global batch 32 pairs (64 sequences through the packed forward, src/packed_dpo.py)
  kto     --stage kto, global batch 32 rows (configs/kto.yaml's setting: 16 pairs' worth of answers)
  kto64   --stage kto, global batch 64 rows (the answers of 32 pairs: the same data per step as dpo)
Each KTO step also runs the KL completions of its rows through the policy without gradients (src/trainers/kto.py).
The arms run interleaved, repeat after repeat; the table gives the median step time (the time between two logged
steps in metrics.jsonl, the first step left out) and its ratio to dpo's.

Judged (--judged, issue 37 point 5). Each objective's own recipe (configs/default.yaml for DPO, configs/simpo.yaml,
configs/orpo.yaml, configs/kto.yaml), its final stage alone, one process: DPO, SimPO and KTO from the same SFT model
(--sft_model: results/default/sft/model/final after ./run_distributed.sh); ORPO, which replaces SFT, from the model SFT
starts from (the embedded model), on the pairs. Every arm runs the same --steps (60 by default, DPO's recipe's;
--orpo_steps gives ORPO another count, e.g. its recipe's 1000, SFT's). Every arm answers the same --num_samples test
prompts (400: configs/default.yaml's) with greedy decoding and is judged by the embedded check before and after
(training_info.json `judge`). The arms run one after another in one invocation, repeat after repeat; each prints its
start, end and the machine's load average, so that a reader can tell whether they ran under the same conditions. The
table: correct-and-preferred after training with its 95% interval (normal approximation, as report.md gives it), the
change from the model the arm started from, wall time of the run, peak memory, and the median time per step. The arms'
order is --objectives' (pass it reversed in a second invocation to balance a load that drifts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


JUDGED = {"dpo": ("configs/default.yaml", "dpo"), "simpo": ("configs/simpo.yaml", "simpo"),
          "orpo": ("configs/orpo.yaml", "orpo"), "kto": ("configs/kto.yaml", "kto")}


def judged_arm(name: str, options, results: Path, repeat: int) -> dict:
    """One objective's run from its recipe, its final stage alone; what training_info.json records of it."""
    recipe, stage = JUDGED[name]
    start = options.base_model if name == "orpo" else options.sft_model
    steps = (options.orpo_steps or options.steps) if name == "orpo" else options.steps
    args = [sys.executable, "-m", "src.main_distributed", "--config", recipe, "--stage", stage,
            "--model_name_or_path", start, "--num_samples", str(options.num_samples), "--results_dir", str(results),
            "--run_name", f"{name}-{repeat}", "--overwrite", "--eval_strategy", "no", "--save_strategy", "no",
            *(["--max_steps", str(steps)] if steps else []), *options.extra]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=os.environ)
    if result.returncode:
        raise SystemExit(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    run_dir = results / f"{name}-{repeat}"
    info = json.loads((run_dir / "training_info.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stamps = [record["time_s"] for record in records if "loss" in record and "time_s" in record]
    steps_logged = [record["step"] for record in records if "loss" in record and "time_s" in record]
    per_step = [(later - earlier) / max(1, b - a) for earlier, later, a, b in
                zip(stamps, stamps[1:], steps_logged, steps_logged[1:])]
    summary = info.get("summary") or {}
    return {"judge": info.get("judge") or {}, "wall_time_s": summary.get("wall_time_s"),
            "peak_memory_mb": summary.get("peak_memory_mb"), "step_times": per_step,
            "steps": info.get("max_steps") or steps}


def judged(options) -> None:
    sys.path.insert(0, str(ROOT))
    from src.reporting.formatting import ci95

    if Path(options.sft_model).name != "embedded" and not Path(options.sft_model).exists():
        raise SystemExit(f"error: --sft_model {options.sft_model} does not exist: run ./run_distributed.sh first")
    options.steps = options.steps or 60
    results = Path(tempfile.mkdtemp(prefix="bench_objectives_"))
    outcomes = {name: [] for name in options.objectives}
    for repeat in range(options.repeats):
        for name in options.objectives:
            start, load_start = time.strftime("%H:%M:%S", time.gmtime()), os.getloadavg()[0]
            outcomes[name].append(judged_arm(name, options, results, repeat))
            judge = outcomes[name][-1]["judge"]
            print(f"repeat {repeat + 1} {name}: {judge.get('before')} -> {judge.get('after')} "
                  f"({judge.get('metric')}, n {judge.get('n')}); {start}-{time.strftime('%H:%M:%S', time.gmtime())} "
                  f"UTC, load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end", flush=True)
    print(f"\n| objective (from) | steps | correct and preferred after (95%) | change | wall time | peak memory | "
          f"time per step |\n|---|---|---|---|---|---|---|")
    for name, runs in outcomes.items():
        judge = runs[0]["judge"]
        after, before, count = judge.get("after"), judge.get("before"), judge.get("n") or 0
        origin = "base model" if name == "orpo" else "SFT model"
        step_times = [time for run in runs for time in run["step_times"]]
        print(f"| {name} ({origin}) | {runs[0]['steps']} | "
              + (f"{after:.1%}{ci95(after, count)} (n {count})" if after is not None else "n/a")
              + (f" | {100 * (after - before):+.1f} pts" if after is not None and before is not None else " | n/a")
              + f" | {statistics.median(run['wall_time_s'] for run in runs):.0f} s"
              + f" | {statistics.median(run['peak_memory_mb'] for run in runs):,.0f} MB"
              + (f" | {statistics.median(step_times):.3f} s |" if step_times else " | n/a |"))
    print(f"\n{options.repeats} repeat(s), arms one after another in one invocation; the judged numbers are the first "
          "repeat's (the runs are seeded: a repeat that differs says the machine's arithmetic did).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps per arm (default 10; judged: every arm, ORPO too, "
                        "default 60, DPO's recipe's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--judged", action="store_true", help="DPO, SimPO, ORPO, KTO judged on held-out prompts")
    parser.add_argument("--objectives", nargs="+", default=list(JUDGED), choices=list(JUDGED))
    parser.add_argument("--sft_model", default=str(ROOT / "results/default/sft/model/final"))
    parser.add_argument("--base_model", default="embedded", help="where ORPO starts (SFT's starting model)")
    parser.add_argument("--orpo_steps", type=int, default=0, help="ORPO's steps (0: the same --steps as the others)")
    parser.add_argument("--num_samples", type=int, default=400)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags every judged arm gets")
    options = parser.parse_args()
    options.extra = [flag for flag in options.extra if flag != "--"]
    if options.judged:
        return judged(options)
    options.steps = options.steps or 10
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
