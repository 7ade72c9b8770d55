"""This toolkit's DPO vs plain `trl dpo` (TRL's own CLI): TRL's padded forward vs the toolkit's packed one
(src/packed_dpo.py), cold vs warm reference log-prob cache (and, with --two_processes, 2 processes).

    python bench/bench_dpo.py                  # ~15 minutes on 2 CPU cores; --repeats 1 --steps 6 for a quick look
    python bench/bench_dpo.py --hidden 768 --layers 12 --steps 40    # bigger, on a GPU machine
    python bench/bench_dpo.py --lengths uniform                      # the earlier short, uniform lengths

Same model (a Llama built locally), same data (synthetic preference pairs), same hyperparameters (global batch,
learning rate, steps, max length, fp32 on CPU / bf16 on GPU, no gradient checkpointing) for every arm. The arms run
interleaved, repeat after repeat, so a load change on the machine hits them alike; the table reports medians.

Lengths (--lengths lognormal, the default): real preference data is long-tailed (UltraFeedback-like), so the words of
a prompt and of each answer are drawn independently from a log-normal distribution, exp(N(ln 24, 0.9)) for prompts and
exp(N(ln 20, 0.9)) for answers, capped at 150 words (median 24 / 20, 95th percentile ~105 / ~88). The padding and
repeated-prompt shares the padded forward computes on them are measured from the batches and printed, with the limit:
plain TRL's computed tokens (policy and reference passes, padded) over the useful ones (each prompt once, both answers).

samples/s counts preference pairs over the time spent on them: for plain TRL its training time (the reference model
runs inside every step); for the toolkit its training time plus the time it spent computing reference log-probs
before training (zero when the cache is warm). tokens/s counts the real tokens of chosen and rejected sequences.
Peak memory is the largest resident set of any process of the arm; on GPUs, the most GPU memory in use during the
arm beyond what was in use before it (NVML, every GPU summed, polled 5 times a second: CUDA context, allocator cache
and all, the same way for every arm). On GPUs every arm runs in bf16 (fp16 before compute capability 8.0).
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


LOGNORMAL = {"prompt": (24, 0.9), "answer": (20, 0.9), "cap": 150}  # median words, sigma of ln(words), cap


def build_assets(root: Path, hidden: int, layers: int, pairs: int, lengths: str = "lognormal",
                 seed: int = 0) -> tuple[Path, Path]:
    """The benchmark's model (random weights, a BPE tokenizer trained on the data) and its data directory."""
    import math

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = lambda count: " ".join(rng.choice(WORDS) for _ in range(count))  # noqa: E731

    def count(kind: str, low: int, high: int) -> int:
        if lengths == "uniform":
            return rng.randint(low, high)
        median, sigma = LOGNORMAL[kind]
        return max(1, min(LOGNORMAL["cap"], round(math.exp(rng.gauss(math.log(median), sigma)))))

    rows = [{"prompt": words(count("prompt", 8, 40)) + " ?", "chosen": " " + words(count("answer", 10, 50)) + " .",
             "rejected": " " + words(count("answer", 10, 50)) + " ."} for _ in range(pairs)]
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


class GpuMemoryPeak:
    """The most GPU memory in use while the block runs beyond what was in use when it began, in MB (NVML: every GPU
    summed, polled every 0.2 s); None without NVML or GPUs."""

    def __enter__(self):
        import threading

        self.peak_mb, self._stop = None, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no driver, no GPU: the resident set is the measure
            return self
        if not handles:
            return self
        used = lambda: sum(pynvml.nvmlDeviceGetMemoryInfo(handle).used for handle in handles)  # noqa: E731
        start, self.peak_mb = used(), 0.0

        def poll() -> None:
            while not self._stop.wait(0.2):
                self.peak_mb = max(self.peak_mb, (used() - start) / 2**20)
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if getattr(self, "_thread", None):
            self._thread.join()


def timed(command: list[str], env: dict, log: Path) -> tuple[float, float, str]:
    """Run a command; (wall seconds, peak MB: GPU memory on a GPU machine, else the RSS of its process tree,
    output)."""
    started = time.perf_counter()
    wrapped = ["/usr/bin/time", "-f", "PEAK_RSS_KB=%M CPU_S=%U+%S", *command] if Path("/usr/bin/time").exists() \
        else command
    with GpuMemoryPeak() as gpu:
        result = subprocess.run(wrapped, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    output = result.stdout + result.stderr
    log.write_text(output)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[:6])} ... failed (exit {result.returncode}); see {log}")
    peak = re.search(r"PEAK_RSS_KB=(\d+)", output)
    if gpu.peak_mb is not None:
        return wall, gpu.peak_mb, output
    return wall, int(peak.group(1)) / 1024 if peak else float("nan"), output


def cpu_seconds(output: str) -> float:
    """The user + system CPU seconds of a timed command's process tree (/usr/bin/time), nan where not measured: what
    a load from other jobs on a shared machine does not stretch, as it stretches wall-clock seconds."""
    found = re.search(r"CPU_S=([\d.]+)\+([\d.]+)", output)
    return float(found.group(1)) + float(found.group(2)) if found else float("nan")


def device_flags() -> list[str]:
    """TRL's precision and device as the toolkit's auto precision picks them: bf16 on CUDA GPUs that have it (compute
    capability 8.0+), fp16 on older ones, fp32 on CPU."""
    import torch

    if not torch.cuda.is_available():
        return ["--bf16", "false", "--use_cpu", "true"]
    bf16 = all(torch.cuda.get_device_capability(index) >= (8, 0) for index in range(torch.cuda.device_count()))
    return ["--bf16", "true"] if bf16 else ["--bf16", "false", "--fp16", "true"]


def trl_dpo(args, model: Path, data: Path, out: Path, log: Path, env: dict) -> dict:
    """Plain TRL: its own CLI (accelerate launch underneath), one process."""
    command = ["trl", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
               "--per_device_train_batch_size", str(args.batch_size), "--max_steps", str(args.steps),
               "--learning_rate", "1e-5", "--max_length", str(args.max_length), "--logging_steps", "1",
               "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none", "--seed", "0",
               "--activation_checkpointing", "false", *device_flags(),
               "--dataloader_num_workers", "0", "--disable_tqdm", "true"]
    beside = Path(sys.executable).parent / command[0]  # the interpreter's own script, else the one on PATH
    executable = str(beside) if beside.exists() else shutil.which(command[0]) or command[0]
    wall, peak, output = timed([executable, *command[1:]], env, log)
    logs = [json.loads(line.replace("'", '"')) for line in re.findall(r"^\{'loss'.*\}$", output, re.M)]
    final = json.loads(re.findall(r"^\{'train_runtime'.*\}$", output, re.M)[-1].replace("'", '"'))
    seconds = float(final["train_runtime"])
    tokens = float(logs[-1]["num_tokens"])
    return {"samples/s": args.steps * args.batch_size / seconds, "tokens/s": tokens / seconds, "wall s": wall,
            "peak MB": peak, "losses": [float(record["loss"]) for record in logs], "cpu s": cpu_seconds(output)}


def toolkit(args, model: Path, data: Path, results: Path, cache: Path, processes: int, log: Path, env: dict,
            packed: bool = True) -> dict:
    run_name = f"bench-{processes}p-{time.monotonic_ns()}"
    flags = ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
             str(results), "--run_name", run_name, "--batch_size", str(args.batch_size), "--max_steps",
             str(args.steps), "--learning_rate", "1e-5", "--lr_scaling", "none", "--max_length", str(args.max_length),
             "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--num_samples", "0",
             "--judge", "none", "--seed", "0", "--val_size", "0", "--test_size", "0", "--lr_scheduler_type", "linear",
             "--padding_free", "true" if packed else "false"]
    command = (["bash", "run_distributed.sh", str(processes), *flags] if processes > 1
               else [sys.executable, "-m", "src.main_distributed", *flags])
    wall, peak, output = timed(command, env | {"PREFKIT_CACHE": str(cache), "PYTHON": sys.executable}, log)
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
            "reference": ",".join(part["cache"] for part in info.get("reference_log_probs", {}).values()),
            "cpu s": cpu_seconds(output),
            "forward": info.get("forward") or info.get("dpo_forward") or {}}


def shares(result: dict) -> str:
    """The policy forward's padding / repeated-prompt shares of computed tokens, from the run's training_info.json."""
    forward = result.get("forward", {})
    tokens = forward.get("tokens", {}).get("policy")
    text = f"{tokens['padding_share']:.0%} / {tokens['repeated_prompt_share']:.0%}" if tokens else "n/a"
    check = forward.get("first_batch_check") or {}
    if forward.get("forward", "").startswith("padded") and forward.get("reason"):  # why it ran TRL's padded forward
        text += f" (padded: {forward['reason']}; check {check.get('max_abs_difference')} vs {check.get('tolerance')})"
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, help="default: steps x batch_size, one epoch, so the reference pass of a "
                        "cold cache covers exactly the pairs trained on")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch (pairs per optimizer step)")
    parser.add_argument("--max_length", type=int, default=400)
    parser.add_argument("--lengths", choices=["lognormal", "uniform"], default="lognormal")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--two_processes", action="store_true", help="add a packed, warm-cache arm on 2 processes")
    parser.add_argument("--arms", help="only the arms whose names contain one of these comma-separated words "
                        "(plain trl dpo always runs: it is the baseline), e.g. --arms packed")
    parser.add_argument("--keep", help="keep the work directory here (default: a temporary one, deleted)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    args.pairs = args.pairs or args.steps * args.batch_size

    work = Path(args.keep or tempfile.mkdtemp(prefix="prefkit_bench_"))
    # One-process arms get every core, the same for both: `accelerate launch` (under `trl dpo`) would otherwise pin
    # TRL to OMP_NUM_THREADS=1 while torch alone takes every core. run_distributed.sh splits the cores between its
    # processes itself, so the 2-process arm drops the variable.
    sys.path.insert(0, str(ROOT))
    from src.resource_limits import usable_cores

    cores = usable_cores()
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} | {
        "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false"}
    one_process_env = env | {"OMP_NUM_THREADS": str(cores)}
    model, data = build_assets(work / "assets", args.hidden, args.layers, args.pairs, args.lengths)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    parameters = sum(shape for shape in [config.vocab_size * config.hidden_size + config.num_hidden_layers * (
        4 * config.hidden_size ** 2 + 3 * config.hidden_size * config.intermediate_size)])
    print(f"model: {parameters / 1e6:.1f}M parameters ({args.layers} layers x {args.hidden}); {args.pairs} pairs, "
          f"{args.lengths} lengths{' ' + str(LOGNORMAL) if args.lengths == 'lognormal' else ''}; "
          f"{args.steps} steps of {args.batch_size} pairs; max_length {args.max_length}; {args.repeats} repeats; "
          f"{cores} CPU cores (one-process arms: {cores} threads); load average at start {os.getloadavg()[0]:.2f}",
          flush=True)

    arms = {"trl dpo (TRL CLI)": [], "toolkit padded, cold cache": [], "toolkit padded, warm cache": [],
            "toolkit packed, cold cache": [], "toolkit packed, warm cache": []}
    if args.two_processes:
        arms["toolkit packed, warm cache, 2 processes"] = []
    if args.arms:
        wanted = args.arms.split(",")
        arms = {name: [] for name in arms if name.startswith("trl") or any(word in name for word in wanted)}
    for repeat in range(args.repeats):
        for name in arms:
            log = work / f"log-{repeat}-{re.sub('[^a-z0-9]+', '_', name)}.txt"
            packed = "packed" in name
            warm_cache = work / f"warm-cache-{'packed' if packed else 'padded'}"
            if name.startswith("trl"):
                result = trl_dpo(args, model, data, work / "trl-out", log, one_process_env)
            elif "cold" in name:
                cold_cache = work / f"cold-cache-{repeat}-{'packed' if packed else 'padded'}"
                result = toolkit(args, model, data, work / "results", cold_cache, 1, log, one_process_env, packed)
                if not warm_cache.exists():
                    shutil.copytree(cold_cache, warm_cache)  # the warm arms reuse what a cold run of theirs computed
                shutil.rmtree(cold_cache, ignore_errors=True)
            else:
                processes = 2 if "2 processes" in name else 1
                result = toolkit(args, model, data, work / "results", warm_cache, processes, log,
                                 env if processes > 1 else one_process_env, packed)
            arms[name].append(result)
            print(f"  repeat {repeat + 1}: {name:<40} {result['samples/s']:6.2f} pairs/s  "
                  f"{result['wall s']:6.1f} s wall  {result['peak MB']:7.0f} MB  padding / repeated prompt "
                  f"{shares(result)}", flush=True)

    baseline = statistics.median(result["samples/s"] for result in arms["trl dpo (TRL CLI)"])
    print("\n| arm | pairs/s | vs trl dpo | peak MB | padding / repeated prompt (policy forward) |")
    print("|---|---|---|---|---|")
    for name, results in arms.items():
        median = {key: statistics.median(result[key] for result in results) for key in ("samples/s", "peak MB")}
        print(f"| {name} | {median['samples/s']:.2f} | {median['samples/s'] / baseline:.2f}x | "
              f"{median['peak MB']:.0f} | {shares(results[0])} |")

    if "toolkit packed, cold cache" in arms:
        # The limit: if time were proportional to computed tokens, how much faster than plain TRL could each arm be?
        # Plain TRL computes every padded token in the policy pass (forward + backward, ~3 forward-equivalents) and the
        # reference pass (1); useful are each prompt once plus both answers. The same batches' padded and useful counts
        # come from the packed arm's training_info.json (TRL's collator, TRL's shuffle and batch size).
        would = arms["toolkit packed, cold cache"][0]["forward"]["padded_forward_would_compute"]["policy"]
        done = arms["toolkit packed, cold cache"][0]["forward"]["tokens"]["policy"]
        padded_over_useful = 1 / would["useful_share"]
        packed_over_useful = 1 / done["useful_share"]
        cold_limit = padded_over_useful
        warm_limit = padded_over_useful * 4 / 3
        cold, warm = (statistics.median(r["samples/s"] for r in arms.get(f"toolkit packed, {kind} cache", [{}]))
                      / baseline for kind in ("cold", "warm"))
        print(f"\npadded forward: {would['padding_share']:.0%} padding, {would['repeated_prompt_share']:.0%} repeated "
              f"prompt; computed / useful tokens {padded_over_useful:.2f} (packed forward: {packed_over_useful:.2f})")
        print(f"limit vs plain trl dpo if time ~ tokens: cold cache {cold_limit:.2f}x (reached {cold:.2f}x, "
              f"{cold / cold_limit:.0%}), warm cache {warm_limit:.2f}x (reached {warm:.2f}x, {warm / warm_limit:.0%})")
    if "toolkit padded, cold cache" in arms and "toolkit packed, cold cache" in arms:
        first, second = arms["toolkit padded, cold cache"][0]["losses"], arms["toolkit packed, cold cache"][0]["losses"]
        difference = max(abs(a - b) for a, b in zip(first, second))
        print(f"loss curves, padded vs packed: {len(first)} steps, largest difference {difference:.2e}")
    print(f"load average at end {os.getloadavg()[0]:.2f}; logs in {work}" if args.keep else
          f"load average at end {os.getloadavg()[0]:.2f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
