"""What a launch pays before any work: the launcher's preflight on a warm cache and a training process's start, this
tree against an earlier commit, at two data sizes, arms interleaved.

    python bench/bench_startup.py                                   # against b21fccb, 2,000 and 20,000 pairs, 3 repeats
    python bench/bench_startup.py --base HEAD~3 --sizes 1000 50000 --repeats 5

Each arm is a source tree (the base commit exported with `git archive` into a temporary directory, and this working
tree) with its own prepared-data cache, warmed by one untimed preflight per size. Per (repeat, size, arm):
- `preflight`: `./run_distributed.sh --dry_run ...` on the warm cache, wall time and CPU (user + sys of every process);
- `start`: `python -m src.main_distributed` training DPO for one step (no reference pass: its cost grows with the
  data and is no start cost), from the launch to its first line in metrics.jsonl (the first step done), and the whole
  process's CPU (to its exit, one step and its files included).
- `audit`: `python -m src.audit --dataset_name F` (the data alone: no model part, no judge), on the warm cache and on
  a cold one (a copy of the file with a new modification time: prepared again).
The data is bench/ultrafeedback_like.py's pairs, short (prompts ~12 words, answers ~20), with the embedded model.
Medians over the repeats; the ratio is this tree over the base. A shared machine: compare arms of one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import ultrafeedback_like  # noqa: E402


def run_measured(command: list[str], cwd: Path, env: dict, first_line_of: Path | None = None,
                 ok: tuple[int, ...] = (0,)) -> tuple[float, float, float | None]:
    """(wall s, CPU s of the process and its children, s until `first_line_of` had a line); exit statuses in `ok`."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if first is None and first_line_of is not None and first_line_of.exists() and first_line_of.stat().st_size:
            first = time.monotonic() - started
        if pid:
            break
        time.sleep(0.02)
    wall = time.monotonic() - started
    if os.waitstatus_to_exitcode(status) not in ok:
        raise SystemExit(f"{' '.join(command)} (in {cwd}) failed:\n{process.stderr.read().decode()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="b21fccb", help="the commit to compare against")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000], help="preference pairs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, help="a directory of an earlier run to reuse (its data and warm caches)")
    options = parser.parse_args()

    work = options.work or Path(tempfile.mkdtemp(prefix="bench_startup."))
    base = work / "base"
    if not base.exists():
        base.mkdir()
        archive = subprocess.run(["git", "archive", options.base], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    arms = {"base": base, "this": ROOT}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", HF_HOME=str(work / "hf_home"))
    data = {size: work / f"pairs-{size}.jsonl" for size in options.sizes}
    for size, path in data.items():
        if not path.exists():  # an existing file keeps its modification time: the warm caches stay valid
            ultrafeedback_like.write(path, size, prompt_words=12, answer_words=20)
    common = ["--model_name_or_path", "embedded", "--stage", "dpo", "--max_length", "128", "--judge", "none"]

    def arm_env(arm: str) -> dict:
        return dict(env, PREFKIT_CACHE=str(work / f"cache-{arm}"))

    def preflight(arm: str, size: int) -> list[str]:
        return ["./run_distributed.sh", "--dry_run", *common, "--dataset_name", str(data[size]),
                "--results_dir", str(work / f"results-{arm}"), "--run_name", f"dry-{size}"]

    for size in options.sizes:  # warm each arm's cache: the embedded model and the prepared data
        for arm, tree in arms.items():
            run_measured(preflight(arm, size), tree, arm_env(arm))

    results: dict[tuple[str, int, str], list[float]] = {}
    for repeat in range(options.repeats):
        for size in options.sizes:
            for arm, tree in arms.items():
                wall, cpu, _ = run_measured(preflight(arm, size), tree, arm_env(arm))
                results.setdefault(("preflight wall", size, arm), []).append(wall)
                results.setdefault(("preflight CPU", size, arm), []).append(cpu)
                run_dir = work / f"results-{arm}" / f"start-{size}-{repeat}"
                train = [sys.executable, "-m", "src.main_distributed", *common, "--dataset_name", str(data[size]),
                         "--results_dir", str(run_dir.parent), "--run_name", run_dir.name, "--max_steps", "1",
                         "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--num_samples",
                         "0", "--precompute_ref_log_probs", "false"]
                wall, cpu, first = run_measured(train, tree, arm_env(arm), first_line_of=run_dir / "metrics.jsonl")
                results.setdefault(("start to 1st step", size, arm), []).append(first)
                results.setdefault(("training process CPU", size, arm), []).append(cpu)
                for cache in ("warm", "cold"):
                    audited = data[size]
                    if cache == "cold":  # the same rows, a file the cache has not seen
                        audited = work / f"audit-cold-{size}.jsonl"
                        audited.write_bytes(data[size].read_bytes())
                    audit = [sys.executable, "-m", "src.audit", "--dataset_name", str(audited), "--max_length", "128",
                             "--judge", "none", "--results_dir", str(work / f"results-{arm}"), "--run_name",
                             f"audit-{size}"]
                    wall, cpu, _ = run_measured(audit, tree, arm_env(arm), ok=(0, 1))  # 1: a warning fired
                    results.setdefault((f"audit wall ({cache} cache)", size, arm), []).append(wall)
                    results.setdefault((f"audit CPU ({cache} cache)", size, arm), []).append(cpu)
                print(f"repeat {repeat + 1}, {size} pairs, {arm}: " + ", ".join(
                    f"{measure} {values[-1]:.2f}" for (measure, at_size, at_arm), values in results.items()
                    if (at_size, at_arm) == (size, arm)), file=sys.stderr)

    print(f"\nmedian of {options.repeats}, seconds; base = {options.base}, this = the working tree; "
          f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| measure | pairs | base | this | this / base |")
    print("|---|---:|---:|---:|---:|")
    for measure in ("preflight wall", "preflight CPU", "start to 1st step", "training process CPU",
                    "audit wall (warm cache)", "audit CPU (warm cache)", "audit wall (cold cache)",
                    "audit CPU (cold cache)"):
        for size in options.sizes:
            before = statistics.median(results[(measure, size, "base")])
            after = statistics.median(results[(measure, size, "this")])
            print(f"| {measure} | {size:,} | {before:.2f} | {after:.2f} | x{after / before:.2f} |")


if __name__ == "__main__":
    main()
