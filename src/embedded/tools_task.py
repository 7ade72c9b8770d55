"""The embedded tool task: products of two 3-digit numbers, which a 4-layer character-level model cannot compute, with a
`multiply` tool it can call (docs/tools.md, configs/sft_dpo_grpo_tools.yaml).

    python -m src.embedded.tools_task [DIRECTORY]     # writes DIRECTORY/data/{sft,dpo,prompts}/ and DIRECTORY/model/
                                                      # (default results/tools_task), deterministically
    python -m src.embedded.tools_task --measure RUN   # the judge's criteria per stage of a run, with 95% intervals

An answer is a trajectory: the model calls `multiply` (Hermes syntax, `<tool_call>{json}</tool_call>`), reads the
result in the tool role, and answers with the number. The SFT chats teach that shape, but most of them (SFT_WRONG_CALLS)
call with the second factor's last digit dropped, as a careless copy would, and answer with what the tool returned: the
SFT model learns to call the tool, and mostly calls it wrong. The DPO pairs, mid-conversation (the prompt is the
question, the answers are the first call), prefer the right call to the careless one; GRPO, with the tool running while
it samples, is rewarded for a right final answer. `check` is the judge: correct (the final answer is the product),
called (a call that parses), right_call (multiply called with the question's factors).

`TOOLS` is the --tools registry (`src.embedded.tools_task:TOOLS`).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from src.embedded.model import build_model, build_tokenizer
from src.reporting.formatting import ci95

SEED = 4321
SIZES = {"sft_train": 4000, "dpo_train": 1500, "prompts_train": 1500, "validation": 100, "test": 200}
SFT_WRONG_CALLS = 0.6  # the careless call is the SFT majority: the behaviour DPO and GRPO are asked to move
TOOL_SPECIALS = ("<|tool|>", "<tool_call>", "</tool_call>")
# Hermes-style calls in the embedded template's tokens; the tool's result follows in its own role, then the generation
# prompt. The JSON is compact (no spaces): a character-level model writes every character.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:{%- for tool in tools %} {{ tool.function.name }}{%- endfor -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{% generation %}{{ message['content'] or '' }}"
    "{%- for call in message.tool_calls or [] -%}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson(separators=(',', ':')) }}"
    "</tool_call>{%- endfor -%}<|end|>{% endgeneration %}"
    "{%- elif message['role'] == 'tool' -%}<|tool|>{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "max_position_embeddings": 160}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def multiply(a: int, b: int) -> str:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(int(a) * int(b))


TOOLS = [multiply]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def _call(a: int, b: int) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]}


def trajectory(a: int, b: int, careless: bool) -> list[dict]:
    """The answer's messages: the call (careless: the second factor's last digit dropped), its result, the answer."""
    called = b // 10 if careless else b
    result = multiply(a, called)
    return [_call(a, called), {"role": "tool", "name": "multiply", "content": result},
            {"role": "assistant", "content": result}]


def _meta(a: int, b: int) -> dict:
    return {"task": "multiply", "a": a, "b": b, "answer": str(a * b)}


def _problems(rng: random.Random, count: int, seen: set, distinct: bool) -> list[tuple[int, int]]:
    problems = []
    while len(problems) < count:
        pair = (rng.randint(100, 999), rng.randint(100, 999))
        if pair in seen:
            continue
        if distinct:
            seen.add(pair)
        problems.append(pair)
    return problems


def build() -> dict[str, list[dict]]:
    """Every file's rows: held-out questions (validation, test) never asked in training."""
    rng = random.Random(SEED)
    seen: set = set()
    held_out = {split: _problems(rng, SIZES[split], seen, True) for split in ("validation", "test")}
    train = {name: _problems(rng, SIZES[f"{name}_train"], seen, False) for name in ("sft", "dpo", "prompts")}
    files = {}
    for split, problems in (("train", train["sft"]), *held_out.items()):
        files[f"sft/{split}"] = [{"messages": [{"role": "user", "content": question(a, b)}]
                                  + trajectory(a, b, rng.random() < SFT_WRONG_CALLS), "meta": _meta(a, b)}
                                 for a, b in problems]
    for split, problems in (("train", train["dpo"]), *held_out.items()):
        files[f"dpo/{split}"] = [{"prompt": [{"role": "user", "content": question(a, b)}], "chosen": [_call(a, b)],
                                  "rejected": [_call(a, b // 10)], "meta": _meta(a, b)} for a, b in problems]
    for split, problems in (("train", train["prompts"]), *held_out.items()):
        files[f"prompts/{split}"] = [{"prompt": [{"role": "user", "content": question(a, b)}], "meta": _meta(a, b)}
                                     for a, b in problems]
    return files


def check(row: dict, text: str) -> dict:
    """The judge (`--judge src.embedded.tools_task:check`) of an answer's trajectory as the template wrote it (the
    judges read it with its special tokens: src/tools.py): correct = its final turn is the product; called = its
    first turn made a call that parses; right_call = that call is multiply with the question's factors. score =
    correct, except for an answer that ends at its call with no result after it (a DPO pair's answer, mid-
    conversation): its score is right_call, so the judge tells the pairs' right call from the careless one. reward
    (GRPO's) = correct, plus a little for a right call."""
    meta = row["meta"]
    final = text.rsplit("<|assistant|>", 1)[-1] if "<|tool|>" in text else text
    final = final.replace("<|end|>", "").strip()
    calls = _CALL.findall(text)
    try:
        first = json.loads(calls[0]) if calls else None
    except json.JSONDecodeError:
        first = None
    called = isinstance(first, dict) and first.get("name") == "multiply"
    right_call = called and first.get("arguments") == {"a": meta["a"], "b": meta["b"]}
    correct = final == meta["answer"]
    ends_at_call = bool(calls) and "<|tool|>" not in text
    return {"score": float(right_call if ends_at_call else correct), "correct": correct, "called": called, "right_call": right_call,
            "reward": float(correct) + 0.1 * right_call,
            # per turn (--turn_credit): the call's, then the answer's
            "turn_rewards": [float(right_call), float(correct)] if "<|tool|>" in text else [float(correct)]}


CRITERIA = ("correct", "called", "right_call")


def measure(run_dir: Path, split: str = "test") -> str:
    """A Markdown table of the judge's criteria on the held-out answers of every stage of a run of
    configs/sft_dpo_grpo_tools.yaml (its samples files: untrained, after SFT, after DPO, after GRPO), each share with
    its 95% interval (src/reporting/formatting.py's normal approximation)."""
    def shares(samples: list[dict], side: str) -> list[str]:
        verdicts = [sample["verdict"][side] for sample in samples if sample.get("verdict")]
        cells = []
        for name in CRITERIA:
            share = sum(bool(verdict.get(name)) for verdict in verdicts) / len(verdicts) if verdicts else None
            cells.append("n/a" if share is None else f"{100 * share:.1f}%{ci95(share, len(verdicts))}")
        return cells

    rows, first = [], True
    for stage, directory in (("SFT", run_dir / "sft"), ("DPO", run_dir / "dpo"), ("GRPO", run_dir)):
        path = directory / f"samples_{split}.jsonl"
        if not path.exists():
            continue
        samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if first:
            rows.append(["untrained", str(len(samples)), *shares(samples, "reference")])
            first = False
        rows.append([f"after {stage}", str(len(samples)), *shares(samples, "trained")])
    header = ["model", "prompts", *CRITERIA]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in rows])


def write(directory: Path) -> list[Path]:
    """The data (under directory/data) and the untrained model (directory/model)."""
    paths = []
    files = build()
    for name, rows in files.items():
        path = directory / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    # Every character the data holds (the tool's results too) and the template writes.
    texts = [json.dumps(row) for rows in files.values() for row in rows] + ["0123456789{}[]:,\"*?"]
    tokenizer = build_tokenizer(texts, chat_template=CHAT_TEMPLATE, special_tokens=TOOL_SPECIALS)
    model = build_model(tokenizer, shape=MODEL_SHAPE)
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    return paths + [directory / "model"]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":  # python -m src.embedded.tools_task --measure RUN_DIR
        print(measure(Path(sys.argv[2])))
    else:
        target = Path(sys.argv[1] if len(sys.argv) > 1 else "results/tools_task")
        for written in write(target):
            print(written)
