"""What the prompt/answer boundary as generation sees it costs per pair, against TRL's common-prefix boundary.

    python bench/bench_chat_boundary.py                  # 2,000 pairs, 5 rounds, both data kinds
    python bench/bench_chat_boundary.py --pairs 500 --rounds 3

Arms, interleaved in one process (this machine is shared and noisy: each round runs every arm on the same pairs, in
alternating order): `trl` tokenizes a chat pair as TRL 1.16 does (the template on the prompt with its generation
prompt and on prompt + each answer, the completion after their common prefix: the toolkit's tokenize_preference
before issue 38); `toolkit` is src/data/'s tokenize_preference (src/chat_templates.py). Data kinds: `plain`,
UltraFeedback-shaped pairs (bench/ultrafeedback_like.py) with the test suite's tiny template (ids equal in both
arms); `reasoning`, the same pairs whose answers reason first (`<think>…</think>` in the content, a fifth of the
answer's words), with DeepSeek-R1-Distill's template (tests/chat_templates/), where the toolkit splices the answer
onto the generation prompt's `<think>` and TRL drops the reasoning. Prints seconds per 1,000 pairs (median of the
rounds) and the ratio toolkit / trl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "tests")]


def trl_boundary(row: dict, tokenizer) -> dict:
    """TRL 1.16's boundary for a chat pair (the toolkit's tokenize_preference at b21fccb)."""
    from trl.data_utils import _tokenize, common_prefix_length

    prompt_ids = _tokenize(tokenizer, row["prompt"], add_generation_prompt=True)["input_ids"]
    chosen = _tokenize(tokenizer, row["prompt"] + row["chosen"])["input_ids"]
    rejected = _tokenize(tokenizer, row["prompt"] + row["rejected"])["input_ids"]
    length = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
    return {"prompt_ids": prompt_ids[:length], "chosen_ids": chosen[length:], "rejected_ids": rejected[length:]}


def pairs(count: int, reasoning: bool) -> list[dict]:
    from ultrafeedback_like import rows

    out = []
    for row in rows(count):
        pair = {"prompt": [{"role": "user", "content": row["prompt"]}]}
        for side in ("chosen", "rejected"):
            answer = row[side][-1]["content"]
            if reasoning:
                words = answer.split()
                cut = max(1, len(words) // 5)
                answer = f"<think>\n{' '.join(words[:cut])}\n</think>\n\n{' '.join(words[cut:])}"
            pair[side] = [{"role": "assistant", "content": answer}]
        out.append(pair)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from conftest import build_tiny_model
    from src.data import tokenize_preference
    from ultrafeedback_like import WORDS

    with tempfile.TemporaryDirectory() as work:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(work) / "model", [" ".join(WORDS)] * 8))
    templates = {"plain": tokenizer.chat_template,
                 "reasoning": (ROOT / "tests" / "chat_templates" / "deepseek-r1-distill.jinja").read_text()}
    arms = {"trl": trl_boundary, "toolkit": tokenize_preference}
    print(f"{args.pairs:,} pairs, {args.rounds} rounds; seconds per 1,000 pairs (median)")
    print("| data | trl | toolkit | toolkit / trl |\n|---|---|---|---|")
    for kind, template in templates.items():
        tokenizer.chat_template = template
        data = pairs(args.pairs, reasoning=kind == "reasoning")
        times = {name: [] for name in arms}
        for round_index in range(args.rounds):
            for name in (list(arms) if round_index % 2 == 0 else list(arms)[::-1]):
                started = time.perf_counter()
                for row in data:
                    arms[name](row, tokenizer)
                times[name].append((time.perf_counter() - started) / len(data) * 1000)
        trl, toolkit = (statistics.median(times[name]) for name in arms)
        print(f"| {kind} | {trl:.2f} | {toolkit:.2f} | x{toolkit / trl:.2f} |")


if __name__ == "__main__":
    main()
