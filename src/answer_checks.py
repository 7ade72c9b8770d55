"""Ready-made checks for `--judge module:function` (and `--rewards`): verifiable answers to math word problems.

    --judge src.answer_checks:final_number      # GSM8K: --prompt_column question --meta_columns answer

`final_number(row, answer)` is 1.0 when the answer's final number equals the reference's, else 0.0. The answer's final
number is the last `\\boxed{...}` it writes, else the last number in it ("So she has 1,234 apples." → 1234); the
reference is `row["meta"]["answer"]`: GSM8K's solution ends with "#### 72", so the number after its last "####" counts,
else its last number. Numbers compare as values (72 = 72.0 = 72.00; thousands separators ignored). A reference without
a number is a data error: the judge raises, and the run stops in one line naming the prompt (src/judges.py). The judge
sees the answer's final text, after any reasoning (`<think>…</think>`). Light: no torch.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _value(text: str) -> float | None:
    """The last number in `text` as a value, or None."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def final_value(answer: str) -> float | None:
    """An answer's final number: its last \\boxed{...}, else its last number."""
    boxed = _BOXED.findall(answer)
    return _value(boxed[-1]) if boxed and _value(boxed[-1]) is not None else _value(answer)


def reference_value(reference) -> float:
    """The reference's number: after GSM8K's last "####", else its last number."""
    text = str(reference)
    value = _value(text.rsplit("####", 1)[-1]) if "####" in text else _value(text)
    if value is None:
        raise ValueError(f"the reference answer {text[-80:]!r} holds no number (meta['answer'])")
    return value


def final_number(row: dict, answer: str) -> float:
    """1.0 when the answer's final number equals the reference's (row['meta']['answer']), else 0.0."""
    meta = row.get("meta") or {}
    if "answer" not in meta:
        raise ValueError("no meta['answer'] to check against: give the reference in a meta column "
                         "(--meta_columns answer)")
    expected, given = reference_value(meta["answer"]), final_value(answer)
    return float(given is not None and abs(given - expected) <= 1e-6 * max(1.0, abs(expected)))
