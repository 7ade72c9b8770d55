"""A --tools registry for tests/test_tools.py (imported by the tool worker process by its module name)."""

import time


def multiply(a: int, b: int) -> str:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def crash(a: int) -> str:
    """Always fails.

    Args:
        a: Ignored.
    """
    raise RuntimeError("tool exploded")


def number(a: int) -> int:
    """Returns a number, not text.

    Args:
        a: Returned as is.
    """
    return a


def hang(a: int) -> str:
    """Never returns.

    Args:
        a: Ignored.
    """
    time.sleep(3600)
    return "never"


def noisy(a: int) -> str:
    """Prints before answering.

    Args:
        a: Echoed.
    """
    print("chatter on stdout")
    return f"echo {a}"


TOOLS = [multiply, crash, number, hang, noisy]
MULTIPLY = {"multiply": multiply}
EXPLICIT = {"lookup": {"function": lambda key: "v", "schema": {"type": "object", "properties": {
    "key": {"type": "string"}}, "required": ["key"]}}}


def untyped(a):
    return str(a)


UNTYPED = [untyped]
NOT_A_REGISTRY = 3


def product_judge(row: dict, text: str) -> dict:
    """A judge of trajectories (special tokens kept): 1 when the final turn states the product."""
    final = text.rsplit("<|im_start|>assistant\n", 1)[-1].replace("<|im_end|>", "").strip()
    score = float(final == f"It is {row['meta']['product']}.")
    return {"score": score, "called": "<tool_call>" in text,
            "turn_rewards": [float('"name": "multiply"' in text), score]}  # the call's turn, the answer's


def result_judge(row: dict, text: str) -> dict:
    """A judge of trajectories: 1 when the product came back from the tool (a right call was run), else 0."""
    return {"score": float(str(row["meta"]["product"]) in text)}
SCHEMA_NOT_AN_OBJECT = {"lookup": {"function": lambda key: "v", "schema": "{'key': str}"}}
SCHEMA_WITHOUT_OBJECT = {"lookup": {"function": lambda key: "v", "schema": {"type": "string"}}}
