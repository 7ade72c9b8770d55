"""What one refresh of the live report costs, and what the 1% budget makes of it on runs of different lengths.

    python bench/bench_live_report.py                 # ~1 minute on 2 CPU cores
    python bench/bench_live_report.py --records 200 2000 --repeats 5

A refresh is `build_report(run_dir, live)` (src/reporting/live.py): six DPO charts and report.md. It is timed on
synthetic DPO histories (tests/report_fixtures.py) of a few sizes, since the charts grow with the number of logged
records (a 10-hour run logging every 10 steps keeps a few thousand). From the median time the table derives the
budget's consequence: LiveReport refreshes only while refreshing stays within 1% of the training time so far, so the
first refresh comes after ~100 refresh-times of training and the steady cadence is at most one per 100 refresh-times
(or every evaluation, if evaluations are further apart).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from report_fixtures import dpo_history, training_info, write_run_dir  # noqa: E402

from src.progress import format_duration  # noqa: E402
from src.reporting.live import MAX_SHARE  # noqa: E402
from src.reporting.report import build_report  # noqa: E402
from src.reporting.status import Live  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[200, 2000, 8000],
                        help="train records in the history (an eval record every 50)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_live_report_"))
    try:
        build_report(write_run_dir(root / "warmup", dpo_history(steps=20), training_info("dpo")))  # imports, fonts
        run_dirs = {records: write_run_dir(root / str(records), dpo_history(steps=records, finished=False),
                                           training_info("dpo", status="running", planned_steps=2 * records))
                    for records in args.records}
        times: dict[int, list[float]] = {records: [] for records in args.records}
        cpu: dict[int, list[float]] = {records: [] for records in args.records}
        for _ in range(args.repeats):  # interleaved: a load change on the machine hits every size alike
            for records, run_dir in run_dirs.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                build_report(run_dir, Live(step=records, total=2 * records, elapsed_s=3600.0, eta_s=3600.0))
                times[records].append(time.perf_counter() - started)
                cpu[records].append(time.process_time() - started_cpu)
        # The budget counts wall time: on a loaded machine a refresh takes longer and the cadence slows with it.
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; medians of {args.repeats}")
        print(f"{'train records':>14}  {'refresh (wall)':>15}  {'(CPU)':>8}  {'first refresh after, then':>26}")
        for records, measured in times.items():
            median = statistics.median(measured)
            print(f"{records:>14,}  {median:>13.2f} s  {statistics.median(cpu[records]):>6.2f} s  "
                  f"{'at most every ' + format_duration(median / MAX_SHARE):>26}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
