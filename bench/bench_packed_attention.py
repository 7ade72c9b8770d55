"""The packed DPO forward's attention on a GPU: TRL's padded forward, the packed forward on the dense 4D mask and on
FlexAttention's block-sparse mask (src/packed_attention.py), at three model shapes and two length distributions.

    python bench/bench_packed_attention.py                # on one H100/H200: the table for docs/gpu.md, <= 8 minutes
    python bench/bench_packed_attention.py --dry_run      # a tiny model on CPU, 1 micro-batch: that every arm runs
    python bench/bench_packed_attention.py --sparsity     # CPU: the share of blocks the BlockMask keeps, no model

Models (random weights from configs, nothing from the Hub): `125M` (a 12 x 768 Llama, vocabulary 32,000, tied),
`0.5B` (Qwen2.5-0.5B's shape: 24 x 896, 14 heads / 2 key-value heads, vocabulary 151,936) and `1.5B` (Qwen2.5-1.5B's:
28 x 1,536, 12 / 2 heads, vocabulary 151,936). Data (token ids, log-normal lengths, each sequence cut to --max_length):
`ultrafeedback` (prompt median 80 tokens, answers 230: bench/ultrafeedback_like.py's words x 1.3) and `long_prompt`
(Capybara / HH-like multi-turn prompts: median 600, answers 150).

Arms, each a DPO training step (compute_loss + backward, bf16 autocast on CUDA, fp32 on CPU) over the same
micro-batches, interleaved repeat after repeat:
- `trl dpo`: TRL's DPOTrainer forward (padded, the reference model's forward inside every step), through the toolkit's
  subclass with packing off (the same model code, so the ratios measure the forward, not process start-up);
- `padded`: the same padded forward with the reference cached (no reference forward in the step);
- `packed dense`: the packed, prefix-shared forward on the 4D mask (sdpa);
- `packed flex`: the same layout on FlexAttention's BlockMask (compiled; a CUDA GPU only).
Reference `cold` adds the arm's own reference pass over the same batches (no grad, its forward), `cached` does not.

Reported: pairs/s as a ratio to `trl dpo` (medians over repeats), the share of the token-count limit reached
(measured ratio over `trl dpo`'s computed tokens / the arm's), peak GPU memory (torch's most allocated during the
arm's timed steps beyond what every arm keeps resident, plus the weights a run of that arm holds: the policy, and for
`trl dpo` its reference model; no optimizer state in any arm), and FlexAttention's compiles (count and seconds, TorchDynamo's own callbacks). Stops starting new
models past --minutes and says what it skipped. Writes the table (markdown) and a JSON beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = {
    "125M": dict(family="llama", vocab_size=32_000, hidden_size=768, intermediate_size=3_072, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12),
    "0.5B": dict(family="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4_864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "1.5B": dict(family="qwen2", vocab_size=151_936, hidden_size=1_536, intermediate_size=8_960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(family="llama", vocab_size=1_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
LENGTHS = {"ultrafeedback": {"prompt": (80, 0.9), "answer": (230, 0.8)},
           "long_prompt": {"prompt": (600, 0.7), "answer": (150, 0.8)}}
ARMS = ("trl dpo", "padded", "packed dense", "packed flex")


def build_model(shape: dict, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[shape["family"]]
    sizes = {key: value for key, value in shape.items() if key != "family"}
    config = config_class(**sizes, tie_word_embeddings=True, max_position_embeddings=32_768, pad_token_id=0,
                          eos_token_id=1, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_class(config).to(device)


def micro_batches(lengths: str, count: int, pairs: int, vocab: int, max_length: int, seed: int = 0) -> list:
    rng = random.Random(seed)

    def length(kind: str) -> int:
        median, sigma = LENGTHS[lengths][kind]
        return max(1, int(rng.lognormvariate(math.log(median), sigma)))

    ids = lambda count_: [rng.randrange(3, vocab) for _ in range(count_)]  # noqa: E731
    batches = []
    for _ in range(count):
        rows = []
        for _ in range(pairs):
            prompt = ids(min(length("prompt"), max_length // 2))
            rows.append({"prompt_ids": prompt, "chosen_ids": ids(length("answer")), "rejected_ids": ids(length("answer"))})
        batches.append(rows)
    return batches


def tokenizer_for(vocab: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(min(vocab, 4_096))}  # the trainer asks it for pad and eos only
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t2")),
                                   pad_token="t0", eos_token="t1", unk_token="t2")


def arm(name: str, base, reference_model, tokenizer, batches: list, device: str, max_length: int, work: Path):
    """(step over micro-batch i, reference pass over micro-batch i or None, the trainer's packed forward). Every arm
    shares `reference_model` (never trained), so the GPU holds one reference copy, not one per arm."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig

    from src.trainers.dpo import PreparedDPOTrainer, packed_dpo_forward

    model = copy.deepcopy(base)
    args = DPOConfig(output_dir=str(work / name.replace(" ", "_")), per_device_train_batch_size=len(batches[0]),
                     max_length=max_length, bf16=device == "cuda", use_cpu=device == "cpu", report_to=[],
                     disable_tqdm=True, precompute_ref_log_probs=False, activation_checkpointing=False)
    packed = name.startswith("packed")
    attention = name.split()[-1] if packed else "auto"
    trainer = PreparedDPOTrainer(model=model, ref_model=reference_model, args=args,
                                 train_dataset=Dataset.from_list([row for batch in batches for row in batch]),
                                 processing_class=tokenizer,
                                 **packed_dpo_forward(model, tokenizer, args, None, packed, attention))
    trainer.precompute_ref_logps = name != "trl dpo"  # the cached arms read the reference log-probs from the batch
    autocast = torch.autocast(device, torch.bfloat16, enabled=device == "cuda")
    collated = [trainer._prepare_inputs(trainer.data_collator(rows)) for rows in batches]

    def reference(index: int):
        with torch.no_grad(), autocast:
            chosen, rejected = trainer.compute_ref_log_probs(trainer.ref_model, dict(collated[index]))
        return chosen, rejected

    if trainer.precompute_ref_logps:
        for index, batch in enumerate(collated):
            batch["ref_chosen_logps"], batch["ref_rejected_logps"] = reference(index)

    def step(index: int):
        trainer.model.train()
        with autocast:
            loss = trainer.compute_loss(trainer.model, dict(collated[index]))
        loss.backward()
        trainer.model.zero_grad(set_to_none=True)

    return step, (reference if trainer.precompute_ref_logps else None), trainer.packed_forward, collated


def computed_tokens(name: str, forward, collated: list) -> tuple[int, int]:
    """(tokens one pass of the policy computes, of the reference pass) over the micro-batches."""
    padded = sum(batch["input_ids"].numel() for batch in collated)
    if forward is None or not forward.enabled or not name.startswith("packed"):
        return padded, padded
    packed = sum(int(batch["packed_counts"][0]) for batch in collated)
    return packed, packed


def measure(model_name: str, lengths: str, args, device: str, work: Path) -> dict:
    import torch

    shape = MODELS[model_name]
    base = build_model(shape, device)
    reference_model = copy.deepcopy(base).eval()
    weights = sum(parameter.numel() * parameter.element_size() for parameter in base.parameters())
    tokenizer = tokenizer_for(shape["vocab_size"])
    batches = micro_batches(lengths, args.micro_batches, args.pairs, shape["vocab_size"], args.max_length)
    arms, seconds, reference_seconds, peak = {}, {}, {}, {}
    for name in ARMS:
        if name == "packed flex" and device != "cuda":
            continue  # FlexAttention has no backward on CPU (the config refuses it there)
        step, reference, forward, collated = arm(name, base, reference_model, tokenizer, batches, device,
                                                 args.max_length, work)
        for index in range(len(batches)):  # untimed: the first-batch check, compiles, allocator warm-up
            step(index)
        arms[name] = (step, reference, forward, collated)
        seconds[name], reference_seconds[name], peak[name] = [], [], 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(args.repeats):
        for name, (step, reference, _forward, _collated) in arms.items():
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated()  # every arm's weights: not this arm's working memory
            sync()
            started = time.perf_counter()
            for index in range(len(batches)):
                step(index)
            sync()
            seconds[name].append(time.perf_counter() - started)
            if reference is not None:
                started = time.perf_counter()
                for index in range(len(batches)):
                    reference(index)
                sync()
                reference_seconds[name].append(time.perf_counter() - started)
            if device == "cuda":
                # the step's working memory (activations, gradients) + the weights a run of this arm holds: the
                # policy, and for `trl dpo` the reference model (the toolkit's cached or precomputed runs free it)
                held = weights * (2 if name == "trl dpo" else 1)
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated() - resident + held)
    pairs = len(batches) * len(batches[0])
    result = {"model": model_name, "lengths": lengths, "pairs": pairs, "arms": {}}
    trl_policy, trl_reference = computed_tokens("trl dpo", None, arms["trl dpo"][3])
    trl_seconds = statistics.median(seconds["trl dpo"])
    trl_tokens = trl_policy + trl_reference
    for name, (_step, reference, forward, collated) in arms.items():
        policy_tokens, reference_tokens = computed_tokens(name, forward, collated)
        for cache in ("cold", "cached") if reference is not None else ("every step",):
            taken = statistics.median(seconds[name]) + (statistics.median(reference_seconds[name])
                                                         if cache == "cold" else 0.0)
            tokens = policy_tokens + (reference_tokens if cache in ("cold", "every step") else 0)
            ratio, limit = trl_seconds / taken, trl_tokens / tokens
            summary = forward.summary() if forward is not None and forward.enabled else {}
            attention = summary.get("attention") or {}
            result["arms"][f"{name}, {cache}"] = {
                "pairs_per_s": round(pairs / taken, 2), "vs_trl_dpo": round(ratio, 3), "token_limit": round(limit, 3),
                "share_of_limit": round(ratio / limit, 3), "peak_memory_mb": round(peak[name] / 2**20),
                "forward": summary.get("forward", "padded (TRL)"), "attention_batches": attention.get("batches"),
                "compiles": attention.get("compiles"), "check_passed": (summary.get("first_batch_check") or {}).get(
                    "passed")}
    del arms, base
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def sparsity(widths: tuple[int, ...] = (512, 2048, 8192), rows_per_width: int = 4) -> str:
    """The share of a packed row's 128 x 128 blocks FlexAttention computes (a dense-mask sdpa computes them all; a
    causal kernel about half), on rows filled first-fit from each length distribution's pairs (the packed layout's
    segments, cut to the width), as a markdown table. Needs no GPU and no model."""
    import torch

    from src.packed_attention import computed_block_share, prefix_shared_block_mask
    from src.packed_layout import pack_pairs

    lines = ["| lengths | row width | pairs per row | blocks computed, block-sparse | causal only | dense mask |",
             "|---|---|---|---|---|---|"]
    for lengths in LENGTHS:
        pairs = [row for batch in micro_batches(lengths, 40, 16, 1_000, 8_192, seed=1) for row in batch]
        for width in widths:
            shares, counts, cursor = [], [], 0
            for _ in range(rows_per_width):
                row, used = [], 0
                while cursor < len(pairs):
                    pair = pairs[cursor]
                    size = min(width, len(pair["prompt_ids"]) + len(pair["chosen_ids"]) + len(pair["rejected_ids"]) + 1)
                    if used + size > width and row:
                        break
                    row.append(pair)
                    used += size
                    cursor += 1
                packed = pack_pairs(row, width // 2, 0, "prefix_shared", width, 0.0)
                segment_ids = torch.full((1, width), -1)
                branch_ids, position_ids = torch.zeros((1, width), dtype=torch.long), torch.zeros((1, width), dtype=torch.long)
                real = packed["packed_segment_ids"].reshape(-1)
                real = real[real >= 0]
                flat = lambda key: packed[key].reshape(-1)[packed["packed_segment_ids"].reshape(-1) >= 0]  # noqa: E731
                n = min(width, real.numel())
                segment_ids[0, :n], branch_ids[0, :n], position_ids[0, :n] = real[:n], flat("packed_branch_ids")[:n], \
                    flat("packed_position_ids")[:n]
                shares.append(computed_block_share(prefix_shared_block_mask(segment_ids, branch_ids, position_ids)))
                counts.append(len(row))
            blocks = width // 128
            lines.append(f"| {lengths} | {width} | {statistics.mean(counts):.1f} | {statistics.mean(shares):.1%} | "
                         f"{(blocks + 1) / (2 * blocks):.1%} | 100% |")
    return "\n".join(lines) + "\n"


def table(results: list[dict], machine: str, skipped: list[str]) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {machine} (`python bench/bench_packed_attention.py`):", "",
             "| model | lengths | arm | reference | pairs/s | vs `trl dpo` | share of token limit | peak MB | "
             "attention batches | compiles (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for key, arm_ in result["arms"].items():
            name, cache = key.split(", ")
            compiles = f"{arm_['compiles']['count']} ({arm_['compiles']['seconds']})" if arm_["compiles"] else ""
            lines.append(f"| {result['model']} | {result['lengths']} | {name} | {cache} | {arm_['pairs_per_s']} | "
                         f"{arm_['vs_trl_dpo']:.2f}x | {arm_['share_of_limit']:.0%} of {arm_['token_limit']:.2f}x | "
                         f"{arm_['peak_memory_mb']} | {arm_['attention_batches'] or ''} | "
                         f"{compiles} |")
    if skipped:
        lines += ["", f"Not run (time limit): {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true", help="a tiny model on CPU, 1 micro-batch of 4 pairs")
    parser.add_argument("--sparsity", action="store_true", help="only the BlockMask's share of blocks (CPU, no model)")
    parser.add_argument("--models", default="125M,0.5B,1.5B", help="comma-separated: 125M, 0.5B, 1.5B")
    parser.add_argument("--lengths", default="ultrafeedback,long_prompt", help="comma-separated distributions")
    parser.add_argument("--micro_batches", type=int, default=4, help="micro-batches per arm per repeat")
    parser.add_argument("--pairs", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--max_length", type=int, default=2048, help="tokens of prompt + answer, at most")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=8, help="start no new model past this (default 8)")
    parser.add_argument("--out", default=str(ROOT / "results" / "packed-attention" / "table.md"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sparsity:
        print(sparsity())
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:
        args.models, args.micro_batches, args.pairs, args.max_length, args.repeats = "tiny", 1, 4, 128, 1
    machine = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: the flex arm needs a CUDA GPU)"
    deadline = time.monotonic() + args.minutes * 60
    results, skipped = [], []
    with tempfile.TemporaryDirectory() as work:
        for model_name in args.models.split(","):
            for lengths in args.lengths.split(","):
                if time.monotonic() > deadline:
                    skipped.append(f"{model_name} {lengths}")
                    continue
                started = time.monotonic()
                results.append(measure(model_name, lengths, args, device, Path(work)))
                print(f"{model_name} {lengths}: {time.monotonic() - started:.0f} s", flush=True)
    text = table(results, machine, skipped)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "results": results, "skipped": skipped},
                                                   indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
