"""What is trained is what the model continues at generation: a table of real chat templates (tests/chat_templates/,
copied from the models' tokenizer_config.json) where prompt + answer ids must equal the ids of generating that answer.

Each row's expected continuation is written by hand from how that model writes an answer after its generation prompt
(DeepSeek-R1's opens `<think>\\n`, so the model writes its reasoning, `</think>`, the answer, its end of sentence;
gpt-oss writes an analysis channel then a final one; ...), never computed by the code under test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import TEMPLATES, build_template_tokenizer
from src.chat_templates import TemplateCannotExpress, answer_text, conversation_ids
from src.data import sample_fields, tokenize_preference, tokenize_sft, tokenize_unpaired



QUESTION = {"role": "user", "content": "What is 40 plus 2?"}
REASONING = "Add 40 and 2."
FINAL = "The sum is 42."
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
EARLIER = [QUESTION, {"role": "assistant", "content": "<think>\nfirst\n</think>\n\nIt is 42."},
           {"role": "user", "content": "And 40 plus 3?"}]
AFTER_TOOL = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "42"}]
SECOND_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 42, "b": 3}}}

# case → (prompt, answer message): a plain answer; reasoning inside the content; reasoning in a field; a tool call with
# and without reasoning; multi-turn (earlier reasoning in the prompt); the answer after a tool's result.
CASES = {
    "plain": ([QUESTION], {"role": "assistant", "content": FINAL}),
    "reasoning_inline": ([QUESTION], {"role": "assistant", "content": f"<think>\n{REASONING}\n</think>\n\n{FINAL}"}),
    "reasoning_field": ([QUESTION], {"role": "assistant", "content": FINAL, "reasoning_content": REASONING}),
    "tool_call": ([QUESTION], {"role": "assistant", "content": "", "tool_calls": [CALL]}),
    "tool_call_reasoning": ([QUESTION], {"role": "assistant", "content": "", "reasoning_content": REASONING,
                                         "tool_calls": [CALL]}),
    "multi_turn": (EARLIER, {"role": "assistant", "content": "<think>\nAdd 40 and 3.\n</think>\n\nIt is 43."}),
    "after_tool": (AFTER_TOOL, {"role": "assistant", "content": f"<think>\n{REASONING}\n</think>\n\n{FINAL}"}),
    # A tool call after a tool's result (the prompt holds the earlier call, its result and the schemas).
    "call_after_tool": (AFTER_TOOL, {"role": "assistant", "content": "", "tool_calls": [SECOND_CALL]}),
}
# An answer that holds a tool's result: refused by every template (the result would train as the model's words).
TRAJECTORY = [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "42"},
              {"role": "assistant", "content": FINAL}]

R1_EOS = "<｜end▁of▁sentence｜>"
R1_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 40, \"b\": 2}\n```"
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + R1_EOS)
QWEN_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call><|im_end|>\n'
GPT_OSS_ANALYSIS = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant"
GPT_OSS_CALL = ' to=functions.add<|channel|>commentary json<|message|>{"a": 40, "b": 2}<|call|>'
QWEN_CALL_2 = '<tool_call>\n{"name": "add", "arguments": {"a": 42, "b": 3}}\n</tool_call><|im_end|>\n'
GPT_OSS_CALL_2 = ' to=functions.add<|channel|>commentary json<|message|>{"a": 42, "b": 3}<|call|>'
THINKING_OFF = "its generation prompt closes the reasoning block"
LATER_CALL = "writes a tool call that follows earlier calls"
NO_FIELD = "'reasoning_content' field, which this template ignores"
NO_TOOLS = "drops the answer's tool calls"

# template → {case: what the model writes after its generation prompt, or the start of the one-line refusal}
EXPECTED = {
    "deepseek-r1": {
        "plain": f"\n</think>\n\n{FINAL}{R1_EOS}",  # no reasoning: the block the generation prompt opened, empty
        "reasoning_inline": f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "reasoning_field": f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "tool_call": f"\n</think>\n\n{R1_CALL}",
        "tool_call_reasoning": f"{REASONING}\n</think>\n\n{R1_CALL}",
        "multi_turn": f"Add 40 and 3.\n</think>\n\nIt is 43.{R1_EOS}",
        # After a tool's output R1's generation prompt is "<｜tool▁outputs▁end｜>" alone: the model writes the block.
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "call_after_tool": TemplateCannotExpress(LATER_CALL),
    },
    "deepseek-r1-distill": {
        "plain": f"\n</think>\n\n{FINAL}{R1_EOS}",
        "reasoning_inline": f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "reasoning_field": f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "tool_call": TemplateCannotExpress(NO_TOOLS),  # the distills' template drops tool_calls beside content
        "tool_call_reasoning": TemplateCannotExpress(NO_TOOLS),
        "multi_turn": f"Add 40 and 3.\n</think>\n\nIt is 43.{R1_EOS}",
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "call_after_tool": TemplateCannotExpress(NO_TOOLS),
    },
    # The distills' template as first released: its generation prompt without <think>.
    "deepseek-r1-distill-first-release": {
        "plain": f"{FINAL}{R1_EOS}",
        "reasoning_inline": f"<think>\n{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "reasoning_field": f"<think>\n{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "tool_call": TemplateCannotExpress(NO_TOOLS),
        "tool_call_reasoning": TemplateCannotExpress(NO_TOOLS),
        "multi_turn": f"<think>\nAdd 40 and 3.\n</think>\n\nIt is 43.{R1_EOS}",
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}{R1_EOS}",
        "call_after_tool": TemplateCannotExpress(NO_TOOLS),
    },
    "qwen3": {
        "plain": f"<think>\n\n</think>\n\n{FINAL}<|im_end|>\n",
        "reasoning_inline": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|im_end|>\n",
        "reasoning_field": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|im_end|>\n",
        "tool_call": f"<think>\n\n</think>\n\n{QWEN_CALL}",
        "tool_call_reasoning": f"<think>\n{REASONING}\n</think>\n\n{QWEN_CALL}",
        "multi_turn": "<think>\nAdd 40 and 3.\n</think>\n\nIt is 43.<|im_end|>\n",
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|im_end|>\n",
        "call_after_tool": f"<think>\n\n</think>\n\n{QWEN_CALL_2}",
    },
    "qwen3/thinking-off": {  # the generation prompt ends with an empty <think>\n\n</think>\n\n
        "plain": f"{FINAL}<|im_end|>\n",
        "reasoning_inline": TemplateCannotExpress(THINKING_OFF),
        "reasoning_field": TemplateCannotExpress(THINKING_OFF),
        "tool_call": QWEN_CALL,
        "tool_call_reasoning": TemplateCannotExpress(THINKING_OFF),
        "multi_turn": TemplateCannotExpress(THINKING_OFF),
        "after_tool": TemplateCannotExpress(THINKING_OFF),
        "call_after_tool": QWEN_CALL_2,
    },
    "gpt-oss": {  # reasoning in any shape goes to the `thinking` field, which gpt-oss writes as its analysis channel
        "plain": f"<|channel|>final<|message|>{FINAL}<|return|>",
        "reasoning_inline": f"{GPT_OSS_ANALYSIS}<|channel|>final<|message|>{FINAL}<|return|>",
        "reasoning_field": f"{GPT_OSS_ANALYSIS}<|channel|>final<|message|>{FINAL}<|return|>",
        "tool_call": GPT_OSS_CALL,
        "tool_call_reasoning": GPT_OSS_ANALYSIS + GPT_OSS_CALL,
        "multi_turn": "<|channel|>analysis<|message|>Add 40 and 3.<|end|><|start|>assistant<|channel|>final<|message|>"
                      "It is 43.<|return|>",
        "after_tool": f"{GPT_OSS_ANALYSIS}<|channel|>final<|message|>{FINAL}<|return|>",
        "call_after_tool": GPT_OSS_CALL_2,
    },
    "chatml-qwen2.5": {  # no reasoning syntax: reasoning inside the content is trained as the data writes it
        "plain": f"{FINAL}<|im_end|>\n",
        "reasoning_inline": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|im_end|>\n",
        "reasoning_field": TemplateCannotExpress(NO_FIELD),
        "tool_call": QWEN_CALL,
        "tool_call_reasoning": TemplateCannotExpress(NO_FIELD),
        "multi_turn": "<think>\nAdd 40 and 3.\n</think>\n\nIt is 43.<|im_end|>\n",
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|im_end|>\n",
        "call_after_tool": QWEN_CALL_2,
    },
    "llama-3.1": {
        "plain": f"{FINAL}<|eot_id|>",
        "reasoning_inline": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|eot_id|>",
        "reasoning_field": TemplateCannotExpress(NO_FIELD),
        "tool_call": '{"name": "add", "parameters": {"a": 40, "b": 2}}<|eot_id|>',
        "tool_call_reasoning": TemplateCannotExpress(NO_FIELD),
        "multi_turn": "<think>\nAdd 40 and 3.\n</think>\n\nIt is 43.<|eot_id|>",
        "after_tool": f"<think>\n{REASONING}\n</think>\n\n{FINAL}<|eot_id|>",
        "call_after_tool": '{"name": "add", "parameters": {"a": 42, "b": 3}}<|eot_id|>',
    },
}
EXPECTED["qwen3-generation-markers"] = EXPECTED["qwen3"]  # the markers change no text: the same answers
TABLE = [(template, case) for template, cases in EXPECTED.items() for case in cases]


@pytest.fixture(scope="module")
def tokenizer():
    return build_template_tokenizer([FINAL, REASONING, "What is 40 plus 2? And 40 plus 3? It is 43. first add the sum"])


def _use(tokenizer, template: str) -> dict:
    """The tokenizer with the template's Jinja; the template's keyword arguments (Qwen3's thinking switch)."""
    name, _, variant = template.partition("/")
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    tokenizer.bos_token = "<|begin_of_text|>" if name.startswith("llama") else "<｜begin▁of▁sentence｜>"
    return {"enable_thinking": False} if variant == "thinking-off" else {}


def _case(template: str, case: str):
    """The case's messages in the shape the template's family takes: DeepSeek's tool calls carry their arguments as
    JSON text (its template concatenates them)."""
    prompt, answer = json.loads(json.dumps(CASES[case]))
    if template.startswith("deepseek"):
        for message in prompt + [answer]:
            for call in message.get("tool_calls") or []:
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return prompt, [answer], ({"tools": TOOLS} if "tool" in case else {})


@pytest.mark.parametrize("template,case", TABLE, ids=[f"{t}:{c}" for t, c in TABLE])
def test_prompt_and_answer_ids_are_the_ids_of_generating_the_answer(tokenizer, template, case):
    kwargs = _use(tokenizer, template)
    prompt, answer, tools = _case(template, case)
    expected = EXPECTED[template][case]
    if isinstance(expected, TemplateCannotExpress):
        with pytest.raises(TemplateCannotExpress, match=str(expected)):
            conversation_ids(tokenizer, prompt, answer, **tools, **kwargs)
        return
    prompt_ids, answer_ids = conversation_ids(tokenizer, prompt, answer, **tools, **kwargs)
    # The prompt: exactly the ids generation starts from, as the held-out samples and the rounds build them.
    generation_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                   **tools, **kwargs)["input_ids"]
    assert prompt_ids == generation_ids
    if not kwargs:  # the held-out samples and the rounds render with the template's defaults
        assert prompt_ids == sample_fields({"prompt": prompt, "completion": answer, **tools}, tokenizer)[
            "sample_prompt_ids"]
    # The answer: what the model writes from there, as its own tokens (generation never re-tokenizes the prompt).
    assert answer_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompt_ids + answer_ids) == tokenizer.decode(generation_ids) + expected


R1_ROW = {"prompt": [QUESTION],
          "chosen": [{"role": "assistant", "content": f"<think>\n{REASONING}\n</think>\n\n{FINAL}"}],
          "rejected": [{"role": "assistant", "content": "<think>\nGuess.\n</think>\n\nThe sum is 41."}]}


def test_r1_answers_keep_their_reasoning_where_trls_common_prefix_drops_it(tokenizer):
    """The issue's case: TRL's boundary (common prefix of the prompt and prompt + answer) trains R1's answers without
    their reasoning, on "<｜Assistant｜>The sum…" that generation never meets; ours trains what generation writes."""
    from trl.data_utils import _tokenize, common_prefix_length

    _use(tokenizer, "deepseek-r1-distill")
    ours = tokenize_preference(R1_ROW, tokenizer)
    prompt = _tokenize(tokenizer, R1_ROW["prompt"], add_generation_prompt=True)["input_ids"]
    full = _tokenize(tokenizer, R1_ROW["prompt"] + R1_ROW["chosen"])["input_ids"]
    trl_answer = tokenizer.decode(full[common_prefix_length(prompt, full):])
    assert REASONING not in trl_answer and FINAL in trl_answer
    assert tokenizer.decode(ours["chosen_ids"]) == f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}"
    assert tokenizer.decode(ours["rejected_ids"]) == f"Guess.\n</think>\n\nThe sum is 41.{R1_EOS}"
    assert tokenizer.decode(ours["prompt_ids"]).endswith("<｜Assistant｜><think>\n")
    unpaired = tokenize_unpaired({"prompt": R1_ROW["prompt"], "completion": R1_ROW["chosen"]}, tokenizer)
    assert unpaired == {"prompt_ids": ours["prompt_ids"], "completion_ids": ours["chosen_ids"]}
    sft = tokenize_sft({"prompt": R1_ROW["prompt"], "completion": R1_ROW["chosen"]}, tokenizer, False, None)
    assert sft["input_ids"] == ours["prompt_ids"] + ours["chosen_ids"]
    assert sft["completion_mask"] == [0] * len(ours["prompt_ids"]) + [1] * len(ours["chosen_ids"])
    chat = tokenize_sft({"messages": EARLIER + R1_ROW["chosen"]}, tokenizer, True, None)
    earlier = conversation_ids(tokenizer, EARLIER, R1_ROW["chosen"])  # (prompt ids, answer ids)
    assert chat["input_ids"] == earlier[0] + earlier[1]
    assert chat["assistant_masks"] == [0] * len(earlier[0]) + [1] * len(earlier[1])


@pytest.mark.parametrize("template", ["deepseek-r1-distill", "qwen3", "gpt-oss", "llama-3.1"])
def test_dropping_the_reasoning_trains_the_final_answer_as_the_template_writes_it_without(tokenizer, template):
    kwargs = _use(tokenizer, template)
    _, answer = answer_text(tokenizer, [QUESTION], [CASES["reasoning_field"][1]], keep_reasoning=False, **kwargs)
    plain = answer_text(tokenizer, [QUESTION], [CASES["plain"][1]], **kwargs)[1]
    assert REASONING not in answer and answer == plain


def _r1_pairs(count: int) -> list[dict]:
    """Pairs whose answers reason first (the issue's shape); every third rejected answer reaches the chosen's final
    answer by another reasoning."""
    rows = []
    for index in range(count):
        total = index + 2 * index
        rejected = (f"<think>\nAdd {index} and {2 * index} quickly.\n</think>\n\nThe sum is {total}." if index % 3 == 1
                    else f"<think>\nGuess.\n</think>\n\nThe sum is {total + 1}.")
        rows.append({"prompt": [{"role": "user", "content": f"What is {index} plus {2 * index}?"}],
                     "chosen": [{"role": "assistant", "content": f"<think>\nAdd {index} and {2 * index}, then check "
                                 f"it digit by digit.\n</think>\n\nThe sum is {total}."}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


@pytest.mark.parametrize("stage", ["dpo", "reward", "kto", "sft"])
def test_every_stage_prepares_r1_answers_with_their_reasoning_and_audits_it(tokenizer, stage, tmp_path):
    """Prepared through src/data/ as a run prepares them: every stage trains the reasoning after the generation
    prompt's <think>, and the data audit counts it."""
    from conftest import write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import format_summary, prepare_data

    _use(tokenizer, "deepseek-r1-distill")
    path = write_jsonl(tmp_path / "r1.jsonl", _r1_pairs(40))
    data = DataArguments(dataset_name=str(path), val_size=4, test_size=4, max_length=256,
                         kto_from_pairs=stage == "kto")
    prepared = prepare_data(data, SFTArguments(), stage, 0, tokenizer, tmp_path / "cache")
    row = prepared.train[0]
    sequence = {"dpo": lambda: row["prompt_ids"] + row["chosen_ids"], "reward": lambda: row["chosen_ids"],
                "kto": lambda: row["prompt_ids"] + row["completion_ids"], "sft": lambda: row["input_ids"]}[stage]()
    text = tokenizer.decode(sequence)
    assert "<｜Assistant｜><think>\n" in text and "</think>\n\nThe sum is" in text and text.endswith(R1_EOS)
    assert "then check it digit by digit" in text or stage == "kto"  # a KTO row may be a rejected answer
    train = prepared.summary["audit"]["train"]
    side = "completion" if stage in ("kto", "sft") else "chosen"
    assert train[f"{side}_reasoning_share"] == 1.0 and train[f"{side}_reasoning_tokens"]["mean"] > 5
    assert "reasoning: kept (--reasoning keep, the default)" in format_summary(prepared.summary)
    if stage == "dpo":
        assert train["only_reasoning_differs_share"] == pytest.approx(10 / 32, abs=0.1)


def test_dropping_the_reasoning_drops_pairs_that_differ_only_in_it_and_the_audit_names_the_flags(tokenizer, tmp_path):
    from conftest import write_jsonl
    from src.audit.findings import data_alerts
    from src.config import DataArguments, SFTArguments
    from src.data import format_summary, prepare_data

    _use(tokenizer, "deepseek-r1-distill")
    path = write_jsonl(tmp_path / "r1.jsonl", _r1_pairs(60))
    short = prepare_data(DataArguments(dataset_name=str(path), val_size=4, test_size=4, max_length=24), SFTArguments(),
                         "dpo", 0, tokenizer, tmp_path / "keep")
    codes = {alert.code: alert for alert in data_alerts(short.summary["audit"], "dpo")}
    assert "--max_length" in codes["data_reasoning_cut"].advice and "--reasoning drop" in codes[
        "data_reasoning_cut"].advice
    assert "--reasoning drop" in codes["data_only_reasoning_differs"].advice
    # The --max_length the launcher suggests keeps 99% of the pairs whole with their reasoning, as trained
    kept_lengths = [len(row["prompt_ids"]) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))
                    for row in short.train]
    suggested = short.summary["audit"]["train"]["suggested_max_length"]
    assert short.summary["audit"]["train"]["chosen_tokens"]["median"] == np.median(  # the answers as trained
        [len(row["chosen_ids"]) for row in short.train])
    assert suggested == math.ceil(float(np.percentile(kept_lengths, 99)) / 64) * 64 and suggested > 24
    assert f"--max_length {suggested} keeps 99%" in codes["data_reasoning_cut"].advice
    dropped = prepare_data(DataArguments(dataset_name=str(path), val_size=4, test_size=4, max_length=256,
                                         reasoning="drop"), SFTArguments(), "dpo", 0, tokenizer, tmp_path / "drop")
    identical = dropped.summary["splits"]["train"]["identical_pairs"]
    assert identical > 0  # the pairs that differed only in reasoning
    assert dropped.summary["audit"]["train"]["identical_by_reasoning_drop"] == identical
    assert "reasoning: dropped (--reasoning drop)" in format_summary(dropped.summary)
    assert f"{identical} pairs with chosen == rejected dropped ({identical} differ only in their reasoning, which " \
           "--reasoning drop removes)" in format_summary(dropped.summary)
    # The alert names the drop, not a broken export (the rows are many enough here: IDENTICAL's 1%)
    alert = {alert.code: alert for alert in data_alerts(dropped.summary["audit"], "dpo")}["data_identical"]
    assert "once their reasoning is dropped" in alert.title and "--reasoning keep" in alert.advice
    assert "broken export" not in alert.advice
    for row in dropped.train:
        assert tokenizer.decode(row["chosen_ids"]).startswith("\n</think>\n\nThe sum is")
    assert "chosen_reasoning_cut_share" not in dropped.summary["audit"]["train"]


def test_a_sampled_r1_answer_prepared_as_a_round_pair_trains_the_ids_the_model_generated(tokenizer):
    """On-policy rounds: the answer generated after R1's "<think>\n" (decoded, prefixed with the block its prompt
    opened: src/generation.py), written as a pair and prepared, trains exactly the ids that were generated."""
    from src.chat_templates import opened_reasoning
    from src.rounds import _as_answer

    _use(tokenizer, "deepseek-r1-distill")
    prompt_ids = tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    generated = tokenizer(f"{REASONING}\n</think>\n\n{FINAL}{R1_EOS}", add_special_tokens=False)["input_ids"]
    text = opened_reasoning(tokenizer, prompt_ids) + tokenizer.decode(generated, skip_special_tokens=True)
    assert text == f"<think>\n{REASONING}\n</think>\n\n{FINAL}"
    pair = {"prompt": [QUESTION], "chosen": _as_answer([QUESTION], text), "rejected": _as_answer([QUESTION], "x")}
    ids = tokenize_preference(pair, tokenizer)
    assert ids["prompt_ids"] == prompt_ids and ids["chosen_ids"] == generated


def test_tool_call_pairs_from_a_file_prepare_as_generated_with_r1s_template(tokenizer, tmp_path):
    """Tool calls and plain answers in one column of a file, prepared with DeepSeek-R1's template: each trains as R1
    writes it, after an empty reasoning block."""
    from conftest import write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data

    _use(tokenizer, "deepseek-r1")
    call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 40, "b": 2})}}
    calls = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    rows = [{"prompt": [QUESTION], "chosen": calls if index % 2 else [{"role": "assistant", "content": FINAL}],
             "rejected": [{"role": "assistant", "content": f"The sum is {41 + index}."}]} for index in range(12)]
    data = DataArguments(dataset_name=str(write_jsonl(tmp_path / "calls.jsonl", rows)), val_size=2, test_size=2,
                         max_length=256)
    prepared = prepare_data(data, SFTArguments(), "dpo", 0, tokenizer, tmp_path / "cache")
    chosen = {tokenizer.decode(row["chosen_ids"]) for row in prepared.train}
    assert chosen == {f"\n</think>\n\n{R1_CALL}", f"\n</think>\n\n{FINAL}{R1_EOS}"}
    assert all(tokenizer.decode(row["rejected_ids"]).startswith("\n</think>\n\nThe sum is ") for row in prepared.train)


def test_chat_template_kwargs_render_training_and_generation_alike(tokenizer, tmp_path):
    """--chat_template_kwargs '{"enable_thinking": false}' with Qwen3's template: the prepared prompt (and the
    held-out prompt generation starts from) ends with the empty reasoning block thinking-off writes, the answer trains
    after it; reasoning answers under it are refused in one line before training."""
    from conftest import write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.config_parse import parse_config
    from src.data import DataError, prepare_data

    assert parse_config(["--chat_template_kwargs", '{"enable_thinking": false}'],
                        require_sources=False).data.chat_template_kwargs == {"enable_thinking": False}
    _use(tokenizer, "qwen3")
    plain = [{"prompt": [QUESTION], "chosen": [{"role": "assistant", "content": FINAL}],
              "rejected": [{"role": "assistant", "content": "The sum is 41."}]}] * 12
    path = write_jsonl(tmp_path / "plain.jsonl", plain)
    off = {"enable_thinking": False}
    prepared = prepare_data(DataArguments(dataset_name=str(path), val_size=2, test_size=2, chat_template_kwargs=off),
                            SFTArguments(), "dpo", 0, tokenizer, tmp_path / "cache")
    thinking_off = tokenizer.apply_chat_template([QUESTION], tokenize=False, add_generation_prompt=True, **off)
    assert thinking_off.endswith("<think>\n\n</think>\n\n")
    assert tokenizer.decode(prepared.train[0]["prompt_ids"]) == thinking_off
    assert tokenizer.decode(prepared.test[0]["sample_prompt_ids"]) == thinking_off
    assert tokenizer.decode(prepared.train[0]["chosen_ids"]).startswith(FINAL)
    default = prepare_data(DataArguments(dataset_name=str(path), val_size=2, test_size=2), SFTArguments(), "dpo", 0,
                           tokenizer, tmp_path / "cache")
    assert default.path != prepared.path and not tokenizer.decode(default.train[0]["prompt_ids"]).endswith(
        "</think>\n\n")
    reasoning = write_jsonl(tmp_path / "reasoning.jsonl", [R1_ROW] * 12)
    with pytest.raises(DataError, match="generation prompt closes the reasoning block.*--reasoning drop"):
        prepare_data(DataArguments(dataset_name=str(reasoning), val_size=2, test_size=2, chat_template_kwargs=off),
                     SFTArguments(), "dpo", 0, tokenizer, tmp_path / "cache")


def test_a_generated_gpt_oss_answer_keeps_its_channels_apart_and_trains_back_as_generated(tokenizer):
    """skip_special_tokens would run gpt-oss's channels together ("Add 40 and 2.assistantThe sum is 42."): a generated
    answer is read as its analysis (reasoning) then its final answer, judged on the final answer, and as a round pair
    trains exactly the ids that were generated (its reasoning back in the `thinking` field gpt-oss renders)."""
    from src.chat_templates import decoded_answer, final_answer
    from src.rounds import _as_answer

    _use(tokenizer, "gpt-oss")
    prompt_ids = tokenizer.apply_chat_template([QUESTION], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    generated = tokenizer(f"{GPT_OSS_ANALYSIS}<|channel|>final<|message|>{FINAL}<|return|>",
                          add_special_tokens=False)["input_ids"]
    padding = [tokenizer.pad_token_id] * 3  # a batch's shorter answers end in padding
    assert tokenizer.decode(generated, skip_special_tokens=True) != FINAL
    text = decoded_answer(tokenizer, generated + padding)
    assert text == f"<think>\n{REASONING}\n</think>\n\n{FINAL}" and final_answer(text) == FINAL
    pair = {"prompt": [QUESTION], "chosen": _as_answer([QUESTION], text), "rejected": _as_answer([QUESTION], "x")}
    ids = tokenize_preference(pair, tokenizer)
    assert ids["prompt_ids"] == prompt_ids and ids["chosen_ids"] == generated
    cut = tokenizer(f"<|channel|>analysis<|message|>{REASONING}", add_special_tokens=False)["input_ids"]
    assert decoded_answer(tokenizer, cut) == f"<think>\n{REASONING}" and final_answer(decoded_answer(tokenizer, cut)) == ""
    call = tokenizer(GPT_OSS_ANALYSIS + GPT_OSS_CALL, add_special_tokens=False)["input_ids"]
    assert "<|channel|>commentary" in decoded_answer(tokenizer, call)  # a tool call keeps its markers
    _use(tokenizer, "deepseek-r1-distill")  # any other template: as skip_special_tokens decodes it
    plain = tokenizer(f"{FINAL}<｜end▁of▁sentence｜>", add_special_tokens=False)["input_ids"]
    assert decoded_answer(tokenizer, plain) == FINAL


@pytest.mark.parametrize("template", sorted(EXPECTED))
def test_an_answer_holding_a_tools_result_is_refused_by_every_template(tokenizer, template):
    """A tool's result is never trained as the model's words: an answer that holds one ([call, result, answer]) is
    refused in one line naming the fix, whatever the template renders."""
    kwargs = _use(tokenizer, template)
    trajectory = json.loads(json.dumps(TRAJECTORY))
    if template.startswith("deepseek"):
        trajectory[0]["tool_calls"][0]["function"]["arguments"] = json.dumps(CALL["function"]["arguments"])
    with pytest.raises(TemplateCannotExpress, match="holds a tool's result.*put the turns up to the last tool result"):
        conversation_ids(tokenizer, [QUESTION], trajectory, tools=TOOLS, **kwargs)


def _tool_rows(shape: str) -> list[dict]:
    """Rows whose prompt holds an earlier call, its result and the schemas: pairs (a right and a wrong second call),
    thumbs rows, prompts alone."""
    prompt = AFTER_TOOL
    right = [{"role": "assistant", "content": "", "tool_calls": [SECOND_CALL]}]
    wrong = [{"role": "assistant", "content": "", "tool_calls": [CALL]}]  # calls add(40, 2) again
    rows = []
    for index in range(12):
        row = {"prompt": [{"role": "user", "content": f"What is 40 plus 2 plus 3? ({index})"}] + prompt[1:],
               "tools": json.dumps(TOOLS)}
        if shape == "pairs":
            row |= {"chosen": right, "rejected": wrong}
        elif shape == "thumbs":
            row |= {"completion": right if index % 2 else wrong, "label": bool(index % 2)}
        rows.append(row)
    return rows


@pytest.mark.parametrize("shape,stage", [("pairs", "dpo"), ("thumbs", "kto"), ("prompts", "grpo")])
def test_rows_after_a_tool_result_train_the_next_call_and_never_the_result(tokenizer, tmp_path, shape, stage):
    """Preference pairs, thumbs rows and prompts whose conversation holds an earlier call, its result and a `tools`
    column, prepared as a run prepares them (Qwen3's template): the prompt is exactly what generation starts from (the
    schemas, the earlier call, the result in the template's tool role, the generation prompt), and what trains is the
    next call as the model writes it; the tool's result is in no answer's ids."""
    from conftest import write_jsonl
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data

    _use(tokenizer, "qwen3")
    path = write_jsonl(tmp_path / f"{shape}.jsonl", _tool_rows(shape))
    prepared = prepare_data(DataArguments(dataset_name=str(path), val_size=2, test_size=2, max_length=4096),
                            SFTArguments(), stage, 0, tokenizer, tmp_path / "cache")
    result = "<tool_response>\n42\n</tool_response>"
    for row in prepared.train:
        prompt = tokenizer.decode(row["prompt_ids"])
        assert '"name": "add"' in prompt.split("<|im_start|>user")[0]  # the schemas, in the system turn
        assert prompt.endswith(f"{result}<|im_end|>\n<|im_start|>assistant\n")
        answers = [row[key] for key in ("chosen_ids", "rejected_ids", "completion_ids") if key in row]
        assert (not answers) == (shape == "prompts")
        for ids in answers:
            text = tokenizer.decode(ids)
            assert text.startswith("<think>\n\n</think>\n\n<tool_call>\n") and result not in text
    if shape == "pairs":
        assert tokenizer.decode(prepared.train[0]["chosen_ids"]) == f"<think>\n\n</think>\n\n{QWEN_CALL_2}"
