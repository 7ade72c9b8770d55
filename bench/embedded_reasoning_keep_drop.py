"""The embedded reasoning variant trained with its reasoning kept against dropped: SFT → DPO, judged on the same held-out
prompts, and the time of each. docs/reasoning.md quotes its output.

    python bench/embedded_reasoning_keep_drop.py                                   # the recipe as shipped (long)
    python bench/embedded_reasoning_keep_drop.py --sft_steps 40 --dpo_steps 10 --dpo_pairs 320 --num_samples 48
                                                                                   # a short look (timings only)

Each arm is one launch of `./run_distributed.sh P --config configs/embedded_reasoning.yaml --reasoning keep|drop`
(the same seed, data, steps and held-out prompts; only what is trained differs: the answers with their reasoning, or
the final answers after an empty reasoning block), the arms interleaved (keep, drop, keep, drop, ... with --repeats)
so the machine's load falls on both alike. From each launch's files: the judged test answers of the SFT stage
(untrained → SFT) and of the DPO stage (SFT → DPO) — correct and preferred (the embedded default's score), correct,
preferred, and the share of answers that reason (a non-empty <think> block that closed before the answer) — the
prompts checked to be the same in both arms; each stage's time to its last training step, its tokens per second and its
train_runtime (evaluation included), and the launch's wall time (preparation, loading, judging and saving too). Run directories: --results_dir (a temporary directory by default), the model and data caches: PREFKIT_CACHE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RECIPE = "configs/embedded_reasoning.yaml"
ARMS = ("keep", "drop")


def launch(arm: str, repeat: int, args, results_dir: Path) -> dict:
    """One SFT → DPO launch of the recipe with --reasoning `arm`; its judged numbers and times."""
    run_name = f"reasoning-{arm}-{repeat}"
    command = ["./run_distributed.sh", str(args.processes), "--config", RECIPE, "--reasoning", arm,
               "--run_name", run_name, "--results_dir", str(results_dir), "--overwrite",
               "--num_samples", str(args.num_samples)]
    if args.sft_steps:
        command += ["--sft.max_steps", str(args.sft_steps)]
    if args.dpo_steps:
        command += ["--max_steps", str(args.dpo_steps), "--eval_steps", str(args.dpo_steps),
                    "--save_steps", str(args.dpo_steps)]
    if args.dpo_pairs:  # the reference log-probs are computed for every training pair, whatever the steps
        command += ["--max_train_samples", str(args.dpo_pairs), "--sft.max_train_samples", "0"]
    started = time.monotonic()
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {finished.returncode}:\n{finished.stdout[-3000:]}"
                         f"{finished.stderr[-3000:]}")
    run_dir = results_dir / run_name
    return {"arm": arm, "repeat": repeat, "wall_s": wall,
            "sft": stage_numbers(run_dir / "sft"), "dpo": stage_numbers(run_dir)}


def stage_numbers(stage_dir: Path) -> dict:
    from src.chat_templates import split_reasoning

    info = json.loads((stage_dir / "training_info.json").read_text())
    rows = [json.loads(line) for line in (stage_dir / "samples_test.jsonl").read_text().splitlines() if line.strip()]
    metrics = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = info.get("summary") or {}

    def share(side: str, key: str) -> float:
        return sum(bool((row["verdict"] or {}).get(side, {}).get(key)) for row in rows) / len(rows)

    def reasons(side: str) -> float:
        answers = [row.get(f"{side}_answer") or "" for row in rows]
        parts = [split_reasoning({"content": answer}) for answer in answers]
        return sum(bool(part.reasoning) and part.closed for part in parts) / len(rows)

    return {"prompts": [row.get("prompt") for row in rows],
            "train_s": max(row["time_s"] for row in metrics if "loss" in row),  # the training steps
            "stage_s": next(row["train_runtime"] for row in metrics if "train_runtime" in row),  # with evaluation
            "tokens_per_s": (summary.get("throughput") or {}).get("tokens_per_second"),
            **{f"{side}_{key}": share(side, key) for side in ("reference", "trained")
               for key in ("score", "correct", "preferred")},
            "reference_reasons": reasons("reference"), "trained_reasons": reasons("trained")}


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def table(results: list[dict]) -> list[str]:
    lines = ["| arm | repeat | SFT: correct and preferred / correct / reasons | DPO: correct and preferred / correct / "
             "preferred / reasons | SFT steps s (tokens/s) | DPO steps s (tokens/s) | SFT / DPO with eval s | launch wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        sft, dpo = result["sft"], result["dpo"]
        lines.append(
            f"| {result['arm']} | {result['repeat']} | {_pct(sft['trained_score'])} / {_pct(sft['trained_correct'])} / "
            f"{_pct(sft['trained_reasons'])} | {_pct(dpo['trained_score'])} / {_pct(dpo['trained_correct'])} / "
            f"{_pct(dpo['trained_preferred'])} / {_pct(dpo['trained_reasons'])} | {sft['train_s']:.0f} "
            f"({sft['tokens_per_s']:.0f}) | {dpo['train_s']:.0f} ({dpo['tokens_per_s']:.0f}) | {sft['stage_s']:.0f} / "
            f"{dpo['stage_s']:.0f} | {result['wall_s']:.0f} |")
    return lines


def report(results: list[dict], num_samples: int) -> None:
    same = all(len({json.dumps(result[stage]["prompts"]) for result in results}) == 1 for stage in ("sft", "dpo"))
    print(f"\njudged test prompts per stage: {num_samples}, the same in every arm: {same}")
    print("\n".join(table(results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=0, help="SFT steps (0: the recipe's 1,000)")
    parser.add_argument("--dpo_steps", type=int, default=0, help="DPO steps (0: the recipe's 60)")
    parser.add_argument("--dpo_pairs", type=int, default=0,
                        help="DPO training pairs (0: all 2,400; fewer shortens the reference log-prob pass)")
    parser.add_argument("--num_samples", type=int, default=400, help="held-out test prompts judged (the recipe's 400)")
    parser.add_argument("--processes", type=int, default=1, help="processes per launch")
    parser.add_argument("--repeats", type=int, default=1, help="launches per arm, interleaved")
    parser.add_argument("--results_dir", type=Path, default=None)
    parser.add_argument("--read", action="store_true",
                        help="read the finished launches under --results_dir again instead of launching")
    args = parser.parse_args()
    if args.read:
        results = [{"arm": arm, "repeat": repeat, "wall_s": float("nan"), "sft": stage_numbers(run_dir / "sft"),
                    "dpo": stage_numbers(run_dir)}
                   for repeat in range(1, args.repeats + 1) for arm in ARMS
                   if (run_dir := args.results_dir / f"reasoning-{arm}-{repeat}").is_dir()]
        return report(results, args.num_samples)
    results_dir = args.results_dir or Path(tempfile.mkdtemp(prefix="reasoning_keep_drop_"))
    print(f"load average before: {os.getloadavg()}; run directories under {results_dir}", flush=True)
    results = []
    for repeat in range(1, args.repeats + 1):
        for arm in ARMS:
            results.append(launch(arm, repeat, args, results_dir))
            print(f"{arm} #{repeat}: {results[-1]['wall_s']:.0f} s wall, load average {os.getloadavg()}", flush=True)
    report(results, args.num_samples)


if __name__ == "__main__":
    main()
