"""Data preparation at scale: this toolkit's (src/data/) against TRL's own (DPOTrainer's `_prepare_dataset`), time
and peak memory against the number of UltraFeedback-shaped preference pairs, on one process and on all cores.

    python bench/bench_prepare.py                               # 10k and 50k pairs, all four arms
    python bench/bench_prepare.py --sizes 10000 50000 200000 --arms toolkit-all
    python bench/bench_prepare.py --arms toolkit-1 --file_kinds jsonl jsonl.gz arrow --repeats 3   # the file's kind

Every (size, arm) runs in a fresh Python process that loads the same JSON Lines file (bench/ultrafeedback_like.py,
generated once per size) and tokenizes it for DPO with the same tokenizer (a byte-level BPE trained here; the
tokenizer's speed matters, not its quality). Peak memory is the largest resident set of any one process of the arm
(the parent, or a `datasets` worker), from getrusage. Time is wall time of the preparation call alone, imports and
the model build of the TRL arm excluded. The arms of one size run one after another, sizes in the order given; on a
shared machine run the sizes you compare in one invocation and read the numbers as the load they ran under.
`--file_kinds` gives the toolkit arms the same pairs as other files datasets reads (gzip-compressed JSON Lines, an
Arrow IPC stream), made from the JSON Lines file once; TRL's arms read the JSON Lines file. `--repeats N` runs the
kinds and arms of a size N times, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "tests")]

ARMS = ("toolkit-1", "toolkit-all", "trl-1", "trl-all")


def _peak_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def run_arm(arm: str, data_file: Path, workdir: Path, max_length: int) -> dict:
    """In this (fresh) process: prepare `data_file` the arm's way; return time and peak memory."""
    import datasets

    from conftest import build_tiny_model

    from ultrafeedback_like import WORDS

    datasets.disable_progress_bars()
    from src.resource_limits import usable_cores

    num_proc = 1 if arm.endswith("-1") else usable_cores()  # what the toolkit's default picks
    model_dir = build_tiny_model(workdir / "model", [" ".join(WORDS)] * 8)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if arm.startswith("toolkit"):
        from src.config import DataArguments, SFTArguments
        from src.data import prepare_data

        import trl.data_utils  # noqa: F401  (imports done before the clock starts, as for TRL below)
        started = time.perf_counter()
        prepared = prepare_data(DataArguments(dataset_name=str(data_file), max_length=max_length, val_size=0.01,
                                              test_size=0.01, dataset_num_proc=num_proc),
                                SFTArguments(), "dpo", 0, tokenizer, workdir / "cache")
        rows = sum(len(split) for split in prepared.splits.values())
    else:
        from transformers import AutoModelForCausalLM
        from trl import DPOConfig, DPOTrainer

        dataset = datasets.load_dataset("json", data_files=str(data_file), split="train",
                                        cache_dir=str(workdir / "hf"))
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        args = DPOConfig(output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, report_to=[],
                         max_length=max_length, dataset_num_proc=num_proc, activation_checkpointing=False)
        started = time.perf_counter()
        # Loading the JSON is inside the toolkit's clock: count it here too (from datasets' cache: the same work).
        dataset = datasets.load_dataset("json", data_files=str(data_file), split="train",
                                        cache_dir=str(workdir / "hf2"))
        # TRL reads UltraFeedback as trl-lib/ultrafeedback_binarized has it: the chats alone (prompt inside them).
        dataset = dataset.select_columns(["chosen", "rejected"])
        trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        rows = len(trainer.train_dataset)
    seconds = time.perf_counter() - started
    return {"arm": arm, "num_proc": num_proc, "rows": rows, "seconds": seconds, "peak_mb": _peak_mb()}


FILE_KINDS = ("jsonl", "jsonl.gz", "arrow")


def as_file_kind(jsonl: Path, kind: str) -> Path:
    """The pairs of `jsonl` as a file of `kind` beside it (made once)."""
    target = jsonl.with_suffix("." + kind)
    if kind == "jsonl" or target.exists():
        return target
    if kind == "jsonl.gz":
        import gzip
        import shutil

        with open(jsonl, "rb") as source, gzip.open(target, "wb", compresslevel=6) as compressed:
            shutil.copyfileobj(source, compressed)
    else:  # an Arrow IPC stream, as datasets writes its cache files
        import pyarrow as pa
        import pyarrow.json

        table = pyarrow.json.read_json(jsonl)
        with pa.ipc.new_stream(str(target), table.schema) as writer:
            writer.write_table(table)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--prompt_words", type=float, default=60, help="Median prompt length in words.")
    parser.add_argument("--answer_words", type=float, default=180, help="Median answer length in words.")
    parser.add_argument("--file_kinds", nargs="+", default=["jsonl"], choices=FILE_KINDS,
                        help="The toolkit arms' data file: the same pairs as JSON Lines, gzip-compressed, or Arrow.")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None, help="Append each result as a JSON line here.")
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--data_file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:  # child mode
        print(json.dumps(run_arm(args.arm, args.data_file, args.workdir, args.max_length)))
        return
    from ultrafeedback_like import write

    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "PYTHONUNBUFFERED": "1"}
    print(f"{'pairs':>8} {'file':<9} {'arm':<12} {'procs':>5} {'seconds':>8} {'pairs/s':>8} {'peak MB':>8}")
    for size in args.sizes:
        jsonl = root / f"pairs-{size}-{args.prompt_words:g}-{args.answer_words:g}.jsonl"
        if not jsonl.exists():
            write(jsonl, size, prompt_words=args.prompt_words, answer_words=args.answer_words)
        runs = [(kind, arm) for kind in args.file_kinds for arm in args.arms
                if kind == "jsonl" or arm.startswith("toolkit")]
        for kind, arm in runs * args.repeats:
            data_file = as_file_kind(jsonl, kind)
            workdir = root / f"{size}-{kind}-{arm}"
            output = subprocess.run([sys.executable, __file__, "--arm", arm, "--data_file", str(data_file),
                                     "--workdir", str(workdir), "--max_length", str(args.max_length)],
                                    env=env | {"HF_HOME": str(workdir / "hf_home")},  # no run reads another's cache
                                    capture_output=True, text=True)
            if output.returncode:
                print(f"{size:>8} {kind:<9} {arm:<12} failed: {output.stderr.strip().splitlines()[-1:]}")
                continue
            result = json.loads(output.stdout.strip().splitlines()[-1]) | {"pairs": size, "file": kind}
            print(f"{size:>8} {kind:<9} {arm:<12} {result['num_proc']:>5} {result['seconds']:>8.1f} "
                  f"{size / result['seconds']:>8.0f} {result['peak_mb']:>8.0f}", flush=True)
            if args.results:
                with open(args.results, "a") as handle:
                    handle.write(json.dumps(result) + "\n")
            subprocess.run(["rm", "-rf", str(workdir)])


if __name__ == "__main__":
    main()
