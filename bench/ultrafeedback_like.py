"""Synthetic preference data shaped like HuggingFaceH4/ultrafeedback_binarized, for benchmarks and tests at any size.

    python bench/ultrafeedback_like.py pairs.jsonl 200000        # ~740 MB of JSON Lines, streamed to disk

Each row has UltraFeedback-binarized's columns: `prompt` (a string), `prompt_id`, `chosen` and `rejected` (a user
turn and an assistant answer, as chat messages), `messages` (= chosen) and the two scores. Prompt and answer lengths
are log-normal (median ~60 words for prompts, ~180 for answers, long tails), as in the real set. Rows are written
one at a time: generating a million pairs takes no more memory than generating ten.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

WORDS = ("the sky is blue green red yellow sun moon sea river cat dog bird fish tree leaf happy sad fast slow what "
         "color where is in question answer yes no one two three four five hello world because however explain "
         "write a short story about data model train learning rate batch token python function returns list of "
         "numbers please step by step first second finally example result").split()


def _words(rng: random.Random, median: float, sigma: float, cap: int) -> str:
    count = max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))
    return " ".join(rng.choice(WORDS) for _ in range(count))


def rows(count: int, seed: int = 0, prompt_words: float = 60, answer_words: float = 180, cap: int = 2000):
    """Yield `count` UltraFeedback-binarized-shaped rows (deterministic for a seed)."""
    rng = random.Random(seed)
    for index in range(count):
        prompt = f"{index}: " + _words(rng, prompt_words, 0.9, cap)
        chosen = [{"role": "user", "content": prompt},
                  {"role": "assistant", "content": _words(rng, answer_words, 0.8, cap)}]
        rejected = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": _words(rng, answer_words, 0.8, cap)}]
        yield {"prompt": prompt, "prompt_id": f"{index:064x}", "chosen": chosen, "rejected": rejected,
               "messages": chosen, "score_chosen": float(rng.randint(6, 10)),
               "score_rejected": float(rng.randint(1, 5))}


def write(path: Path, count: int, seed: int = 0, **lengths) -> Path:
    """Write `count` rows as JSON Lines at `path`, one row at a time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows(count, seed, **lengths):
            handle.write(json.dumps(row) + "\n")
    return path


if __name__ == "__main__":
    write(Path(sys.argv[1]), int(sys.argv[2]))
