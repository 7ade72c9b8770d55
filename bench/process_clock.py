"""Run `python -m src.main_distributed ARGS` with its timers on the process's CPU clock: a benchmark's budget in
CPU-seconds, which other jobs loading a shared machine do not stretch as they stretch wall-clock seconds.

    OMP_NUM_THREADS=1 python bench/process_clock.py --config configs/grpo.yaml --stage grpo ...

`time.monotonic` and `time.perf_counter` (every duration the toolkit and TRL log: metrics.jsonl's time_s, GRPO's
step_time, time/generation_s and time/judging_s, DPO's reference pass, a round's sampling and judging) become
`time.process_time`, the CPU time of the process's threads. With one compute thread (OMP_NUM_THREADS=1, which the
toolkit then leaves to torch), a CPU-second is the wall-clock second the same work takes on an idle core: a load from
other jobs takes the core away and so stops the clock, rather than stretching the step. What it leaves out: waiting on
the disk (a few loads and saves here) and the contention two jobs on one core still cause (shared caches, memory
bandwidth: small next to a time slice lost). Functions that bound a wait with a deadline read the same clock and
would wait longer (the standard library's own waits, threading's and subprocess's, bound the real clock when
imported, before the swap): none is on a one-process run's path (the run lock's wait for a previous holder, the node
watch of multi-node jobs). bench/bench_grpo_vs_dpo.py launches its arms through it.
"""

from __future__ import annotations

import queue  # noqa: F401  the standard library's waits keep the wall clock: imported (bound) before the swap
import runpy
import selectors  # noqa: F401
import subprocess  # noqa: F401
import sys
import threading  # noqa: F401
import time
from pathlib import Path

if __name__ == "__main__":
    time.monotonic = time.process_time
    time.perf_counter = time.process_time
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.argv[0] = "src.main_distributed"
    runpy.run_module("src.main_distributed", run_name="__main__", alter_sys=True)
