"""Judges for tests/test_rounds.py and tests/test_data_audit.py, loaded the way a user's are:
--judge tests.round_judges:<function>."""

from __future__ import annotations

import os
import re
import sys


def by_length(row: dict, answer: str) -> float:
    """Deterministic and discriminating on a random tiny model: longer answers score higher."""
    return float(len(answer.split()))


def always_one(row: dict, answer: str) -> float:
    return 1.0


def raising(row: dict, answer: str) -> float:
    if "the sun" in row["prompt"][-1]["content"]:
        raise ValueError("cannot parse the answer")
    return by_length(row, answer)


def not_a_number(row: dict, answer: str):
    return "yes" if "the sea" in row["prompt"][-1]["content"] else by_length(row, answer)


def fails_after_first_round(row: dict, answer: str) -> float:
    """Scores like by_length, and raises once round 1 is recorded (the file ROUND_JUDGE_AFTER, round1/round.json)
    while the file ROUND_JUDGE_MARK exists: the judge goes down in round 2, at the same moment on every run."""
    if os.path.exists(os.environ["ROUND_JUDGE_MARK"]) and os.path.exists(os.environ["ROUND_JUDGE_AFTER"]):
        raise RuntimeError("judge service unavailable")
    return by_length(row, answer)


def sum_checker(row: dict, answer: str) -> float:
    """1 when the answer's last number is the sum the prompt asks for ("... what is A + B?"), else 0."""
    a, b = (int(number) for number in re.findall(r"(\d+) \+ (\d+)", str(row["prompt"]))[-1])
    numbers = re.findall(r"\d+", answer)
    return float(bool(numbers) and int(numbers[-1]) == a + b)


def gives_up_on_rank_1(row: dict, answer: str) -> float:
    """Scores like by_length on every process but rank 1, where it ends its process (sys.exit, not an exception): a
    check that fails on one process alone, in the middle of a step the others are in too."""
    if os.environ.get("RANK") == "1":
        sys.exit("no checker on this host")
    return by_length(row, answer)
