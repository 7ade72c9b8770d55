"""What the trained model now says: the held-out answers before and after a stage, measured.

    audit = answers_audit(read_jsonl(run_dir / "samples_test.jsonl"))   # per split, from the samples file

Longer answers after DPO are the commonest surprise: preference data often prefers the longer answer, and DPO
learns length faster than quality (Park et al. 2024, "Disentangling Length from Quality in Direct Preference
Optimization", arXiv 2403.19159). A cut answer ran to --max_new_tokens without ending. A degenerate answer repeats
itself: its seq-rep-4 (the share of its 4-token n-grams that repeat an earlier one, Welleck et al. 2019, "Neural Text
Generation with Unlikelihood Training", arXiv 1908.04319: 0.006 for human text, 0.44 for greedy GPT-2) is at least
0.5 over an answer of 16 tokens or more. Pure functions of the samples file: `python -m src.reporting` recomputes them; each answer's
record (its tokens, whether it ended, its repetition, its reasoning) is written as it is generated (src/generation.py
`answer_record`).
"""

from __future__ import annotations

import math
import statistics

DEGENERATE = 0.5  # seq-rep-4 at or above this: a phrase repeated over and over
MIN_TOKENS = 16  # shorter answers have too few n-grams to call repetitive
SIDES = ("reference", "trained")  # before and after the stage


def is_degenerate(stats: dict) -> bool:
    return stats.get("tokens", 0) >= MIN_TOKENS and stats.get("repetition", 0) >= DEGENERATE


def verdict_score(verdict: dict | None) -> float | None:
    """The number a verdict ranks an answer by: a programmatic score or a reward."""
    for key in ("score", "reward"):
        value = (verdict or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def _share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 6) if flags else None


def _lengths(values: list[int]) -> dict:
    return {"mean": round(statistics.fmean(values), 2), "median": float(statistics.median(values))} if values else \
        {"mean": None, "median": None}


def answers_audit(samples: list[dict]) -> dict | None:
    """A split's answers before → after from its samples (each with `answer_stats` per side); None for samples
    written before the audit existed."""
    measured = [sample for sample in samples if all(side in (sample.get("answer_stats") or {}) for side in SIDES)]
    if not measured:
        return None
    stats = {side: [sample["answer_stats"][side] for sample in measured] for side in SIDES}
    before, after = ([item["tokens"] for item in stats[side]] for side in SIDES)
    audit = {"n": len(measured), "length_before": _lengths(before), "length_after": _lengths(after),
             "length_ratio": round(sum(after) / sum(before), 4) if sum(before) else None}
    for side, name in zip(SIDES, ("before", "after")):
        audit[f"cut_share_{name}"] = _share([not item["ended"] for item in stats[side]])
        audit.update(_reasoning(stats[side], name))
        audit.update(_tool_use(stats[side], name))
        audit[f"repetition_share_{name}"] = _share([is_degenerate(item) for item in stats[side]])
        audit[f"empty_share_{name}"] = _share([not str(sample.get(f"{side}_answer") or "").strip()
                                                for sample in measured])
    audit["judged_by_length"] = _judged_by_length(measured)
    return audit


def _reasoning(stats: list[dict], name: str) -> dict:
    """A side's reasoning apart from its answers: how many reason, their reasoning and final-answer lengths, the share
    with no closing tag, and the share cut before their reasoning closed (no answer at all). Empty when none reasons."""
    reasoning = [item for item in stats if "reasoning_tokens" in item]
    if not reasoning:
        return {}
    return {f"reasoning_share_{name}": _share([True] * len(reasoning) + [False] * (len(stats) - len(reasoning))),
            f"reasoning_length_{name}": _lengths([item["reasoning_tokens"] for item in reasoning]),
            f"final_answer_length_{name}": _lengths([item["tokens"] - item["reasoning_tokens"] for item in reasoning
                                                      if item["closed"]]),
            f"unclosed_share_{name}": _share([not item.get("closed", True) for item in stats]),
            f"cut_in_reasoning_share_{name}": _share([not item.get("closed", True) and not item["ended"]
                                                      for item in stats])}


def _tool_use(stats: list[dict], name: str) -> dict:
    """A side's tool use, where its answers ran tools (--tools: src/tools.py's record per answer): calls per answer,
    the share of calls that were valid (parsed, a known tool, within its schema, ran and returned text), the errors
    by kind, the turns per answer. Empty without tools."""
    used = [item for item in stats if "calls" in item]
    if not used:
        return {}
    calls = sum(item["calls"] for item in used)
    errors: dict[str, int] = {}
    for item in used:
        for kind, count in (item.get("tool_errors") or {}).items():
            errors[kind] = errors.get(kind, 0) + count
    return {f"tool_calls_per_answer_{name}": round(calls / len(used), 4),
            f"tool_valid_share_{name}": round(sum(item["valid_calls"] for item in used) / calls, 6) if calls else None,
            f"tool_errors_{name}": dict(sorted(errors.items())),
            f"tool_turns_per_answer_{name}": round(statistics.fmean(item["turns"] for item in used), 4)}


def _judged_by_length(samples: list[dict]) -> dict | None:
    """With a judge: the mean change of the judge's number for answers that got longer, shorter, or kept their length
    (does the judge reward the growth, or is the model only longer?)."""
    groups: dict[str, list[float]] = {"longer": [], "shorter": [], "same_length": []}
    for sample in samples:
        verdict = sample.get("verdict") or {}
        before, after = verdict_score(verdict.get("reference")), verdict_score(verdict.get("trained"))
        if before is None or after is None:
            continue
        change = sample["answer_stats"]["trained"]["tokens"] - sample["answer_stats"]["reference"]["tokens"]
        groups["longer" if change > 0 else "shorter" if change < 0 else "same_length"].append(after - before)
    if not any(groups.values()):
        return None
    return {name: {"n": len(changes), "mean_change": round(statistics.fmean(changes), 4) if changes else None}
            for name, changes in groups.items()}
