"""Prepared-data snapshots: one digest per (shape, stage, option) case of everything `prepare_data` writes.

The digests in `prepared_digests.json` were computed with the list-based preparation that the streaming one
replaced (commit before "data: stream through datasets"), so `tests/test_data.py::test_prepared_output_is_unchanged`
proves the rewrite gives the same rows, token ids, columns, splits and counts. Recompute them only when a change is
meant to change the prepared data:  python tests/prepared_snapshots.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from conftest import build_tiny_tokenizer, preference_rows, write_jsonl  # noqa: E402

DIGESTS = HERE / "prepared_digests.json"
EMBEDDED_DATA = HERE.parent / "src" / "embedded" / "data"
# Count keys the list-based preparation wrote: the digest covers exactly these, so new keys may be added.
COUNT_KEYS = ("rows", "empty_answers", "identical_pairs", "kept", "first_empty_rows", "first_identical_rows",
              "dropped_prompt_too_long", "dropped_too_long", "truncated", "longest_tokens")


def _text(messages):
    return messages[0]["content"]


def _cases(directory: Path) -> dict[str, tuple[str, dict, dict]]:
    """name → (stage, DataArguments fields, SFTArguments fields); the files are written under `directory`."""
    rows = preference_rows(40)
    for index in (3, 17):
        rows[index] = dict(rows[index], rejected=rows[index]["chosen"])  # identical pairs: dropped and counted
    rows[5] = dict(rows[5], chosen=[{"role": "assistant", "content": "  "}])  # an empty answer
    rows[9] = dict(rows[9], prompt=[{"role": "user", "content": "what color is the sky " * 40}])  # too long
    rows[11] = dict(rows[11], chosen=[{"role": "assistant", "content": "the sky is blue " * 12}])  # truncated
    text_rows = [{"prompt": _text(r["prompt"]) + " ", "chosen": _text(r["chosen"]), "rejected": _text(r["rejected"])}
                 for r in rows]
    shapes = {
        "explicit_prompt": rows,
        "text_pairs": text_rows,
        "implicit_prompt": [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                            for r in rows],
        "ultrafeedback": [{"prompt": _text(r["prompt"]), "chosen": r["prompt"] + r["chosen"],
                           "rejected": r["prompt"] + r["rejected"], "score_chosen": 8.0} for r in rows],
        "anthropic_hh": [{"chosen": f"\n\nHuman: {_text(r['prompt'])}\n\nAssistant: {_text(r['chosen'])}",
                          "rejected": f"\n\nHuman: {_text(r['prompt'])}\n\nAssistant: {_text(r['rejected'])}"}
                         for r in rows],
        "orca": [{"system": "be brief" if i % 2 else "", "question": _text(r["prompt"]), "chosen": _text(r["chosen"]),
                  "rejected": _text(r["rejected"])} for i, r in enumerate(rows)],
        "mapped_columns": [{"query": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows],
    }
    sft_shapes = {
        "messages": [{"messages": r["prompt"] + r["chosen"]} for r in rows],
        "sharegpt": [{"conversations": [{"from": "user", "value": _text(r["prompt"])},
                                        {"from": "assistant", "value": _text(r["chosen"])}]} for r in rows],
        "prompt_completion_chat": [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows],
        "prompt_completion_text": [{"prompt": t["prompt"], "completion": t["chosen"]} for t in text_rows],
        "text": [{"text": t["prompt"] + t["chosen"]} for t in text_rows],
        "preference": rows,
        "tools": [{"messages": [{"role": "user", "content": f"how is my heart {i}"},
                                {"role": "assistant", "content": "", "tool_calls": [
                                    {"type": "function", "function": {"name": "rate", "arguments": {}}}]},
                                {"role": "tool", "name": "rate", "content": str(60 + i)},
                                {"role": "assistant", "content": f"your heart rate is {60 + i}"}],
                   "tools": json.dumps([{"type": "function", "function": {
                       "name": "rate", "description": "read it", "parameters": {"type": "object",
                                                                               "properties": {}}}}])}
                  for i in range(20)],
    }
    base = {"val_size": 4, "test_size": 4, "max_length": 48}
    cases = {}
    for name, shape_rows in shapes.items():
        path = str(write_jsonl(directory / f"{name}.jsonl", shape_rows))
        fields = base | {"dataset_name": path}
        if name == "mapped_columns":
            fields |= {"prompt_column": "query", "chosen_column": "good", "rejected_column": "bad"}
        cases[f"dpo/{name}"] = ("dpo", fields, {})
    for name, shape_rows in sft_shapes.items():
        path = str(write_jsonl(directory / f"sft_{name}.jsonl", shape_rows))
        cases[f"sft/{name}"] = ("sft", base | {"dataset_name": path}, {})
        if name in ("messages", "prompt_completion_chat"):
            cases[f"sft/{name}/assistant_only"] = ("sft", base | {"dataset_name": path}, {"assistant_only_loss": True})
    explicit = cases["dpo/explicit_prompt"][1]
    cases["reward/explicit_prompt"] = ("reward", explicit, {})
    cases["dpo/system_prompt_fraction_split"] = ("dpo", explicit | {"system_prompt": "be kind", "val_size": 0.1,
                                                                     "test_size": 0.0, "max_train_samples": 20}, {})
    split_dir = directory / "split_dir"
    write_jsonl(split_dir / "train.jsonl", rows[:30])
    write_jsonl(split_dir / "validation.jsonl", rows[30:35])
    write_jsonl(split_dir / "test.jsonl", rows[35:])
    cases["dpo/split_directory"] = ("dpo", base | {"dataset_name": str(split_dir)}, {})
    for stage, shipped in (("dpo", "dpo"), ("reward", "dpo"), ("sft", "sft")):
        cases[f"{stage}/shipped"] = ("sft" if stage == "sft" else stage,
                                     {"dataset_name": str(EMBEDDED_DATA / shipped), "max_length": 64}, {})
    return cases


def _no_template_cases(directory: Path) -> dict:
    """Transcript shapes on a tokenizer without a chat template stay text."""
    cases = _cases(directory)
    return {f"{name}/no_template": cases[name] for name in ("dpo/anthropic_hh", "dpo/orca", "dpo/text_pairs")}


def tokenizers():
    corpus = [" ".join(r["prompt"][0]["content"] + " " + r["chosen"][0]["content"] for r in preference_rows(64))]
    with_template = build_tiny_tokenizer(corpus)
    without = build_tiny_tokenizer(corpus)
    without.chat_template = None
    return with_template, without


def _without_null_fields(value):
    """A message's keys that Arrow filled with None (a struct column unifies the keys of every row's messages) are
    no part of the data: a `Json` column keeps each message as written."""
    if isinstance(value, list):
        return [_without_null_fields(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_null_fields(item) for key, item in value.items() if item is not None}
    return value


def digest(prepared) -> str:
    """sha256 of every split's rows (all columns, keys sorted) and of the counts the old preparation wrote."""
    content = {
        "shape": prepared.summary["shape"],
        "splits": {kind: {
            "columns": sorted(dataset.column_names),
            "rows": [json.dumps({key: _without_null_fields(value) if isinstance(value, list) else value
                                 for key, value in row.items()}, sort_keys=True) for row in dataset.to_list()],
            "counts": {key: prepared.summary["splits"][kind][key] for key in COUNT_KEYS
                       if key in prepared.summary["splits"][kind]},
        } for kind, dataset in prepared.splits.items()},
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def compute_all(directory: Path) -> dict[str, str]:
    from src.config import DataArguments, SFTArguments
    import datasets

    from src.data import prepare_data

    datasets.disable_progress_bars()

    with_template, without = tokenizers()
    results = {}
    for cases, tokenizer in ((_cases(directory / "t"), with_template), (_no_template_cases(directory / "n"), without)):
        for name, (stage, data_fields, sft_fields) in cases.items():
            prepared = prepare_data(DataArguments(**data_fields), SFTArguments(**sft_fields), stage, 7, tokenizer,
                                    directory / "cache")
            results[name] = digest(prepared)
    return results


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as temporary:
        computed = compute_all(Path(temporary))
    if "--write" in sys.argv:
        DIGESTS.write_text(json.dumps(computed, indent=1, sort_keys=True) + "\n")
    print(json.dumps(computed, indent=1, sort_keys=True))
