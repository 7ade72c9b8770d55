"""Which DPO settings move the embedded default's style without costing correctness? A measurement, not a test.

    ./run_distributed.sh                        # first: trains results/default/sft/model/final
    python bench/embedded_dpo_variants.py       # then: ~2 minutes on 2 CPU cores

From the same SFT model, trains each variant for 60 steps (global batch 32, one process) on the shipped preference
pairs and judges greedy answers to all 900 held-out prompts (validation + test) with the embedded judge. Prints a
markdown table: correct-and-preferred, correct, preferred, and the change in correct from the SFT model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "sigmoid, beta 0.1, lr 5e-5": {"beta": 0.1, "learning_rate": 5e-5},
    "sigmoid, beta 1.0, lr 1e-4": {"beta": 1.0, "learning_rate": 1e-4},
    "sigmoid + 0.4 x sft (RPO), beta 0.3, lr 8e-5 (the default)": {
        "beta": 0.3, "learning_rate": 8e-5, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.4]},
    "sft on the chosen answers alone (control)": {"learning_rate": 8e-5, "loss_type": ["sft"]},
}


def judge(model, tokenizer, rows) -> dict:
    import torch

    from src.embedded.tasks import check

    tokenizer.padding_side = "left"
    model.eval()
    totals = {"score": 0.0, "correct": 0.0, "preferred": 0.0}
    for start in range(0, len(rows), 150):
        batch = rows[start:start + 150]
        prompts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
                   for row in batch]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(**encoded, max_new_tokens=32, do_sample=False)
        for row, ids in zip(batch, output[:, encoded["input_ids"].shape[1]:]):
            verdict = check(row, tokenizer.decode(ids, skip_special_tokens=True))
            for key in totals:
                totals[key] += float(verdict[key])
    tokenizer.padding_side = "right"
    return {key: value / len(rows) for key, value in totals.items()}


def main() -> None:
    import src  # noqa: F401  (quiets bitsandbytes' CPU notice)
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_model", default=str(ROOT / "results/default/sft/model/final"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if not Path(args.sft_model).exists():
        sys.exit(f"error: {args.sft_model} does not exist: run ./run_distributed.sh first")
    torch.set_num_threads(2)
    data = ROOT / "src/embedded/data/dpo"
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model)
    train = load_dataset("json", data_files=str(data / "train.jsonl"))["train"].remove_columns("meta")
    rows = [json.loads(line) for split in ("validation", "test") for line in open(data / f"{split}.jsonl")]
    start = judge(AutoModelForCausalLM.from_pretrained(args.sft_model), tokenizer, rows)
    print(f"SFT model: correct {start['correct']:.1%}, preferred {start['preferred']:.1%} ({len(rows)} prompts)\n")
    print("| DPO variant (%d steps) | correct and preferred | correct | preferred | change in correct |" % args.steps)
    print("|---|---|---|---|---|")
    for name, settings in VARIANTS.items():
        config = DPOConfig(output_dir="/tmp/prefkit_dpo_variants", max_steps=args.steps, per_device_train_batch_size=32,
                           lr_scheduler_type="cosine", warmup_steps=0.1, max_length=64, use_cpu=True, bf16=False,
                           activation_checkpointing=False, report_to=[], logging_steps=1000, save_strategy="no",
                           eval_strategy="no", seed=42, disable_tqdm=True, **settings)
        trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.sft_model), args=config,
                             train_dataset=train, processing_class=tokenizer)
        trainer.train()
        result = judge(trainer.model, tokenizer, rows)
        print(f"| {name} | {result['score']:.1%} | {result['correct']:.1%} | {result['preferred']:.1%} | "
              f"{(result['correct'] - start['correct']) * 100:+.1f} pts |", flush=True)


if __name__ == "__main__":
    main()
