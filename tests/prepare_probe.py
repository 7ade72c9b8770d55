"""Prepare `rows` generated UltraFeedback-shaped pairs in this process and print its peak RSS, the time it took and a
digest of the prepared training rows: the memory test runs it in a fresh process per size, so one size's peak cannot
hide another's; the killed-preparation test compares a relaunch with a preparation left alone.

    python tests/prepare_probe.py WORKDIR ROWS [NUM_PROC]
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "bench")]

from conftest import build_tiny_tokenizer  # noqa: E402
from ultrafeedback_like import WORDS, write  # noqa: E402


def main(workdir: Path, count: int, num_proc: int) -> None:
    import datasets

    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data

    datasets.disable_progress_bars()
    tokenizer = build_tiny_tokenizer([" ".join(WORDS)] * 4)
    path = write(workdir / f"pairs-{count}.jsonl", count, prompt_words=4, answer_words=6, cap=16)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    prepared = prepare_data(DataArguments(dataset_name=str(path), max_length=256, val_size=100, test_size=100,
                                          dataset_num_proc=num_proc), SFTArguments(), "dpo", 0, tokenizer,
                            workdir / f"cache-{count}")
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest = hashlib.blake2b(json.dumps(prepared.train[:], sort_keys=True, default=str).encode()).hexdigest()
    print(json.dumps({"rows": count, "kept": len(prepared.train), "baseline_mb": baseline / 1024,
                      "peak_mb": peak / 1024, "seconds": seconds, "train_digest": digest}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
