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


# --- the reasoning variant (--embedded_reasoning, configs/embedded_reasoning.yaml) ---------------------------------


def test_the_reasoning_variant_is_the_same_data_with_each_answer_reasoning_first():
    from src.chat_templates import split_reasoning

    plain, reasoned = generate.build(), generate.build(reasoning=True)
    assert plain.keys() == reasoned.keys()
    for name in plain:
        for row, thought in zip(plain[name], reasoned[name]):
            assert row["meta"] == thought["meta"]
            for key in ("messages", "chosen", "rejected"):
                if key in row:  # every answer: a short <think> block, then the plain answer word for word
                    answer = split_reasoning(thought[key][-1])
                    assert answer.content == row[key][-1]["content"] and 3 <= len(answer.reasoning) <= 20
                    assert thought[key][-1]["content"].startswith("<think>\n")
    add = next(row for row in reasoned["dpo/train"] if row["meta"]["task"] == "add")
    question = add["prompt"][0]["content"]  # "What is 78 + 3?" reasons "78 + 3 = 81"
    assert split_reasoning(add["chosen"][0]).reasoning == f"{question[8:-1]} = {add['meta']['answer']}"


def test_the_reasoning_variants_model_generates_as_r1_distill_and_its_judge_reads_the_final_answer(tmp_path,
                                                                                                  monkeypatch):
    """Its template behaves as DeepSeek-R1-Distill's (generation prompt opening <think>, an assistant message cut to
    what follows </think>), so the prompt + answer ids a stage trains are those of the model writing the answer from
    its generation prompt; decoding keeps the tags; the embedded judge scores the final answer."""
    from transformers import AutoTokenizer

    from src.chat_templates import conversation_ids
    from src.config import EMBEDDED, DataArguments
    from src.data import source_location
    from src.embedded.model import ensure_embedded_model
    from src.judges import judge_for

    monkeypatch.setenv("PREFKIT_CACHE", str(tmp_path))
    assert source_location(DataArguments(dataset_name=EMBEDDED), "dpo") == str(generate.DATA_DIR / "dpo")
    location = source_location(DataArguments(dataset_name=EMBEDDED, embedded_reasoning=True), "dpo")
    assert location.startswith(str(tmp_path / "embedded-data-reasoning-"))
    row = json.loads(open(f"{location}/train.jsonl", encoding="utf-8").readline())
    path = ensure_embedded_model(reasoning=True)
    assert path != ensure_embedded_model() and path.name.startswith("embedded-model-v1-reasoning-")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt_ids, chosen_ids = conversation_ids(tokenizer, row["prompt"], row["chosen"])
    generation_prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert generation_prompt.endswith("<|assistant|><think>\n")
    assert prompt_ids + chosen_ids == tokenizer(generation_prompt + row["chosen"][0]["content"].removeprefix(
        "<think>\n") + "<|end|>", add_special_tokens=False)["input_ids"]
    assert "</think>" not in tokenizer.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)  # R1's cut
    assert tokenizer.tokenize("<think>") == ["<think>"]
    written = tokenizer.decode(chosen_ids, skip_special_tokens=True)  # as a generated answer is decoded
    assert written.startswith(row["chosen"][0]["content"].removeprefix("<think>\n"))
    judge = judge_for("auto", EMBEDDED)
    wrong_reasoning = f"<think>\n0 + 0 = 0\n</think>\n\n{row['meta']['answer']}"  # scored on its final answer
    assert judge.scores([row] * 2, ["<think>\n" + written, wrong_reasoning]) == [3.0, 3.0]


def test_embedded_reasoning_takes_the_embedded_data():
    from src.config_error import ConfigError
    from src.config_parse import parse_config

    with pytest.raises(ConfigError, match="--embedded_reasoning .* takes --dataset_name embedded"):
        parse_config(["--model_name_or_path", "embedded", "--dataset_name", "pairs.jsonl", "--embedded_reasoning",
                      "true"], require_sources=False)
    config = parse_config(["--config", "configs/embedded_reasoning.yaml"])
    assert config.data.embedded_reasoning and config.data.max_length == 96
