"""Judges for tests/test_rounds.py, loaded the way a user's are: --judge tests.round_judges:<function>."""

from __future__ import annotations

import os


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
    """Scores like by_length until the file ROUND_JUDGE_MARK exists (a test creates it after round 1), then raises."""
    if os.path.exists(os.environ["ROUND_JUDGE_MARK"]):
        raise RuntimeError("judge service unavailable")
    return by_length(row, answer)
