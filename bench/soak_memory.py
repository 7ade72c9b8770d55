"""A long run's resident memory, per worker: does any rank grow as the run goes on? (issue 41)

    python bench/soak_memory.py --steps 3000                    # ~15-30 min on 2 loaded CPU cores
    python bench/soak_memory.py --steps 3000 --probe 120        # + rank 0's heap every 120 s (slower: tracemalloc)

Launches `torchrun --nproc_per_node 2 -m src.main_distributed --stage dpo` on a tiny model built here (the tests'
2-layer Llama, 48 toy pairs), with the live report allowed PREFKIT_LIVE_REPORT_SHARE of the time and checkpoints,
evaluations and logs as often as the flags say (default: every 250, 500, 10 steps, as in the issue). Every
`--sample_every` seconds it reads each worker's resident set (psutil) and the step metrics.jsonl last recorded.
Training is cut into fifths by step; the table gives each rank's median resident memory per fifth, and the growth
from the third fifth to the last (what the soak test, tests/test_soak.py, holds under 2%). Start-up, the reference
pass and the end (saving, generation, the final report) are outside the fifths.

--probe N puts a sitecustomize.py on the workers' path that, on rank 0, every N seconds writes the live objects by
type (gc), Python's own allocations (tracemalloc, top lines and their growth since the first probe), and the
resident set before and after handing freed heap back to the OS (glibc malloc_trim): memory Python freed but the
allocator kept shows as the difference.
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

FIFTHS = 5

PROBE = '''
import os, threading
if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RUN_ID"):
    import collections, ctypes, gc, json, time, tracemalloc
    every, out = float(os.environ["SOAK_PROBE_EVERY"]), os.environ["SOAK_PROBE_OUT"]

    def rss_mb():
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def probe():
        first = None
        time.sleep(every)
        tracemalloc.start(4)  # after start-up: tracing the imports and the preparation would slow them many times
        while True:
            time.sleep(every)
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            first = first or snapshot
            counts = collections.Counter(type(item).__name__ for item in gc.get_objects())
            before = rss_mb()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            record = {"time": time.time(), "rss_mb": round(before, 1), "rss_after_trim_mb": round(rss_mb(), 1),
                      "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
                      "objects": dict(counts.most_common(25)),
                      "top": [str(stat) for stat in snapshot.statistics("lineno")[:12]],
                      "growth": [str(stat) for stat in snapshot.compare_to(first, "traceback")[:8]]}
            with open(out, "a") as handle:
                handle.write(json.dumps(record) + "\\n")

    threading.Thread(target=probe, daemon=True).start()
'''


def worker_processes(launcher) -> dict[int, object]:
    """The training workers started by `launcher` (torchrun), by rank."""
    import psutil

    workers = {}
    for child in launcher.children():  # the workers only: a refresh's forked child has their command line too
        try:
            if "src.main_distributed" in " ".join(child.cmdline()):
                workers[int(child.environ().get("RANK", -1))] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return workers


def last_record(metrics: Path) -> dict | None:
    """metrics.jsonl's last complete record (its tail only: the file grows with the run)."""
    try:
        with open(metrics, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 8192))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def soak(steps: int, work: Path, sample_every: float = 2.0, share: float = 0.05, logging_steps: int = 10,
         eval_steps: int = 500, save_steps: int = 250, probe_every: float | None = None,
         processes: int = 2) -> dict:
    """Run the job and sample it; returns {"samples": [...], "fifths": {rank: [MB, ...]}, "growth": {rank: %},
    "returncode": int, "log": path}."""
    import psutil
    from conftest import build_tiny_model, preference_rows, tiny_corpus, write_jsonl

    model = build_tiny_model(work / "model", tiny_corpus())
    pairs = write_jsonl(work / "pairs.jsonl", preference_rows(48))
    results = work / "results"
    environment = os.environ | {
        "OMP_NUM_THREADS": "1", "PREFKIT_LIVE_REPORT_SHARE": str(share), "HF_HOME": str(work / "hf_home"),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
        "PREFKIT_CACHE": str(work / "prefkit_cache"), "TOKENIZERS_PARALLELISM": "false"}
    if probe_every:
        (work / "probe").mkdir(exist_ok=True)
        (work / "probe" / "sitecustomize.py").write_text(PROBE)
        environment |= {"PYTHONPATH": os.pathsep.join([str(work / "probe"), environment.get("PYTHONPATH", "")]),
                        "SOAK_PROBE_EVERY": str(probe_every), "SOAK_PROBE_OUT": str(work / "probe.jsonl")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "-m", "src.main_distributed", "--stage", "dpo", "--model_name_or_path", str(model),
               "--dataset_name", str(pairs), "--results_dir", str(results), "--run_name", "soak",
               "--max_length", "64", "--batch_size", "8", "--max_steps", str(steps),
               "--logging_steps", str(logging_steps), "--eval_steps", str(eval_steps), "--save_steps", str(save_steps),
               "--num_samples", "4", "--max_new_tokens", "6", "--judge", "none", "--seed", "3",
               "--val_size", "4", "--test_size", "4"]
    log = work / "run.log"
    samples = []
    with open(log, "w") as output:
        job = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, env=environment)
        launcher = psutil.Process(job.pid)
        started = time.monotonic()
        while job.poll() is None:
            record = last_record(results / "soak" / "metrics.jsonl") or {}
            rss = {}
            for rank, process in worker_processes(launcher).items():
                try:
                    rss[rank] = process.memory_info().rss / 2**20
                except psutil.NoSuchProcess:
                    pass
            if rss:
                samples.append({"t": round(time.monotonic() - started, 1), "step": record.get("step", 0),
                                "ended": "train_runtime" in record, "rss_mb": rss})
            time.sleep(sample_every)
    return {"steps": steps, "returncode": job.returncode, "log": str(log), "samples": samples,
            **by_fifth(samples, steps, processes)}


def by_fifth(samples: list[dict], steps: int, processes: int) -> dict:
    """Each rank's median resident memory (MB) per fifth of training (by step), and its growth from the third fifth
    to the last (%). Samples before the first logged step and after training ended are left out."""
    training = []
    for sample in samples:
        if sample["ended"]:
            break
        if sample["step"] > 0:
            training.append(sample)
    fifths: dict[int, list[float | None]] = {}
    for rank in range(processes):
        values = [[] for _ in range(FIFTHS)]
        for sample in training:
            if rank in sample["rss_mb"]:
                values[min(FIFTHS - 1, (sample["step"] - 1) * FIFTHS // steps)].append(sample["rss_mb"][rank])
        fifths[rank] = [round(statistics.median(part), 1) if part else None for part in values]
    growth = {rank: (None if None in (medians[2], medians[-1]) else round(100 * (medians[-1] / medians[2] - 1), 2))
              for rank, medians in fifths.items()}
    return {"fifths": fifths, "growth_pct": growth}


def table(result: dict) -> str:
    lines = [f"{result['steps']:,} steps: resident memory per rank, median per fifth of training (MB)",
             f"{'rank':>5}  " + "  ".join(f"{'fifth ' + str(index + 1):>8}" for index in range(FIFTHS))
             + f"  {'3rd→5th':>8}"]
    for rank, medians in result["fifths"].items():
        growth = result["growth_pct"][rank]
        lines.append(f"{rank:>5}  " + "  ".join(f"{'-' if value is None else f'{value:.1f}':>8}" for value in medians)
                     + f"  {'-' if growth is None else f'{growth:+.2f}%':>8}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[3000], help="run lengths (optimizer steps), in turn")
    parser.add_argument("--sample_every", type=float, default=2.0, help="seconds between resident-memory samples")
    parser.add_argument("--share", type=float, default=0.05, help="PREFKIT_LIVE_REPORT_SHARE for the run")
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--eval_steps", type=int, default=500)
    parser.add_argument("--save_steps", type=int, default=250)
    parser.add_argument("--probe", type=float, default=None, metavar="SECONDS",
                        help="probe rank 0's heap every SECONDS (written to <work>/probe.jsonl)")
    parser.add_argument("--work", default=None, help="directory for the model, data and run (default: a new temp dir)")
    parser.add_argument("--json", default=None, help="write every sample and the table's numbers here")
    args = parser.parse_args()
    outcomes = []
    for steps in args.steps:
        work = Path(args.work or tempfile.mkdtemp(prefix="soak_memory_")) / f"steps{steps}"
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        result = soak(steps, work, args.sample_every, args.share, args.logging_steps, args.eval_steps,
                      args.save_steps, args.probe)
        print(table(result))
        print(f"(exit {result['returncode']}, {time.monotonic() - started:.0f} s, {len(result['samples'])} samples, "
              f"log {result['log']}, load average {os.getloadavg()[0]:.1f})", flush=True)
        outcomes.append(result)
        if args.json:
            Path(args.json).write_text(json.dumps(outcomes, indent=1))
    return 0 if all(outcome["returncode"] == 0 for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
