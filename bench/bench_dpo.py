"""This toolkit's DPO vs plain `trl dpo` (TRL's own CLI), cold vs warm reference log-prob cache, 1 vs 2 processes.

    python bench/bench_dpo.py                  # ~10 minutes on 2 CPU cores; --repeats 1 --steps 10 for a quick look
    python bench/bench_dpo.py --hidden 768 --layers 12 --steps 40    # bigger, on a GPU machine

Same model (a Llama built locally: ~28M parameters by default, so that compute and not Python dominates a step),
same data (synthetic preference pairs of varied length), same hyperparameters (global batch, learning rate, steps,
max length, fp32 on CPU / bf16 on GPU, no gradient checkpointing) for every arm. The arms run interleaved, repeat
after repeat, so a load change on the machine hits them alike; the table reports medians.

samples/s counts preference pairs over the time spent on them: for plain TRL its training time (the reference model
runs inside every step); for the toolkit its training time plus the time it spent computing reference log-probs
before training (zero when the cache is warm). tokens/s counts the real tokens of chosen and rejected sequences.
Peak memory is the largest resident set of any process of the arm (on GPU: see training_info.json's perf figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("alpha beta gamma delta river stone cloud light shadow north south east west green blue amber quiet "
         "rapid gentle bright silver golden forest ocean mountain valley window garden market letter answer "
         "question reason simple careful honest useful clear short long first second third maybe always never "
         "because although therefore however often rarely today tomorrow yesterday morning evening night").split()


def build_assets(root: Path, hidden: int, layers: int, pairs: int, seed: int = 0) -> tuple[Path, Path]:
    """The benchmark's model (random weights, a BPE tokenizer trained on the data) and its data directory."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(seed)
    sentence = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    rows = [{"prompt": sentence(8, 40) + " ?", "chosen": " " + sentence(10, 50) + " .",
             "rejected": " " + sentence(10, 50) + " ."} for _ in range(pairs)]
    data_dir = root / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = [row[key] for row in rows for key in ("prompt", "chosen", "rejected")]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<pad>", "</s>", "<unk>"],
                                                              show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                      unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(wrapped), hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=wrapped.eos_token_id, pad_token_id=wrapped.pad_token_id)
    torch.manual_seed(seed)
    model_dir = root / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    wrapped.save_pretrained(model_dir)
    return model_dir, data_dir


def timed(command: list[str], env: dict, log: Path) -> tuple[float, float, str]:
    """Run a command; (wall seconds, peak RSS MB of its process tree, output)."""
    started = time.perf_counter()
    wrapped = ["/usr/bin/time", "-f", "PEAK_RSS_KB=%M", *command] if Path("/usr/bin/time").exists() else command
    result = subprocess.run(wrapped, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    output = result.stdout + result.stderr
    log.write_text(output)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[:6])} ... failed (exit {result.returncode}); see {log}")
    peak = re.search(r"PEAK_RSS_KB=(\d+)", output)
    return wall, int(peak.group(1)) / 1024 if peak else float("nan"), output


def trl_dpo(args, model: Path, data: Path, out: Path, log: Path, env: dict) -> dict:
    """Plain TRL: its own CLI (accelerate launch underneath), one process."""
    command = ["trl", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
               "--per_device_train_batch_size", str(args.batch_size), "--max_steps", str(args.steps),
               "--learning_rate", "1e-5", "--max_length", str(args.max_length), "--logging_steps", "1",
               "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none", "--seed", "0",
               "--activation_checkpointing", "false", "--bf16", "false", "--use_cpu", "true",
               "--dataloader_num_workers", "0", "--disable_tqdm", "true"]
    wall, peak, output = timed([str(Path(sys.executable).parent / command[0]), *command[1:]], env, log)
    logs = [json.loads(line.replace("'", '"')) for line in re.findall(r"^\{'loss'.*\}$", output, re.M)]
    final = json.loads(re.findall(r"^\{'train_runtime'.*\}$", output, re.M)[-1].replace("'", '"'))
    seconds = float(final["train_runtime"])
    tokens = float(logs[-1]["num_tokens"])
    return {"samples/s": args.steps * args.batch_size / seconds, "tokens/s": tokens / seconds, "wall s": wall,
            "peak MB": peak, "losses": [float(record["loss"]) for record in logs]}


def toolkit(args, model: Path, data: Path, results: Path, cache: Path, processes: int, log: Path, env: dict) -> dict:
    run_name = f"bench-{processes}p-{time.monotonic_ns()}"
    flags = ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
             str(results), "--run_name", run_name, "--batch_size", str(args.batch_size), "--max_steps",
             str(args.steps), "--learning_rate", "1e-5", "--lr_scaling", "none", "--max_length", str(args.max_length),
             "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--num_samples", "0",
             "--judge", "none", "--seed", "0", "--val_size", "0", "--test_size", "0", "--lr_scheduler_type", "linear"]
    command = (["bash", "run_distributed.sh", str(processes), *flags] if processes > 1
               else [sys.executable, "-m", "src.main_distributed", *flags])
    wall, peak, _ = timed(command, env | {"PREFKIT_CACHE": str(cache), "PYTHON": sys.executable}, log)
    run_dir = results / run_name
    info = json.loads((run_dir / "training_info.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = next(record for record in reversed(metrics) if "train_runtime" in record)
    train = [record for record in metrics if "loss" in record]
    precompute = sum(part["seconds"] for part in info.get("reference_log_probs", {}).values())
    seconds = float(final["train_runtime"]) + precompute
    shutil.rmtree(run_dir / "model", ignore_errors=True)
    return {"samples/s": args.steps * args.batch_size / seconds, "tokens/s": train[-1]["num_tokens"] / seconds,
            "wall s": wall, "peak MB": peak, "losses": [record["loss"] for record in train],
            "reference": ",".join(part["cache"] for part in info.get("reference_log_probs", {}).values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, help="default: steps x batch_size, one epoch, so the reference pass of a "
                        "cold cache covers exactly the pairs trained on")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch (pairs per optimizer step)")
    parser.add_argument("--max_length", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", help="keep the work directory here (default: a temporary one, deleted)")
    args = parser.parse_args()
    args.pairs = args.pairs or args.steps * args.batch_size

    work = Path(args.keep or tempfile.mkdtemp(prefix="prefkit_bench_"))
    # One-process arms get every core, the same for both: `accelerate launch` (under `trl dpo`) would otherwise pin
    # TRL to OMP_NUM_THREADS=1 while torch alone takes every core. run_distributed.sh splits the cores between its
    # processes itself, so the 2-process arm drops the variable.
    cores = len(os.sched_getaffinity(0))
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} | {
        "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false"}
    one_process_env = env | {"OMP_NUM_THREADS": str(cores)}
    model, data = build_assets(work / "assets", args.hidden, args.layers, args.pairs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    parameters = sum(shape for shape in [config.vocab_size * config.hidden_size + config.num_hidden_layers * (
        4 * config.hidden_size ** 2 + 3 * config.hidden_size * config.intermediate_size)])
    print(f"model: {parameters / 1e6:.1f}M parameters ({args.layers} layers x {args.hidden}); {args.pairs} pairs; "
          f"{args.steps} steps of {args.batch_size} pairs; max_length {args.max_length}; {args.repeats} repeats; "
          f"{cores} CPU cores (one-process arms: {cores} threads); load average at start {os.getloadavg()[0]:.2f}",
          flush=True)

    arms = {"trl dpo (TRL CLI)": [], "toolkit, cold cache": [], "toolkit, warm cache": [],
            "toolkit, warm cache, 2 processes": []}
    warm_cache = work / "warm-cache"
    for repeat in range(args.repeats):
        for name in arms:
            log = work / f"log-{repeat}-{name.split(',')[0].replace(' ', '_')}-{len(arms[name])}.txt"
            if name.startswith("trl"):
                result = trl_dpo(args, model, data, work / "trl-out", log, one_process_env)
            elif "cold" in name:
                cold_cache = work / f"cold-cache-{repeat}"
                result = toolkit(args, model, data, work / "results", cold_cache, 1, log, one_process_env)
                if not warm_cache.exists():
                    shutil.copytree(cold_cache, warm_cache)  # the warm arms reuse what a cold run computed
            else:
                processes = 2 if "2 processes" in name else 1
                result = toolkit(args, model, data, work / "results", warm_cache, processes, log,
                                 env if processes > 1 else one_process_env)
            arms[name].append(result)
            print(f"  repeat {repeat + 1}: {name:<34} {result['samples/s']:6.2f} samples/s  "
                  f"{result['wall s']:6.1f} s wall  {result['peak MB']:7.0f} MB", flush=True)

    baseline = statistics.median(result["samples/s"] for result in arms["trl dpo (TRL CLI)"])
    print("\n| arm | samples/s | tokens/s | wall s | peak MB | samples/s vs trl dpo |")
    print("|---|---|---|---|---|---|")
    for name, results in arms.items():
        median = {key: statistics.median(result[key] for result in results)
                  for key in ("samples/s", "tokens/s", "wall s", "peak MB")}
        print(f"| {name} | {median['samples/s']:.2f} | {median['tokens/s']:.0f} | {median['wall s']:.1f} | "
              f"{median['peak MB']:.0f} | {median['samples/s'] / baseline:.2f}x |")
    cold, warm = arms["toolkit, cold cache"][0]["losses"], arms["toolkit, warm cache"][0]["losses"]
    difference = max(abs(a - b) for a, b in zip(cold, warm))
    print(f"\nloss curves, cold vs warm cache: {len(cold)} steps, largest difference {difference:.2e}")
    print(f"load average at end {os.getloadavg()[0]:.2f}; logs in {work}" if args.keep else
          f"load average at end {os.getloadavg()[0]:.2f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
