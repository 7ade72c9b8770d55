"""The LM head only where a log-prob is read (issue 50 point 3): one DPO training forward + backward at a 151,936-token
vocabulary (Qwen2.5's), TRL's padded forward vs the packed one with the head over every packed position (the code at
--before, a git revision) vs the packed one with the head over the answers and the prompt token before each (this
tree), at two prompt lengths.

    python bench/bench_lm_head.py --before f554549 --pairs 2 --repeats 1 --steps 2   # ~10 minutes on 2 loaded CPU cores
    python bench/bench_lm_head.py --before f554549 --prompts 128 1024 --answer 64 --pairs 4 --repeats 2

The model: a Qwen2-shaped model built locally with random weights (2 layers, hidden 128, 4 heads / 2 key-value heads,
vocabulary 151,936, tied embeddings). A step: TRL's fused LM head (`add_fused_lm_head`, the outputs DPOTrainer asks
for) on a micro-batch of --pairs pairs, each a prompt of --prompt tokens and two answers of --answer tokens, called as
DPOTrainer._compute_loss calls it (`model(..., labels=..., fused_lm_head=True)`, redirected to the packed layout by
src/packed_forward.py in the packed arms), then `log_probs.sum().backward()`.

Each arm runs in its own process (one per arm, prompt length and repeat; the arms interleaved, repeat after repeat):
time per step is the median of --steps steps after one warm-up; memory is the process's peak resident set during the
steps less its resident set before them (the step's activations, logits tiles and gradients: on CPU TRL's head
projects every position, in tiles of 4,096 positions x 32,768 vocabulary columns).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("padded", "packed, head over all positions", "packed, head where read")


def build_model(path: Path, vocab: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)


def worker(args) -> None:
    """One arm in this process: prints {"step_s": median seconds, "peak_mb": the steps' peak RSS growth}."""
    sys.path.insert(0, str(args.tree))
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    from src.packed_forward import PackedDPOForward
    from src.packed_layout import pack_pairs

    torch.manual_seed(1)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    model.train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    vocab = model.config.vocab_size
    examples = [{"prompt_ids": torch.randint(1, vocab, (args.prompt,)).tolist(),
                 "chosen_ids": torch.randint(1, vocab, (args.answer,)).tolist(),
                 "rejected_ids": torch.randint(1, vocab, (args.answer - 8,)).tolist()} for _ in range(args.pairs)]
    batch = DataCollatorForPreference(pad_token_id=0)(examples)
    packed = args.arm != "padded"
    if packed:
        batch.update(pack_pairs(examples, None, 0, "prefix_shared", batch["input_ids"].shape[1],
                                1 / (3 * model.config.hidden_size)))
    forward = PackedDPOForward(None if packed else "padded arm")
    forward.checked = True  # the bench times the steps, not the first-batch check
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)

    def step():
        with forward.running(dict(batch), ("policy",), [model]) as inputs:
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)
        outputs.log_probs.sum().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 1024
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"step_s": statistics.median(times), "peak_mb": (max(peak, before) - resident) / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the packed forward with the head over all "
                                                        "positions (before issue 50 point 3)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return worker(args)

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        before = work / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "src"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        build_model(work / "model", args.vocab)
        trees = {ARMS[0]: ROOT, ARMS[1]: before, ARMS[2]: ROOT}
        results: dict = {}
        for _ in range(args.repeats):
            for prompt in args.prompts:
                for arm in ARMS:
                    command = [sys.executable, __file__, "--before", args.before, "--arm", arm, "--tree",
                               str(trees[arm]), "--model", str(work / "model"), "--prompt", str(prompt), "--answer",
                               str(args.answer), "--pairs", str(args.pairs), "--steps", str(args.steps),
                               "--threads", str(args.threads)]
                    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
                    if done.returncode:
                        sys.exit(f"arm {arm!r} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    results.setdefault((prompt, arm), []).append(result)
                    print(f"  prompt {prompt}, {arm}: {result['step_s']:.3f} s/step, {result['peak_mb']:.0f} MB",
                          flush=True)
    print(f"vocabulary {args.vocab:,}, {args.pairs} pairs per micro-batch, answers {args.answer} and "
          f"{args.answer - 8} tokens; medians of {args.repeats} interleaved runs of {args.steps} steps\n")
    print("| prompt tokens | forward | s / step | vs padded | step memory (MB) | vs padded |")
    print("|---:|---|---:|---:|---:|---:|")
    for prompt in args.prompts:
        padded = {key: statistics.median(run[key] for run in results[(prompt, ARMS[0])]) for key in ("step_s",
                                                                                                   "peak_mb")}
        for arm in ARMS:
            median = {key: statistics.median(run[key] for run in results[(prompt, arm)]) for key in ("step_s",
                                                                                                   "peak_mb")}
            print(f"| {prompt} | {arm} | {median['step_s']:.3f} | {median['step_s'] / padded['step_s']:.2f}x | "
                  f"{median['peak_mb']:.0f} | {median['peak_mb'] / padded['peak_mb']:.2f}x |")


if __name__ == "__main__":
    main()
