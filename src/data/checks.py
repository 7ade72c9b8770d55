"""A row's check before tokenizing: an empty answer or prompt, chosen == rejected; the status each row leaves
preparation with (kept, empty, identical, too long, KTO's undesirable).
"""

from __future__ import annotations

from typing import Any

from src.chat_templates import THINK_CLOSE, THINK_OPEN, split_reasoning
from src.data.errors import DataError
from src.data.shapes import is_chat, stage_shape, text_of
from src.objectives import PAIRED_SHAPES, PROMPTS


def _says_something(value: Any) -> bool:
    """Text, or a chat with some content, reasoning or tool call (an answer that only calls a tool is not empty)."""
    if text_of(value).strip():
        return True
    return is_chat(value) and any(message.get("tool_calls") or split_reasoning(message).reasoning
                                   for message in value)


KEPT, EMPTY, IDENTICAL, TOO_LONG, UNDESIRABLE = 0, 1, 2, 3, 4  # a row's fate, stored per row while preparing (int8)


def _answer_columns(row: dict, stage: str = "") -> tuple[str, ...]:
    if stage_shape(stage) == PROMPTS:
        return ()  # nothing answers yet: the rounds sample the answers
    return ("chosen", "rejected") if "chosen" in row else (
        ("completion",) if "completion" in row else ("messages",) if "messages" in row else ("text",))


def check_row(row: dict, number: int, stage: str, source: str) -> int:
    """Refuse a malformed row (wrong types) naming its number; say whether it carries a training signal (KEPT) or is
    dropped for an empty answer or chosen == rejected."""
    answer_columns = _answer_columns(row, stage)
    for column in ("prompt",) + answer_columns:
        if column not in row or row[column] is None:
            if column == "prompt" and column not in row and stage_shape(stage) != PROMPTS:
                continue
            raise DataError(f"{source} row {number}: '{column}' is missing; fill it in or remove the row")
        value = row[column]
        if not isinstance(value, str) and not is_chat(value):
            raise DataError(
                f"{source} row {number}: '{column}' must be text or a list of {{role, content}} messages, "
                f"got {type(value).__name__}"
            )
    paired = stage_shape(stage) in PAIRED_SHAPES
    if paired and isinstance(row["chosen"], str) != isinstance(row["rejected"], str):
        raise DataError(f"{source} row {number}: 'chosen' and 'rejected' must both be text or both messages")
    for column in answer_columns:
        messages = row[column] if is_chat(row[column]) else [{"role": "assistant", "content": row[column]}]
        if any(message.get("role") == "assistant" and not split_reasoning(message).closed for message in messages):
            raise DataError(f"{source} row {number}: '{column}' opens {THINK_OPEN} and never closes it (an answer cut "
                            f"inside its reasoning: no final answer to train); close it with {THINK_CLOSE} and the "
                            "answer, or remove the row")
    if any(not _says_something(row[column]) for column in answer_columns or ("prompt",)):
        return EMPTY  # an empty answer, or (prompts alone) an empty prompt
    if paired and row["chosen"] == row["rejected"]:
        return IDENTICAL
    return KEPT
