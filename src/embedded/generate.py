"""Write the embedded default's data files, deterministically, into src/embedded/data/.

    python -m src.embedded.generate        # rewrites the shipped files (a test checks they are reproduced exactly)

sft/{train,validation,test}.jsonl   chat `messages` (user question, assistant answer) + `meta`; answers are chatty in
                                    CHATTY_FRACTION of rows and direct in the rest.
dpo/{train,validation,test}.jsonl   conversational preference pairs: chosen = direct answer, rejected = chatty answer,
                                    both correct, + `meta`.
prompts/{train,validation,test}.jsonl  the same questions as dpo/, prompts alone + `meta` (the expected answer the
                                    embedded checker reads): on-policy rounds without pairs (configs/iterative_prompts.yaml).
The validation and test questions are the same for both stages and never appear in either training split.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from src.embedded.tasks import TASKS, chatty_answer, direct_answer, make_problem

DATA_DIR = Path(__file__).resolve().parent / "data"
SEED = 1234
SIZES = {"sft_train": 12000, "dpo_train": 2400, "validation": 300, "test": 600}
CHATTY_FRACTION = 0.75  # the SFT model mostly answers chattily: the behaviour DPO is asked to move


def _held_out_problems(rng: random.Random, count: int, seen: set[str]) -> list[dict]:
    """Distinct questions, none seen before (held-out splits never share a question with anything)."""
    problems = []
    while len(problems) < count:
        problem = make_problem(TASKS[len(problems) % len(TASKS)], rng)
        if problem["question"] not in seen:
            seen.add(problem["question"])
            problems.append(problem)
    return problems


def _training_problems(rng: random.Random, count: int, held_out: set[str]) -> list[dict]:
    """Training questions may repeat (small task spaces, like real data) but never ask a held-out question."""
    problems = []
    while len(problems) < count:
        problem = make_problem(TASKS[len(problems) % len(TASKS)], rng)
        if problem["question"] not in held_out:
            problems.append(problem)
    return problems


def _meta(problem: dict) -> dict:
    return {"task": problem["task"], "answer": problem["answer"]}


def sft_row(problem: dict, chatty: bool) -> dict:
    answer = chatty_answer(problem["answer"]) if chatty else direct_answer(problem["answer"])
    return {
        "messages": [{"role": "user", "content": problem["question"]}, {"role": "assistant", "content": answer}],
        "meta": _meta(problem),
    }


def dpo_row(problem: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": problem["question"]}],
        "chosen": [{"role": "assistant", "content": direct_answer(problem["answer"])}],
        "rejected": [{"role": "assistant", "content": chatty_answer(problem["answer"])}],
        "meta": _meta(problem),
    }


def prompt_row(problem: dict) -> dict:
    return {"prompt": [{"role": "user", "content": problem["question"]}], "meta": _meta(problem)}


def build() -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    held_out = {split: _held_out_problems(rng, SIZES[split], seen) for split in ("validation", "test")}
    sft_train = _training_problems(rng, SIZES["sft_train"], seen)
    dpo_train = _training_problems(rng, SIZES["dpo_train"], seen)
    files = {"sft/train": [sft_row(p, rng.random() < CHATTY_FRACTION) for p in sft_train],
             "dpo/train": [dpo_row(p) for p in dpo_train]}
    for split, problems in held_out.items():
        files[f"sft/{split}"] = [sft_row(p, rng.random() < CHATTY_FRACTION) for p in problems]
        files[f"dpo/{split}"] = [dpo_row(p) for p in problems]
    # drawn from no random stream: the files above are unchanged
    files |= {f"prompts/{split}": [prompt_row(p) for p in problems]
              for split, problems in (("train", dpo_train), *held_out.items())}
    return files


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


def main() -> None:
    for name, rows in build().items():
        path = DATA_DIR / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(rows), encoding="utf-8")
        print(f"{path.relative_to(DATA_DIR.parent.parent.parent)}: {len(rows)} rows")


if __name__ == "__main__":
    main()
