"""Small verifiable tasks answered in two styles, and the code that judges an answer.

Why two styles: DPO is weak at teaching a tiny model a new skill but strong at shifting which of the behaviours it
already has it prefers (the DPO paper's controlled-sentiment experiment). The SFT data answers mostly in the chatty
style, as web data often does; the preference pairs prefer the direct answer over the chatty one, both correct. So
SFT teaches the skill, DPO flips the style, and the judge counts held-out answers that are correct *and* direct.

    python -m src.embedded.tasks   # prints a few examples of each task
"""

from __future__ import annotations

import random
import string

TASKS = ("add", "larger", "reverse", "sort", "count", "upper")
LETTERS = string.ascii_lowercase
# The chatty style adds a sign-off *after* the answer, so both styles compute the answer at the same position and a
# preference pair differs only after it: DPO's reward difference cancels on the shared answer tokens, and moving the
# style cannot cost correctness through them.
SIGN_OFF = ". Hope this helps!"


def _word(rng: random.Random, low: int = 3, high: int = 6) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(low, high)))


def make_problem(task: str, rng: random.Random) -> dict:
    """One problem: the user's question, the exact answer, and the task name."""
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        question, answer = f"What is {a} + {b}?", str(a + b)
    elif task == "larger":
        a, b = rng.sample(range(100), 2)
        question, answer = f"Which is larger: {a} or {b}?", str(max(a, b))
    elif task == "reverse":
        word = _word(rng)
        question, answer = f"Reverse the word {word}.", word[::-1]
    elif task == "sort":
        word = _word(rng)
        question, answer = f"Sort the letters of {word}.", "".join(sorted(word))
    elif task == "count":
        word = _word(rng, 4, 8)
        letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(LETTERS)
        question, answer = f"How many times does {letter} appear in {word}?", str(word.count(letter))
    elif task == "upper":
        word = _word(rng)
        question, answer = f"Write {word} in capital letters.", word.upper()
    else:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return {"task": task, "question": question, "answer": answer}


def direct_answer(answer: str) -> str:
    return answer


def chatty_answer(answer: str) -> str:
    return answer + SIGN_OFF


def check(row: dict, text: str) -> dict:
    """Verdict on one generated answer: correct (the right value, in either style), preferred (given directly, with
    no chatty wrapper), and score = correct and preferred — the metric the embedded default is judged by."""
    expected = row["meta"]["answer"]
    text = text.strip()
    preferred = not text.endswith(SIGN_OFF)
    value = text if preferred else text[: -len(SIGN_OFF)]
    correct = value == expected
    return {"score": float(correct and preferred), "correct": correct, "preferred": preferred}


if __name__ == "__main__":
    rng = random.Random(0)
    for task in TASKS:
        problem = make_problem(task, rng)
        print(f"{problem['question']:<48} {direct_answer(problem['answer']):<8} | {chatty_answer(problem['answer'])}")
