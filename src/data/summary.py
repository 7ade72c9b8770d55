"""The console lines rank 0 prints about the prepared data: what was recognised, what was dropped or truncated per
split, and which reasoning is trained.
"""

from __future__ import annotations

from src.data.shapes import stage_shape
from src.objectives import PROMPTS


def format_summary(summary: dict) -> str:
    """A few lines for rank 0: what was recognised and what was dropped or truncated, per split."""
    lines = [f"  data: {summary['source']} ({summary['shape']}, {summary['stage']})"]
    for source in summary.get("sources", []):
        taken = ", ".join(f"{kind} {rows}" for kind, rows in source["rows_taken"].items())
        lines.append(f"    {source['source']} ({source['shape']}, fraction {source['fraction']:g}): {taken} rows")
    for kind, counts in summary["splits"].items():
        notes = []
        if counts["empty_answers"]:
            empty = "prompt" if stage_shape(summary["stage"]) == PROMPTS else "answer"
            notes.append(f"{counts['empty_answers']} rows with an empty {empty} dropped (first: rows "
                         f"{counts['first_empty_rows']})")
        if counts["identical_pairs"]:
            by_drop = ((summary.get("audit") or {}).get(kind) or {}).get("identical_by_reasoning_drop")
            notes.append(f"{counts['identical_pairs']} pairs with chosen == rejected dropped"
                         + (f" ({by_drop} differ only in their reasoning, which --reasoning drop removes)"
                            if by_drop else "") + f" (first: rows {counts['first_identical_rows']})")
        if counts.get("dropped_prompt_too_long"):
            notes.append(f"{counts['dropped_prompt_too_long']} prompts of --max_length {summary['max_length']}+ "
                         "tokens dropped")
        if counts.get("dropped_too_long"):
            notes.append(f"{counts['dropped_too_long']} pairs over --max_length {summary['max_length']} tokens dropped")
        if counts["truncated"]:
            notes.append(f"{counts['truncated']} rows truncated to {summary['max_length']} tokens")
        suffix = f"; {'; '.join(notes)}" if notes else ""
        lines.append(f"  {kind:<10} {counts['kept']:>7} rows (longest {counts['longest_tokens']} tokens){suffix}")
    reasoning = reasoning_line(summary)
    return "\n".join(lines + ([reasoning] if reasoning else []))


def reasoning_line(summary: dict) -> str | None:
    """Which reasoning is trained and why, when the training answers reason: the flag in force, how many answers
    reason and how long."""
    train = (summary.get("audit") or {}).get("train") or {}
    side = next((side for side in ("chosen", "completion") if train.get(f"{side}_reasoning_share")), None)
    if side is None:
        return None
    share, tokens = train[f"{side}_reasoning_share"], train[f"{side}_reasoning_tokens"]["mean"]
    held = f"{share:.0%} of the {side} answers reason (mean {tokens:g} tokens)"
    if summary.get("reasoning") == "drop":
        return (f"  reasoning: dropped (--reasoning drop): {held}; the final answers alone are trained, after an empty "
                "reasoning block where the template writes one")
    return (f"  reasoning: kept (--reasoning keep, the default): {held}, trained as the model writes them after its "
            "generation prompt; --reasoning drop trains the final answers alone")
