"""Write the embedded default's data files, deterministically, into src/embedded/data/.

    python -m src.embedded.generate        # rewrites the shipped files (a test checks they are reproduced exactly)

sft/{train,validation,test}.jsonl   chat `messages` (user question, assistant answer) + `meta`; answers are chatty in
                                    CHATTY_FRACTION of rows and direct in the rest.
dpo/{train,validation,test}.jsonl   conversational preference pairs: chosen = direct answer, rejected = chatty answer,
                                    both correct, + `meta`.
prompts/{train,validation,test}.jsonl  the same questions as dpo/, prompts alone + `meta` (the expected answer the
                                    embedded checker reads): on-policy rounds without pairs (configs/iterative_prompts.yaml).
The validation and test questions are the same for both stages and never appear in either training split.

The reasoning variant (`--embedded_reasoning`) is the same questions, splits and styles with every answer reasoning
first (src/embedded/tasks.py `reasoned`): built from the same generator on first use into the cache (`data_dir`), not
shipped.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from src.embedded.tasks import TASKS, chatty_answer, direct_answer, make_problem, reasoned
from src.run_safety.build_once import build_once, cache_root

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


def _answer(problem: dict, style, reasoning: bool) -> str:
    text = style(problem["answer"])
    return reasoned(problem, text) if reasoning else text


def sft_row(problem: dict, chatty: bool, reasoning: bool = False) -> dict:
    answer = _answer(problem, chatty_answer if chatty else direct_answer, reasoning)
    return {
        "messages": [{"role": "user", "content": problem["question"]}, {"role": "assistant", "content": answer}],
        "meta": _meta(problem),
    }


def dpo_row(problem: dict, reasoning: bool = False) -> dict:
    """A pair preferring the direct answer; with reasoning, both reason the same way first (the pair differs in its
    final answer's style alone)."""
    return {
        "prompt": [{"role": "user", "content": problem["question"]}],
        "chosen": [{"role": "assistant", "content": _answer(problem, direct_answer, reasoning)}],
        "rejected": [{"role": "assistant", "content": _answer(problem, chatty_answer, reasoning)}],
        "meta": _meta(problem),
    }


def prompt_row(problem: dict) -> dict:
    return {"prompt": [{"role": "user", "content": problem["question"]}], "meta": _meta(problem)}


def build(reasoning: bool = False) -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    held_out = {split: _held_out_problems(rng, SIZES[split], seen) for split in ("validation", "test")}
    sft_train = _training_problems(rng, SIZES["sft_train"], seen)
    dpo_train = _training_problems(rng, SIZES["dpo_train"], seen)
    files = {"sft/train": [sft_row(p, rng.random() < CHATTY_FRACTION, reasoning) for p in sft_train],
             "dpo/train": [dpo_row(p, reasoning) for p in dpo_train]}
    for split, problems in held_out.items():
        files[f"sft/{split}"] = [sft_row(p, rng.random() < CHATTY_FRACTION, reasoning) for p in problems]
        files[f"dpo/{split}"] = [dpo_row(p, reasoning) for p in problems]
    # drawn from no random stream: the files above are unchanged
    files |= {f"prompts/{split}": [prompt_row(p) for p in problems]
              for split, problems in (("train", dpo_train), *held_out.items())}
    return files


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)


def write(directory: Path, reasoning: bool = False) -> list[Path]:
    """Every file of the data (`build`) under `directory`; the paths written."""
    paths = []
    for name, rows in build(reasoning).items():
        path = directory / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(rows), encoding="utf-8")
        paths.append(path)
    return paths


def data_dir(reasoning: bool = False) -> Path:
    """The data's directory: the shipped files, or the reasoning variant's, written once per cache (keyed by this
    generator's and the tasks' code, so an edit to either writes it anew)."""
    if not reasoning:
        return DATA_DIR
    code = b"".join(Path(__file__).with_name(name).read_bytes() for name in ("generate.py", "tasks.py"))
    digest = hashlib.sha256(code).hexdigest()[:12]
    return build_once(cache_root() / f"embedded-data-reasoning-{digest}", lambda target: write(target, True))


def main() -> None:
    for path in write(DATA_DIR):
        print(f"{path.relative_to(DATA_DIR.parent.parent.parent)}: {path.read_text().count(chr(10))} rows")


if __name__ == "__main__":
    main()
