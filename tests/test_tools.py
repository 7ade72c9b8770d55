"""Tools run while sampling (src/tools.py): the registry and its schemas, each template's call syntax, a misbehaving
tool as a counted error result, the result fed back in the template's tool role, and the trajectory's mask.

All in the test process (the tool worker is the one process started): a scripted sampler stands in for the model, so
each turn's text is written by hand, as the model of that template writes it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import TEMPLATES, build_template_tokenizer
from src.tools import (DEEPSEEK, HARMONY, HERMES, LLAMA_JSON, Call, ToolRunner, ToolSession, ToolsError, call_syntax,
                       load_toolbox, parse_calls, sample_with_tools, schema_problem, summary, tool_result_text,
                       validate)

REGISTRY = "tool_registry:TOOLS"
QUESTION = [{"role": "user", "content": "What is 123 times 456?"}]
ARGUMENTS = {"a": 123, "b": 456}
# template → (the call turn as its model writes it after the generation prompt, its stop token, its final turn)
TURNS = {
    "chatml-qwen2.5": ('<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n</tool_call><|im_end|>',
                       "<|im_end|>", "It is 56088.<|im_end|>"),
    "qwen3": ('<think>\n\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n'
              '</tool_call><|im_end|>', "<|im_end|>", "<think>\n\n</think>\n\nIt is 56088.<|im_end|>"),
    "deepseek-r1": ('\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n'
                    '{"a": 123, "b": 456}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
                    "<｜end▁of▁sentence｜>", "It is 56088.<｜end▁of▁sentence｜>"),
    "llama-3.1": ('{"name": "multiply", "parameters": {"a": 123, "b": 456}}<|eot_id|>', "<|eot_id|>",
                  "It is 56088.<|eot_id|>"),
    "gpt-oss": (' to=functions.multiply<|channel|>commentary json<|message|>{"a": 123, "b": 456}<|call|>', "<|call|>",
                "<|channel|>final<|message|>It is 56088.<|return|>"),
}
# What each template writes after the call turn: the result in its tool role, then its generation prompt (copied from
# the templates' renderings of a conversation with a tool message, by hand).
RESULTS = {
    "chatml-qwen2.5": "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "deepseek-r1": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>56088<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    "llama-3.1": "<|start_header_id|>ipython<|end_header_id|>\n\n\"56088\"<|eot_id|><|start_header_id|>assistant"
                 "<|end_header_id|>\n\n",
    "gpt-oss": '<|start|>functions.multiply to=assistant<|channel|>commentary<|message|>"56088"<|end|><|start|>assistant',
}
SYNTAX = {"chatml-qwen2.5": HERMES, "qwen3": HERMES, "deepseek-r1": DEEPSEEK, "llama-3.1": LLAMA_JSON,
          "gpt-oss": HARMONY}


@pytest.fixture(scope="module")
def tokenizer():
    return build_template_tokenizer(["What is 123 times 456? It is 56088. multiply"])


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(load_toolbox(REGISTRY), timeout_s=2.0) as running:
        yield running


def _use(tokenizer, template: str) -> None:
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    tokenizer.bos_token = "<|begin_of_text|>" if template.startswith("llama") else "<｜begin▁of▁sentence｜>"


def _session(runner, max_tool_turns: int) -> ToolSession:
    return ToolSession(runner.toolbox, runner, max_tool_turns)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_registry_gives_each_function_its_schema_and_refuses_what_it_cannot_run_in_one_line():
    toolbox = load_toolbox(REGISTRY)
    assert sorted(toolbox.schemas) == ["crash", "hang", "multiply", "noisy", "number"]
    parameters = toolbox.schemas["multiply"]["function"]["parameters"]
    assert parameters["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert parameters["required"] == ["a", "b"]
    explicit = load_toolbox("tool_registry:EXPLICIT").schemas["lookup"]["function"]
    assert explicit["name"] == "lookup" and explicit["parameters"]["required"] == ["key"]
    for spec, message in [("tool_registry", "expected module:registry"), ("no_such_module:TOOLS", "cannot import"),
                          ("tool_registry:MISSING", "has no attribute MISSING"),
                          ("tool_registry:NOT_A_REGISTRY", "the registry is a int"),
                          ("tool_registry:UNTYPED", "no schema for untyped from its signature.*type hint")]:
        with pytest.raises(ToolsError, match=message) as raised:
            validate(spec, 4, 5.0)
        assert "\n" not in str(raised.value) and str(raised.value).startswith(f"--tools {spec}")
    with pytest.raises(ToolsError, match="--max_tool_turns 0"):
        validate(None, 0, 5.0)
    with pytest.raises(ToolsError, match="--tool_timeout 0"):
        validate(None, 2, 0)


@pytest.mark.parametrize("template", sorted(TURNS))
def test_each_templates_call_syntax_parses_the_call_its_model_writes(tokenizer, template):
    _use(tokenizer, template)
    assert call_syntax(tokenizer) == SYNTAX[template]
    assert parse_calls(SYNTAX[template], TURNS[template][0]) == [Call("multiply", ARGUMENTS)]
    assert parse_calls(SYNTAX[template], TURNS[template][2]) == []  # a final answer calls nothing


def test_calls_that_do_not_parse_or_break_the_schema_are_named():
    assert parse_calls(HERMES, "<tool_call>\n{not json}\n</tool_call>")[0].problem.startswith("the call is not JSON")
    assert parse_calls(HARMONY, "<|channel|>commentary to=functions.multiply <|constrain|>json<|message|>{\"a\": 1"
                                "<|call|>")[0].problem.startswith("the arguments are not JSON")
    assert parse_calls(HARMONY, '<|channel|>commentary to=functions.multiply <|constrain|>json<|message|>{"a": 1}'
                                "<|call|>") == [Call("multiply", {"a": 1})]  # the recipient after the channel
    assert parse_calls(DEEPSEEK, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function")[0].problem
    schema = load_toolbox(REGISTRY).schemas["multiply"]
    assert schema_problem(schema, ARGUMENTS) is None
    assert schema_problem(schema, {"a": 1}) == "missing argument(s) b"
    assert schema_problem(schema, {"a": 1, "b": 2, "c": 3}) == "unknown argument(s) c"
    assert schema_problem(schema, {"a": "1", "b": 2}) == "argument a is str, not integer"
    assert schema_problem(schema, {"a": True, "b": 2}) == "argument a is bool, not integer"


def test_a_tool_that_raises_returns_no_text_or_hangs_gives_an_error_result_and_the_next_call_still_runs(runner):
    assert runner.run("multiply", ARGUMENTS) == ("56088", None)
    text, error = runner.run("crash", {"a": 1})
    assert error == "raised" and json.loads(text) == {"error": "crash raised RuntimeError: tool exploded"}
    assert runner.run("number", {"a": 1})[1] == "not_text"
    assert runner.run("noisy", {"a": 2}) == ("echo 2", None)  # its print goes to stderr, not into the result
    worker = runner.worker.pid
    text, error = runner.run("hang", {"a": 1})
    assert error == "timeout" and "ran past --tool_timeout 2 s" in json.loads(text)["error"]
    with pytest.raises(ProcessLookupError):  # the hung worker was killed, not left behind
        os.kill(worker, 0)
    assert runner.run("multiply", {"a": 2, "b": 3}) == ("6", None)  # a fresh worker
    os.kill(runner.worker.pid, signal.SIGKILL)  # a worker that dies: an error result, then a fresh one
    runner.worker.wait()
    assert runner.run("multiply", {"a": 2, "b": 4}) == ("8", None)


def test_the_tool_worker_exits_with_the_process_that_started_it(tmp_path):
    """A job killed with -9 leaves no tool worker behind: the worker watches its parent (parent_watch)."""
    import subprocess
    import sys

    script = tmp_path / "starter.py"
    script.write_text("import sys, time\nsys.path[:0] = sys.argv[1:3]\nfrom src.tools import ToolRunner, load_toolbox\n"
                      f"runner = ToolRunner(load_toolbox({REGISTRY!r}), 5.0)\nrunner.run('multiply', {{'a': 1, 'b': 2}})\n"
                      "print(runner.worker.pid, flush=True)\ntime.sleep(600)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    starter = subprocess.Popen([sys.executable, str(script), root, os.path.join(root, "tests")], stdout=subprocess.PIPE,
                               text=True)
    worker = int(starter.stdout.readline())
    starter.kill()
    starter.wait()
    for _ in range(100):  # parent_watch polls every 0.5 s
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the tool worker outlived the process that started it")


@pytest.mark.parametrize("template", sorted(TURNS))
def test_a_trajectory_feeds_the_result_back_in_the_templates_tool_role_and_masks_it(tokenizer, runner, template):
    """The call runs, its result comes back as the template writes a tool message, the model answers; the trajectory
    is exactly the turns written (mask 1) and the result with the template's text around it (mask 0)."""
    _use(tokenizer, template)
    call, stop, final = TURNS[template]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, tools=load_toolbox(REGISTRY).template_tools())["input_ids"]
    asked = []

    def sample(indices, contexts, turn, budgets):
        asked.append((turn, [tokenizer.decode(context) for context in contexts], budgets))
        return [_ids(tokenizer, call if turn == 0 else final) for _ in contexts]

    (trajectory,) = sample_with_tools(sample, tokenizer, [prompt], _session(runner, 3), max_new_tokens=400,
                                      stop_ids=set(_ids(tokenizer, stop)))
    call_ids, result_ids, final_ids = _ids(tokenizer, call), _ids(tokenizer, RESULTS[template]), _ids(tokenizer, final)
    assert trajectory.ids == call_ids + result_ids + final_ids
    assert trajectory.mask == [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(final_ids)
    assert trajectory.record() == {"calls": 1, "valid_calls": 1, "tool_errors": {}, "turns": 2}
    # The second turn is asked from the prompt, the call and the result: the context the model continues.
    assert asked[1][1] == [tokenizer.decode(prompt + call_ids + result_ids)]
    assert asked[1][2] == [400 - len(call_ids) - len(result_ids)]
    # Where the template renders the earlier turn as written, the whole context is its rendering of the conversation
    # with a tool message (Qwen3 and DeepSeek-R1 drop a call turn's reasoning block once a result follows it).
    if template in ("chatml-qwen2.5", "llama-3.1", "gpt-oss"):
        conversation = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "multiply", "arguments": ARGUMENTS}}]},
            {"role": "tool", "name": "multiply", "content": "56088"}]
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False,
                                                 tools=load_toolbox(REGISTRY).template_tools())
        decoded = tokenizer.decode(prompt + call_ids + result_ids)
        assert decoded == rendered


def test_bad_calls_are_counted_errors_the_model_reads_and_turns_and_budget_are_bounded(tokenizer, runner):
    _use(tokenizer, "chatml-qwen2.5")
    turns = ['<tool_call>\n{"name": "divide", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
             '<tool_call>\n{"name": "multiply", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
             '<tool_call>\n{"name": "crash", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
             '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>']
    seen = []

    def sample(indices, contexts, turn, budgets):
        seen.append(tokenizer.decode(contexts[0]))
        return [_ids(tokenizer, turns[turn])]

    (trajectory,) = sample_with_tools(sample, tokenizer, [[]], _session(runner, 3), max_new_tokens=2000,
                                      stop_ids=set(_ids(tokenizer, "<|im_end|>")))
    assert trajectory.turns == 4 and trajectory.calls == 3  # the fourth turn's call is past --max_tool_turns: not run
    assert trajectory.errors == {"unknown": 1, "schema": 1, "raised": 1} and trajectory.valid == 0
    assert "unknown tool divide; the tools are crash, hang, multiply, noisy, number" in seen[1]
    assert "missing argument(s) b" in seen[2] and "crash raised RuntimeError" in seen[3]
    assert summary([trajectory])["errors"] == {"unknown": 1, "schema": 1, "raised": 1}
    # A budget that the result would overrun: the answer ends at its call, counted.
    (short,) = sample_with_tools(lambda indices, contexts, turn, budgets: [_ids(tokenizer, turns[3])], tokenizer,
                                 [[]], _session(runner, 3), max_new_tokens=len(_ids(tokenizer, turns[3])) + 3,
                                 stop_ids=set(_ids(tokenizer, "<|im_end|>")))
    assert short.turns == 1 and short.errors == {"no_budget": 1} and short.mask == [1] * len(short.ids)


def test_a_template_with_no_tool_syntax_is_refused_in_one_line(tokenizer):
    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                               "{% endfor %}")
    with pytest.raises(ToolsError, match="^--tools: the chat template has no tool-call syntax"):
        call_syntax(tokenizer)
    _use(tokenizer, "chatml-qwen2.5")
    assert tool_result_text(tokenizer, "<|im_end|>", [("multiply", "6")]) == RESULTS["chatml-qwen2.5"].replace(
        "56088", "6")
