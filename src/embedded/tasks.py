"""Small verifiable tasks answered in two styles, and the code that judges an answer.

Why two styles: DPO is weak at teaching a tiny model a new skill but strong at shifting which of the behaviours it
already has it prefers (the DPO paper's controlled-sentiment experiment). The SFT data answers mostly in the chatty
style, as web data often does; the preference pairs prefer the direct answer over the chatty one, both correct. So
SFT teaches the skill, DPO flips the style, and the judge counts held-out answers that are correct *and* direct.

The reasoning variant (`--embedded_reasoning`, configs/embedded_reasoning.yaml) answers every task with a short
worked step first, as a reasoning model writes it: `<think>\n47 + 5 = 52\n</think>\n\n52`; the judge reads the final
answer after it (src/judges.py).

    python -m src.embedded.tasks   # prints a few examples of each task
"""

from __future__ import annotations

import random
import re
import string

from src.chat_templates import reasoning_block

TASKS = ("add", "larger", "next", "sort", "count", "last")
LETTERS = string.ascii_lowercase
# The chatty style adds a sign-off *after* the answer, so both styles compute the answer at the same position and a
# preference pair differs only after it: DPO's reward difference cancels on the shared answer tokens, and moving the
# style cannot cost correctness through them.
SIGN_OFF = ". Hope this helps!"
_ANSWER = re.compile(r"^([A-Za-z0-9]+)(.*)$", re.DOTALL)


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(low, high)))


def make_problem(task: str, rng: random.Random) -> dict:
    """One problem: the user's question, the exact answer, the task name, and the short reasoning the reasoning
    variant writes before the answer (drawn from no random stream: the plain files are unchanged). Each task is one a
    4-layer model learns from a few thousand examples (reversing or copying words, or adding two 2-digit numbers, take
    it far longer than the default's minute of SFT)."""
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 9)
        question, answer = f"What is {a} + {b}?", str(a + b)
        reasoning = f"{a} + {b} = {a + b}"
    elif task == "larger":
        a, b = rng.sample(range(100), 2)
        question, answer = f"Which is larger: {a} or {b}?", str(max(a, b))
        reasoning = f"{max(a, b)} > {min(a, b)}"
    elif task == "next":
        a = rng.randint(0, 9998)
        question, answer = f"What number comes after {a}?", str(a + 1)
        reasoning = f"{a} + 1 = {a + 1}"
    elif task == "sort":
        word = _word(rng, 3, 5)
        question, answer = f"Sort the letters of {word}.", "".join(sorted(word))
        reasoning = " ".join(sorted(word))
    elif task == "count":
        word = _word(rng, 4, 8)
        letter = rng.choice(word) if rng.random() < 0.8 else rng.choice(LETTERS)
        question, answer = f"How many times does {letter} appear in {word}?", str(word.count(letter))
        reasoning = " ".join(character if character == letter else "." for character in word)
    elif task == "last":
        word = _word(rng, 3, 8)
        question, answer = f"What is the last letter of {word}?", word[-1]
        reasoning = " ".join(word)
    else:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return {"task": task, "question": question, "answer": answer, "reasoning": reasoning}


def direct_answer(answer: str) -> str:
    return answer


def chatty_answer(answer: str) -> str:
    return answer + SIGN_OFF


def reasoned(problem: dict, answer: str) -> str:
    """An answer as the reasoning variant writes it: the problem's short reasoning in a <think> block, then the
    answer (as DeepSeek-R1 writes its answers)."""
    return reasoning_block(problem["reasoning"]) + answer


def check(row: dict, text: str) -> dict:
    """Verdict on one generated answer. Every answer is one run of letters or digits, so an answer is read as that
    run and whatever follows it: correct = the run is the right value; preferred = nothing follows it (the direct
    style: no sign-off, and no mangled or partial one either); score = correct and preferred, the metric the
    embedded default is judged by; reward = how on-policy rounds rank a prompt's answers: correct and direct (3) >
    correct and chatty (1) > wrong (0), so a round's chosen answer is never a wrong one and its rejected answer is a
    wrong one wherever the model gave one (a style-only pair where it did not)."""
    expected = row["meta"]["answer"]
    match = _ANSWER.match(text.strip())
    value, rest = (match.group(1), match.group(2)) if match else ("", text.strip())
    correct = value == expected
    preferred = rest == "" and value != ""
    return {"score": float(correct and preferred), "correct": correct, "preferred": preferred,
            "reward": 2.0 * (correct and preferred) + correct}


def correct(row: dict, text: str) -> bool:
    """A binary verifier (`--judge src.embedded.tasks:correct`): the answer is right, whatever its style; the kind of
    check a math answer checker is, used in docs/rounds.md where rounds are measured against best-of-K headroom."""
    return check(row, text)["correct"]
