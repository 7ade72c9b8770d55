"""Stands in for `src.diagnostics.allreduce_worker` where no GPU exists, to drive `bandwidth.run_bench` through its
real child process, timeout, process-group kill and retry. It takes the same arguments and prints the same JSON
lines; FAKE_BENCH_BEHAVIOUR says what NCCL would do:

  ok              correct sums at a plausible NVLink speed
  hang_with_p2p   hangs (sleeps past any timeout) unless NCCL_P2P_DISABLE=1, then correct at SHM speed
  wrong_with_p2p  wrong sums unless NCCL_P2P_DISABLE=1
  crash           exits with an NCCL-like error on stderr
  hang_with_child starts a child that sleeps (its pid written to FAKE_BENCH_CHILD_PID_FILE), then hangs: the
                  timeout must kill the whole process group, as it must kill the ranks of the real worker
"""

import argparse
import json
import os
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend")
    parser.add_argument("--nprocs", type=int)
    parser.add_argument("--sizes")
    parser.add_argument("--init-file")
    parser.add_argument("--timeout", type=float)
    args = parser.parse_args()
    behaviour = os.environ.get("FAKE_BENCH_BEHAVIOUR", "ok")
    p2p_disabled = os.environ.get("NCCL_P2P_DISABLE") == "1"
    if behaviour == "hang_with_child":
        child = subprocess.Popen(["sleep", "3600"])
        with open(os.environ["FAKE_BENCH_CHILD_PID_FILE"], "w") as pid_file:
            pid_file.write(str(child.pid))
        time.sleep(3600)
    if behaviour == "crash":
        print("torch.distributed.DistBackendError: NCCL error: unhandled cuda error", file=sys.stderr)
        return 1
    if behaviour == "hang_with_p2p" and not p2p_disabled:
        time.sleep(3600)
    correct = not (behaviour == "wrong_with_p2p" and not p2p_disabled)
    bus_gbps = 20.0 if p2p_disabled else 350.0
    for size in (int(text) for text in args.sizes.split(",")):
        algbw_bytes = bus_gbps * 1e9 * args.nprocs / (2 * (args.nprocs - 1))
        print(json.dumps({"size_bytes": size, "iterations": 10, "seconds_per_iteration": size / algbw_bytes, "correct": correct}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
