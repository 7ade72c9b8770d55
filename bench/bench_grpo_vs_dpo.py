"""GRPO against the on-policy DPO rounds and offline DPO on the embedded tasks with their checker, from the same SFT
model and for the same budget of training time, judged on the same held-out test prompts with paired 95% intervals;
and where a GRPO step's time goes (sampling, judging, training) at two sizes of --num_generations. docs/grpo.md
quotes its output (issue 39 point 4).

    nice -n 19 python bench/bench_grpo_vs_dpo.py --sft_model results/default/sft/model/final --budget 200 \
        --num_samples 300 --rounds 2 --probe_steps 6 --probe_prompts 32 --results_dir /tmp/grpo_vs_dpo
                                       # docs/grpo.md's run (36 min of wall time at load 6-11 on the shared 2 cores)
    ... the same command --arms grpo8 grpo4 rounds dpo grpo4_steps     # then: + GRPO, 4 per prompt, grpo8's steps
    nice -n 19 python bench/bench_grpo_vs_dpo.py --sft_steps 30 --budget 6 --num_samples 16   # a smoke run

1. **The SFT model**, once: the embedded default's SFT stage (configs/default.yaml's `sft:` block: 1,000 steps at
   2e-3, answers only) as its own one-process run, or --sft_model to reuse one (results/default/sft/model/final after
   ./run_distributed.sh).
2. **The arms**, each its recipe's final stage from that model, one process (`python -m src.main_distributed`):
     grpo8    configs/grpo.yaml --stage grpo: 32 answers per step = 4 prompts x 8, the checker's 3/1/0 reward
     grpo4    the same with --num_generations 4: 8 prompts x 4 answers per step
     grpo4_steps  grpo4 given grpo8's steps rather than its own probe's (the same work per step: 32 answers of the
              same lengths in one generate call; a check on a probe that the machine's load made slow); only asked
     rounds   configs/iterative_prompts.yaml --stage dpo: on-policy DPO rounds from the prompts alone (8 answers per
              prompt, the checker picks best against worst), --rounds R of --round_prompts P and --round_max_steps M
     dpo      configs/default.yaml --stage dpo: offline DPO on the 2,400 shipped pairs
3. **The same budget, fairly on a shared machine: CPU-seconds.** Every launch runs through bench/process_clock.py
   with one compute thread (OMP_NUM_THREADS=1): its timers (step times, GRPO's sampling and judging, DPO's reference
   pass, a round's sampling) read the process's CPU clock, so --budget is CPU-seconds of one core, which is the
   wall-clock seconds of an idle core and which other jobs loading the machine do not stretch (a wall-clock budget
   on a loaded machine gave each arm what the load of its probe's minute allowed: docs/grpo.md's first run gave GRPO-4
   a third of its steps). Each arm's cost is measured first in short probes, interleaved (grpo8, grpo4, rounds, dpo,
   repeated --probe_repeats times): CPU-seconds per optimizer step (the median gap between two logged steps:
   everything a step costs, GRPO's sampling and judging included), DPO's one-off reference pass, and a round's cost
   per prompt (sampling 8 answers, judging them, preparing the pairs and their reference pass). Each arm then gets
   the work that fits --budget at its probed rates: GRPO and DPO a number of steps, the rounds R rounds of P prompts
   and M steps. The table gives the budget, what each arm was given, and the training CPU-seconds each run actually
   took (the check on the probes), beside each launch's wall time. What finished is kept in <results_dir>/bench.json:
   the same command resumes, and with --arms adds an arm to the table.
4. **Judged on the same prompts**: every arm answers the first --num_samples test prompts greedily before (the SFT
   model) and after, judged by the embedded checker (correct and preferred: the score; correct alone). The prompts are
   checked to be the same in every arm. Gains are paired (bench/rounds_gain.py's `paired`: the mean per-prompt
   difference ± 1.96 x its standard deviation / sqrt(n)), from the SFT model and between arms.
5. **Where a GRPO step's time goes**: the full grpo8 and grpo4 runs' medians of step time, time/generation_s and
   time/judging_s (TRL's step_time and the toolkit's, logged every step); training is the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.rounds_gain import paired  # noqa: E402  (the paired 95% interval docs/rounds.md uses)

ARMS = {"grpo8": ["--config", "configs/grpo.yaml", "--stage", "grpo"],
        "grpo4": ["--config", "configs/grpo.yaml", "--stage", "grpo", "--num_generations", "4"],
        "grpo4_steps": ["--config", "configs/grpo.yaml", "--stage", "grpo", "--num_generations", "4"],
        "rounds": ["--config", "configs/iterative_prompts.yaml", "--stage", "dpo"],
        "dpo": ["--config", "configs/default.yaml", "--stage", "dpo"]}
LABELS = {"grpo8": "GRPO, 8 answers per prompt (configs/grpo.yaml)", "grpo4": "GRPO, 4 answers per prompt",
          "grpo4_steps": "GRPO, 4 answers per prompt, grpo8's steps",
          "rounds": "DPO rounds from the prompts (configs/iterative_prompts.yaml)",
          "dpo": "offline DPO (configs/default.yaml)"}
SFT = ["--stage", "sft", "--model_name_or_path", "embedded", "--dataset_name", "embedded", "--max_length", "64",
       "--learning_rate", "2e-3", "--warmup_steps", "0.05", "--lr_scheduler_type", "cosine",
       "--assistant_only_loss", "true", "--logging_steps", "10", "--eval_strategy", "no", "--num_samples", "0"]
# An arm given another's work instead of its own probe's: grpo4_steps does what grpo8 does per step (32 answers of the
# same lengths, one generate call), so it gets grpo8's steps (a check on a probe that load made slow)
SAME_WORK = {"grpo4_steps": "grpo8"}
QUIET = ["--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "1"]


def launch(run_name: str, flags: list[str], results: Path) -> tuple[Path, float, float]:
    """Runs one launch on the process clock (bench/process_clock.py), one compute thread; its wall seconds and its
    whole CPU-seconds (loading and the held-out answers included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    command = [sys.executable, str(ROOT / "bench/process_clock.py"), *flags, "--results_dir", str(results),
               "--run_name", run_name, "--overwrite"]
    started = time.monotonic()
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if finished.returncode:
        raise SystemExit(f"{' '.join(command)} exited {finished.returncode}:\n{finished.stdout[-2000:]}"
                         f"{finished.stderr[-3000:]}")
    return results / run_name, wall, cpu


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stage_dirs(run_dir: Path) -> list[Path]:
    """The run's stage directories in order: the rounds' (round1/, ..., the last round at the top) or the run's."""
    info = json.loads((run_dir / "training_info.json").read_text())
    return [run_dir / entry["run_dir"] for entry in info.get("rounds") or []] or [run_dir]


def step_times(stage_dir: Path) -> list[float]:
    """CPU-seconds per optimizer step: the gaps between logged steps (the first step, with its warm-up, left out)."""
    records = [record for record in _read(stage_dir / "metrics.jsonl") if "loss" in record and "time_s" in record]
    return [(later["time_s"] - earlier["time_s"]) / max(1, later["step"] - earlier["step"])
            for earlier, later in zip(records, records[1:])]


def reference_seconds(stage_dir: Path) -> float:
    info = json.loads((stage_dir / "training_info.json").read_text())
    return sum(item.get("seconds") or 0.0 for item in (info.get("reference_log_probs") or {}).values())


def training_seconds(arm: str, run_dir: Path) -> float:
    """The CPU-seconds the run spent on what the budget counts: its steps (a round's sampling and judging too), DPO's
    reference pass; not loading, nor the held-out answers judged before and after."""
    total = 0.0
    for stage_dir in _stage_dirs(run_dir):
        records = [record for record in _read(stage_dir / "metrics.jsonl") if "loss" in record and "time_s" in record]
        times = step_times(stage_dir)
        steps = records[-1]["step"] if records else 0
        total += steps * (statistics.median(times) if times else 0.0) + reference_seconds(stage_dir)
        record = stage_dir / "round.json"
        if record.exists():
            seconds = json.loads(record.read_text())["seconds"]
            total += seconds.get("sample_and_judge", 0.0) + seconds.get("prepare", 0.0)
    return total


def probe(arm: str, options, sft_model: str, results: Path, repeat: int) -> dict:
    flags = [*ARMS[arm], "--model_name_or_path", sft_model, "--num_samples", "0", *QUIET]
    if arm == "rounds":
        flags += ["--rounds", "1", "--round_prompts", str(options.probe_prompts), "--round_max_steps",
                  str(options.probe_steps)]
    else:
        flags += ["--max_steps", str(options.probe_steps)]
    run_dir, wall, _ = launch(f"probe-{arm}-{repeat}", flags, results)
    stage_dir = _stage_dirs(run_dir)[-1]
    outcome = {"step_s": statistics.median(step_times(stage_dir)), "wall_s": wall}
    if arm == "dpo":
        outcome["reference_s"] = reference_seconds(stage_dir)
    if arm == "rounds":
        record = json.loads((stage_dir / "round.json").read_text())
        seconds = record["seconds"]
        outcome["per_prompt_s"] = (seconds.get("sample_and_judge", 0.0) + seconds.get("prepare", 0.0)
                                   + reference_seconds(stage_dir)) / options.probe_prompts
    return outcome


def allocate(rates: dict, options) -> dict:
    """What fits --budget CPU-seconds at each arm's probed rates."""
    budget = options.budget
    plan = {arm: {"max_steps": max(1, round(budget / rates[arm]["step_s"]))} for arm in ("grpo8", "grpo4")
            if arm in rates}
    plan.update({arm: plan[same] for arm, same in SAME_WORK.items() if same in plan})
    if "dpo" in rates:  # its one-off reference pass over the pairs counts
        plan["dpo"] = {"max_steps": max(1, round((budget - rates["dpo"]["reference_s"]) / rates["dpo"]["step_s"]))}
    if "rounds" in rates:
        per_round = budget / options.rounds  # split between sampling the round's pairs and training on them
        prompts = int(options.sampling_share * per_round / rates["rounds"]["per_prompt_s"])
        steps = round((1 - options.sampling_share) * per_round / rates["rounds"]["step_s"])
        plan["rounds"] = {"rounds": options.rounds, "round_prompts": max(8, prompts), "round_max_steps": max(1, steps)}
    return plan


def full(arm: str, plan: dict, options, sft_model: str, results: Path) -> dict:
    flags = [*ARMS[arm], "--model_name_or_path", sft_model, "--num_samples", str(options.num_samples), *QUIET]
    flags += [item for key, value in plan.items() for item in (f"--{key}", str(value))]
    run_dir, wall, cpu = launch(f"{arm}", flags, results)
    stages = _stage_dirs(run_dir)
    first, last = (_read(stage / "samples_test.jsonl") for stage in (stages[0], stages[-1]))
    outcome = {"wall_s": wall, "train_s": training_seconds(arm, run_dir), "cpu_s": cpu, "load": os.getloadavg(),
               "prompts": [row["prompt"] for row in last], "before": first, "after": last}
    if arm.startswith("grpo"):
        records = [record for record in _read(run_dir / "metrics.jsonl") if "loss" in record][1:]
        outcome["split"] = {key: statistics.median(record[key] for record in records if key in record)
                            for key in ("step_time", "time/generation_s", "time/judging_s")}
    return outcome


def values(rows: list[dict], side: str, key: str) -> list[float]:
    return [float((row["verdict"] or {}).get(side, {}).get(key) or 0.0) for row in rows]


def report(outcomes: dict, plan: dict, rates: dict, options, sft_s: float) -> None:
    arms = list(outcomes)
    same = len({json.dumps(outcome["prompts"]) for outcome in outcomes.values()}) == 1
    n = len(outcomes[arms[0]]["prompts"])
    print(f"\n{datetime.date.today()}, load average {os.getloadavg()}; SFT model: {sft_s:.0f} s; budget "
          f"{options.budget:.0f} CPU-s of training per arm (one thread); judged test prompts: {n}, the same in every "
          f"arm: {same}")
    base = outcomes[arms[0]]["before"]
    for key in ("score", "correct"):
        print(f"\nSFT model ({key}): {100 * statistics.fmean(values(base, 'reference', key)):.1f}%")
    print("\n| arm | given (at its probed rate) | training CPU-s as run (probed CPU-s/step) | "
          "correct and preferred after | gain from SFT (95%) | correct after | gain from SFT (95%) |\n"
          "|---|---|---|---|---|---|---|")
    for arm, outcome in outcomes.items():
        given = ", ".join(f"{key} {value}" for key, value in plan[arm].items())
        cells = []
        for key in ("score", "correct"):
            after = values(outcome["after"], "trained", key)
            gain, half = paired(values(base, "reference", key), after)
            cells += [f"{100 * statistics.fmean(after):.1f}%", f"{100 * gain:+.1f} ± {100 * half:.1f} pts"]
        print(f"| {LABELS[arm]} | {given} | {outcome['train_s']:.0f} ({rates[arm]['step_s']:.3f}) | "
              + " | ".join(cells) + " |")
    lead = arms[0]
    print(f"\nPaired differences against {lead} (the same prompts, each arm's answer against {lead}'s):")
    for arm in arms[1:]:
        cells = []
        for key in ("score", "correct"):
            gain, half = paired(values(outcomes[arm]["after"], "trained", key),
                                values(outcomes[lead]["after"], "trained", key))
            cells.append(f"{key} {100 * gain:+.1f} ± {100 * half:.1f} pts")
        print(f"  {lead} - {arm}: {'; '.join(cells)}")
    print("\n| GRPO step (median, CPU-s) | step | sampling | judging | training (the rest) |\n|---|---|---|---|---|")
    for arm in ("grpo8", "grpo4", "grpo4_steps"):
        if arm in outcomes:
            split = outcomes[arm]["split"]
            step, sampling, judging = split["step_time"], split["time/generation_s"], split["time/judging_s"]
            train = step - sampling - judging
            print(f"| {LABELS[arm]} | {step:.3f} | {sampling:.3f} ({sampling / step:.0%}) | "
                  f"{judging:.4f} ({judging / step:.1%}) | {train:.3f} ({train / step:.0%}) |")
    print("\nper launch (loading and the held-out answers before and after included): "
          + ", ".join(f"{arm} {outcome['wall_s']:.0f} s wall, {outcome.get('cpu_s', 0):.0f} CPU-s, load average "
                      f"{outcome.get('load')}" for arm, outcome in outcomes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_model", default="", help="reuse this SFT model instead of training one")
    parser.add_argument("--sft_steps", type=int, default=1000, help="SFT steps (the default recipe's 1,000)")
    parser.add_argument("--budget", type=float, default=240.0,
                        help="CPU-seconds (one thread) of training per arm at probed rates")
    parser.add_argument("--num_samples", type=int, default=600, help="held-out test prompts judged (all 600)")
    parser.add_argument("--rounds", type=int, default=2, help="the rounds arm's rounds")
    parser.add_argument("--sampling_share", type=float, default=0.67,
                        help="the rounds arm's share of a round's budget spent sampling and judging (the recipe's, "
                        "docs/rounds.md: 198 s of 291 s in round 1)")
    parser.add_argument("--probe_steps", type=int, default=12,
                        help="steps per probe (a GRPO step's cost varies with its sampled answers' lengths: 6 steps "
                        "put GRPO-4's 11%% above GRPO-8's for the same work, docs/grpo.md)")
    parser.add_argument("--probe_prompts", type=int, default=64, help="prompts in the rounds arm's probe round")
    parser.add_argument("--probe_repeats", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=[arm for arm in ARMS if arm not in SAME_WORK], choices=list(ARMS))
    parser.add_argument("--results_dir", type=Path, default=None)
    options = parser.parse_args()
    results = options.results_dir or Path(tempfile.mkdtemp(prefix="bench_grpo_vs_dpo_"))
    print(f"load average before: {os.getloadavg()}; run directories under {results}", flush=True)
    sft_s = 0.0
    sft_model = options.sft_model
    if not sft_model and (results / "sft/model/final").is_dir():
        sft_model = str(results / "sft/model/final")  # a stopped bench's SFT model
    if not sft_model:
        run_dir, sft_s, _ = launch("sft", [*SFT, "--max_steps", str(options.sft_steps), "--save_steps",
                                        str(options.sft_steps)], results)
        sft_model = str(run_dir / "model/final")
        print(f"SFT: {sft_s:.0f} s -> {sft_model}", flush=True)
    saved = results / "bench.json"  # what finished, so that a stopped bench resumes (and --report reprints)
    state = json.loads(saved.read_text()) if saved.exists() else {"sft_s": sft_s, "probes": {}, "outcomes": {}}
    for repeat in range(options.probe_repeats):
        for arm in (arm for arm in options.arms if arm not in SAME_WORK):
            key = f"{arm}-{repeat}"
            if key not in state["probes"]:
                state["probes"][key] = probe(arm, options, sft_model, results, repeat)
                saved.write_text(json.dumps(state))
            print(f"probe {repeat + 1} {arm}: {state['probes'][key]}", flush=True)
    rates = {arm: {key: statistics.median(state["probes"][f"{arm}-{repeat}"][key]
                                          for repeat in range(options.probe_repeats))
                   for key in state["probes"][f"{arm}-0"]} for arm in ARMS if f"{arm}-0" in state["probes"]}
    rates.update({arm: rates[same] for arm, same in SAME_WORK.items() if same in rates})
    plan = state.setdefault("plan", {})
    plan.update({arm: given for arm, given in allocate(rates, options).items() if arm not in plan})
    print(f"plan for {options.budget:.0f} s each: {plan}", flush=True)
    for arm in options.arms:
        if arm not in state["outcomes"]:
            state["outcomes"][arm] = full(arm, plan[arm], options, sft_model, results)
            saved.write_text(json.dumps(state))
        outcome = state["outcomes"][arm]
        print(f"{arm}: {outcome['wall_s']:.0f} s wall, {outcome['train_s']:.0f} s training, "
              f"load average {os.getloadavg()}", flush=True)
    outcomes = {arm: state["outcomes"][arm] for arm in options.arms}
    sft_s = state["sft_s"]
    report(outcomes, plan, rates, options, sft_s)


if __name__ == "__main__":
    main()
