"""What one refresh of the live report costs as the run grows, and what it leaves in rank 0's memory.

    python bench/bench_live_report.py                        # ~2 minutes on 2 loaded CPU cores
    python bench/bench_live_report.py --records 900 2700 --repeats 5
    python bench/bench_live_report.py --memory               # rank 0's resident memory as the history grows

A refresh is the live report's `build_report(run_dir, live)` (src/reporting/live.py): six DPO charts and report.md,
on synthetic DPO histories (tests/report_fixtures.py). 900 and 2,700 train records are a run of 9,000 and 27,000
steps logging every 10 (issue 41). Two arms, interleaved (the machine is shared: a load change hits both alike):
`child`, as the live report refreshes (build_report_apart: drawn in a process forked for it), and `in rank 0`
(build_report in the training process itself, as before issue 41). From the child's median the table derives the
budget's consequence: LiveReport refreshes only while refreshing stays within 1% of the training time so far, so the
steady cadence is at most one per 100 refresh-times.

--memory: one fresh process per arm appends the history in steps to a run directory and refreshes three times at each
size; the table gives that process's resident memory after the refreshes, and after handing freed heap back to the OS
(glibc malloc_trim): what the drawing left behind in the process that refreshed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from report_fixtures import dpo_history, training_info, write_run_dir  # noqa: E402

from src.progress import format_duration  # noqa: E402
from src.reporting.live import MAX_SHARE, build_report_apart  # noqa: E402
from src.reporting.report import build_report  # noqa: E402
from src.reporting.status import Live  # noqa: E402
from src.run_files import METRICS, append_jsonl  # noqa: E402

ARMS = {"child": build_report_apart, "in rank 0": build_report}


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_s() -> float:
    """CPU of this process and of its children that have exited (the refreshes' children)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def timing(records_list: list[int], repeats: int, root: Path) -> None:
    build_report(write_run_dir(root / "warmup", dpo_history(steps=20), training_info("dpo")))  # imports, fonts
    run_dirs = {records: write_run_dir(root / str(records), dpo_history(steps=records, finished=False),
                                       training_info("dpo", status="running", planned_steps=2 * records))
                for records in records_list}
    wall = {(arm, records): [] for arm in ARMS for records in records_list}
    cpu = {(arm, records): [] for arm in ARMS for records in records_list}
    for _ in range(repeats):  # interleaved: a load change on the machine hits every arm and size alike
        for records, run_dir in run_dirs.items():
            for arm, build in ARMS.items():
                started, started_cpu = time.perf_counter(), cpu_s()
                build(run_dir, Live(step=records, total=2 * records, elapsed_s=3600.0, eta_s=3600.0))
                wall[arm, records].append(time.perf_counter() - started)
                cpu[arm, records].append(cpu_s() - started_cpu)
    # The budget counts wall time: on a loaded machine a refresh takes longer and the cadence slows with it.
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; medians of {repeats}")
    print(f"{'train records':>14}  {'arm':>10}  {'refresh (wall)':>15}  {'(CPU)':>8}  {'at most every':>14}")
    for (arm, records), measured in wall.items():
        median = statistics.median(measured)
        print(f"{records:>14,}  {arm:>10}  {median:>13.2f} s  {statistics.median(cpu[arm, records]):>6.2f} s  "
              f"{format_duration(median / MAX_SHARE):>14}")
    for arm in ARMS:
        first, last = (statistics.median(wall[arm, records]) for records in (records_list[0], records_list[-1]))
        print(f"{arm}: {records_list[-1]:,} records x{last / first:.2f} the time of {records_list[0]:,}")


def memory_arm(arm: str, sizes: list[int], root: Path) -> list[dict]:
    """In this process: the history appended up to each size, three refreshes, the resident memory after."""
    history = dpo_history(steps=sizes[-1], finished=False)
    run_dir = write_run_dir(root, history[:sizes[0]], training_info("dpo", status="running",
                                                                    planned_steps=2 * sizes[-1]))
    written, rows = sizes[0], []
    for size in sizes:
        for record in history[written:size]:
            append_jsonl(run_dir / METRICS, record)
        written = size
        for _ in range(3):
            ARMS[arm](run_dir, Live(step=size, total=2 * sizes[-1], elapsed_s=3600.0, eta_s=3600.0))
        after = rss_mb()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rows.append({"records": size, "rss_mb": round(after, 1), "after_trim_mb": round(rss_mb(), 1)})
    return rows


def memory(sizes: list[int], root: Path) -> None:
    results = {}
    for arm in ARMS:  # a fresh process each: what one arm left in its heap must not count against the other
        output = subprocess.run([sys.executable, __file__, "--memory_arm", arm, "--records", *map(str, sizes),
                                 "--root", str(root / arm.replace(" ", "_"))], capture_output=True, text=True,
                                check=True).stdout
        results[arm] = json.loads(output.strip().splitlines()[-1])
    print("resident memory (MB) of the process that refreshes, after 3 refreshes at each size / after malloc_trim")
    print(f"{'train records':>14}  " + "  ".join(f"{arm:>20}" for arm in ARMS))
    for index, size in enumerate(sizes):
        print(f"{size:>14,}  " + "  ".join(
            f"{results[arm][index]['rss_mb']:>10.1f} / {results[arm][index]['after_trim_mb']:>7.1f}" for arm in ARMS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=None,
                        help="train records in the history (an eval record every 50); default 900 2700, and with "
                             "--memory 300 600 900 1350 1800 2250 2700")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="rank 0's resident memory instead of the time")
    parser.add_argument("--memory_arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_arm:
        print(json.dumps(memory_arm(args.memory_arm, args.records, Path(args.root))))
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench_live_report_"))
    try:
        if args.memory:
            memory(args.records or [300, 600, 900, 1350, 1800, 2250, 2700], root)
        else:
            timing(args.records or [900, 2700], args.repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
