"""SFT micro-batch cost, padded vs TRL's padding-free row, on the embedded default's data and model (one thread).

    python bench/bench_sft_forward.py                        # sdpa and eager, 16 sequences per micro-batch
    python bench/bench_sft_forward.py --micro_batch 4 --steps 20

Each step draws one micro-batch of the SFT training split and runs a forward and backward through TRL's own collator
in both forms, alternating, so both arms see the same batches and the same machine load. Reported: CPU seconds per
micro-batch (process time: steadier than wall time on a shared machine), and the padding share of the padded arm.
It is what decides src/trainers/stage_plan.py's default (resolve_sft_forward): padding-free only where it is cheaper.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch", type=int, default=16, help="sequences per micro-batch (the default job: 16)")
    parser.add_argument("--steps", type=int, default=12, help="micro-batches per arm (the first 2 are warm-up)")
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    args = parser.parse_args()

    import src  # noqa: F401  (quiets bitsandbytes' CPU notice)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from src.config_parse import parse_config, stage_config
    from src.data import prepare_data
    from src.run_safety.build_once import cache_root
    from src.embedded.model import ensure_embedded_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = stage_config(parse_config(["--config", "configs/default.yaml"]), "sft")
    rows = prepare_data(config.data, config.sft, "sft", 42, tokenizer, cache_root() / "datasets").train
    order = torch.randperm(len(rows))[: args.micro_batch * args.steps].reshape(args.steps, args.micro_batch)
    arms = {"padded": DataCollatorForLanguageModeling(tokenizer.pad_token_id),
            "padding_free": DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=True)}
    print(f"micro-batch {args.micro_batch} sequences, {args.steps - 2} timed steps per arm, 1 thread")
    print("| attention | padded s/micro-batch | padding-free s/micro-batch | padding-free / padded | padding share |")
    print("|---|---|---|---|---|")
    for attention in args.attention:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)
        model.train()
        seconds = {arm: 0.0 for arm in arms}
        padded_tokens = real_tokens = 0
        for step, indices in enumerate(order.tolist()):
            examples = [{"input_ids": rows[index]["input_ids"][: config.data.max_length]} for index in indices]
            for arm, collate in arms.items():
                batch = collate(examples)
                if arm == "padded":
                    padded_tokens += batch["input_ids"].numel()
                    real_tokens += int(batch["attention_mask"].sum())
                started = time.process_time()
                model(**batch, use_cache=False).loss.backward()
                if step >= 2:
                    seconds[arm] += time.process_time() - started
                model.zero_grad(set_to_none=True)
        timed = args.steps - 2
        padded, free = seconds["padded"] / timed, seconds["padding_free"] / timed
        share = 1 - real_tokens / padded_tokens
        print(f"| {attention} | {padded:.3f} | {free:.3f} | {free / padded:.2f}x | {share:.0%} |")


if __name__ == "__main__":
    main()
