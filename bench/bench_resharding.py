"""What converting a DeepSpeed ZeRO checkpoint for another number of processes costs (issue 58): time, bytes and the
peak resident memory of the conversion, at several model sizes, against the size of one rank's optimizer file and of
the whole state.

    python bench/bench_resharding.py --hidden 512 1024 --layers 8 --processes 2 --stage 3

For each size: a Llama of that width (vocabulary 8192, untied head) trained one step by `--processes` CPU processes
under DeepSpeed ZeRO-`--stage` (torch AdamW, fp32, gloo) and saved as the Trainer saves it (global_step1/, `latest`),
then converted by the toolkit's own path (src/run_safety/resharding.py `_convert`: DeepSpeed's ds_to_universal run as
its own command, its workers each reading one rank's file) while this process samples every process of the
conversion (psutil, every 20 ms): the largest resident set of any one of them and of all of them at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def save_checkpoint(directory: Path, hidden: int, layers: int, stage: int) -> None:
    """One rank of the job that trains one step and saves (run under torch.distributed.run)."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": hidden * hidden,
                              "stage3_prefetch_bucket_size": hidden * hidden,
                              "stage3_param_persistence_threshold": 10 * hidden}})
    tokens = torch.randint(0, 8192, (1, 32))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(directory), tag="global_step1")
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                            for p in model.parameters())}))


def sample_tree(stop: threading.Event, peaks: dict) -> None:
    """The largest resident set of any one process of this one's descendants, and of all of them at once."""
    import psutil

    me = psutil.Process()
    while not stop.is_set():
        total = 0
        for child in me.children(recursive=True):
            try:
                rss = child.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            peaks["one"] = max(peaks["one"], rss)
        peaks["all"] = max(peaks["all"], total)
        time.sleep(0.02)


def measure(hidden: int, layers: int, processes: int, stage: int, workdir: Path) -> dict:
    from src.run_safety.resharding import _convert

    checkpoint = workdir / f"h{hidden}" / "checkpoint-1"
    started = time.monotonic()
    saved = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(processes), __file__, "--save", str(checkpoint), "--hidden", str(hidden),
                            "--layers", str(layers), "--stage", str(stage)],
                           capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if saved.returncode:
        raise SystemExit(saved.stderr[-3000:])
    parameters = json.loads([line for line in saved.stdout.splitlines() if line.startswith("{")][-1])["parameters"]
    train_seconds = time.monotonic() - started
    files = sorted((checkpoint / "global_step1").glob("*optim_states.pt"))
    peaks, stop = {"one": 0, "all": 0}, threading.Event()
    sampler = threading.Thread(target=sample_tree, args=(stop, peaks), daemon=True)
    sampler.start()
    outcome = _convert(checkpoint, {"world_size": processes})
    stop.set()
    sampler.join()
    if isinstance(outcome, Exception):
        raise SystemExit(str(outcome))
    return {"hidden": hidden, "layers": layers, "parameters": parameters, "processes": processes, "stage": stage,
            "optimizer_files_bytes": sum(path.stat().st_size for path in files),
            "largest_rank_file_bytes": max(path.stat().st_size for path in files),
            "convert_seconds": outcome["seconds"], "universal_bytes": outcome["bytes"], "workers": outcome["workers"],
            "peak_one_process_bytes": peaks["one"], "peak_all_processes_bytes": peaks["all"],
            "train_and_save_seconds": round(train_seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)  # one rank of the job that saves
    args = parser.parse_args()
    if args.save:
        save_checkpoint(args.save, args.hidden[0], args.layers, args.stage)
        return
    with tempfile.TemporaryDirectory(prefix="bench-resharding-") as workdir:
        for hidden in args.hidden:
            print(json.dumps(measure(hidden, args.layers, args.processes, args.stage, Path(workdir))), flush=True)


if __name__ == "__main__":
    main()
