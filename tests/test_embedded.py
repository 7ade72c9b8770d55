"""The embedded default: shipped data is reproducible, held-out questions never leak, the judge reads answers right."""

from __future__ import annotations

import json

import pytest

from src.embedded import generate
from src.embedded.tasks import SIGN_OFF, check


def test_shipped_data_is_exactly_what_the_generator_writes():
    for name, rows in generate.build().items():
        shipped = (generate.DATA_DIR / f"{name}.jsonl").read_text(encoding="utf-8")
        assert shipped == generate.render(rows), f"{name}.jsonl differs: run python -m src.embedded.generate"


def test_held_out_questions_never_appear_in_training():
    files = generate.build()
    question = lambda row: (row.get("messages") or row["prompt"])[0]["content"]  # noqa: E731
    training = {question(row) for name in ("sft/train", "dpo/train") for row in files[name]}
    held_out = [question(row) for name in ("sft/validation", "sft/test") for row in files[name]]
    assert len(held_out) == len(set(held_out)) == 900
    assert not training & set(held_out)


def test_sft_data_leans_chatty_and_pairs_prefer_the_direct_answer():
    files = generate.build()
    chatty = sum(row["messages"][1]["content"].endswith(SIGN_OFF) for row in files["sft/train"])
    assert 0.70 < chatty / len(files["sft/train"]) < 0.80
    for row in files["dpo/train"][:50]:
        assert row["chosen"][0]["content"] == row["meta"]["answer"]
        assert row["rejected"][0]["content"] == row["meta"]["answer"] + SIGN_OFF


@pytest.mark.parametrize("text, correct, preferred", [
    ("76", True, True),
    ("76. Hope this helps!", True, False),
    ("  76\n", True, True),
    ("77", False, True),
    ("76. Hope this heeis!", True, False),  # a mangled sign-off is still not the direct style
    ("7", False, True),
    ("", False, False),
    ("The answer is 76", False, False),
])
def test_judge_reads_value_and_style(text, correct, preferred):
    verdict = check({"meta": {"answer": "76"}}, text)
    assert (verdict["correct"], verdict["preferred"], verdict["score"]) == (correct, preferred,
                                                                          float(correct and preferred))


def test_embedded_model_is_built_once_character_level(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from src.embedded.model import ensure_embedded_model

    monkeypatch.setenv("PREFKIT_CACHE", str(tmp_path))
    path = ensure_embedded_model()
    assert ensure_embedded_model() == path and len(list(tmp_path.iterdir())) == 2  # the model and its lock file
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.tokenize("8377 sort") == list("8377 sort")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "42"}],
                                         return_dict=True, return_assistant_tokens_mask=True)
    assert sum(chat["assistant_masks"]) == 3  # "4", "2", <|end|>: the model learns to stop
    model = AutoModelForCausalLM.from_pretrained(path)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    json.loads((path / "config.json").read_text())
