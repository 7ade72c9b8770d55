"""Tools run while sampling (src/tool_calls.py, src/tools.py): the registry and its schemas, each template's call syntax, a misbehaving
tool as a counted error result, the result fed back in the template's tool role, and the trajectory's mask.

All in the test process (the tool worker is the one process started): a scripted sampler stands in for the model, so
each turn's text is written by hand, as the model of that template writes it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import TEMPLATES, build_template_tokenizer
from src.tool_calls import (DEEPSEEK, HARMONY, HERMES, LLAMA_JSON, Call, ToolsError, call_syntax, load_toolbox,
                            parse_calls, schema_problem, validate)
from src.tools import ToolRunner, ToolSession, sample_with_tools, summary, tool_result_text

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
                          ("tool_registry:UNTYPED", "no schema for untyped from its signature.*type hint"),
                          ("tool_registry:SCHEMA_NOT_AN_OBJECT", "the schema of lookup is not a JSON object"),
                          ("tool_registry:SCHEMA_WITHOUT_OBJECT", "the schema of lookup has no parameters of type "
                                                                  "object")]:
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
    script.write_text("import sys, time\nsys.path[:0] = sys.argv[1:3]\nfrom src.tool_calls import load_toolbox\nfrom src.tools import ToolRunner\n"
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


def test_sampling_with_tools_reports_each_batch_of_prompts_as_its_trajectories_finish(tokenizer, runner, monkeypatch):
    """A round's progress line (src/rounds.py) counts what generate's `on_batch` reports. With --tools it reported once,
    after every turn of the process's whole share (on_batch calls [5] here, after all four generate calls); now each
    batch of prompts runs all its turns and is reported before the next one starts, as without tools; the answers are
    each prompt's, in order, from its own seed."""
    from types import SimpleNamespace

    import src.generation as generation

    _use(tokenizer, "chatml-qwen2.5")
    call, stop, final = TURNS["chatml-qwen2.5"]
    events = []

    def scripted(model, tok, contexts, max_new_tokens, batch_size, eos_ids, sampling=None, seeds=None):
        # the first turn calls the tool, the turn after the result answers; each answer names its turn seed
        events.append(("generate", len(contexts)))
        return [_ids(tok, f"{seed % 1000} {final}" if "<tool_response>" in tok.decode(context) else call)
                for context, seed in zip(contexts, seeds)]

    monkeypatch.setattr(generation, "sample_ids", scripted)
    prompts = [_ids(tokenizer, "What is 123 times 456?" + " please" * index) for index in (3, 0, 4, 1, 2)]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=_ids(tokenizer, stop)))  # a turn's end
    answers = generation.generate(model, tokenizer, prompts, 400, 2, generation.Sampling(), list(range(5)),
                                  on_batch=lambda count: events.append(("answered", count)),
                                  tools=_session(runner, 3), trajectories=True)
    # by length: prompts 1 and 3, then 4 and 0, then 2; each batch's two turns, then its report
    assert events == [("generate", 2), ("generate", 2), ("answered", 2)] * 2 + [
        ("generate", 1), ("generate", 1), ("answered", 1)]
    for index, answer in enumerate(answers):
        seed = generation.answer_seed(index, "turn", 1) % 1000
        assert answer["text"].endswith(f"{seed} {final}") and 0 in answer["loss_mask"], index


def test_under_a_sharded_engine_a_process_joins_its_peers_turns_and_batches_with_none_of_its_own(tokenizer, runner,
                                                                                                   monkeypatch):
    """Under ZeRO-3 or FSDP every generate call is a collective (src/generation.py in_lockstep): a process runs as many
    batches and turns as its busiest peer, sampling none of its own where it has no more (held-out prompts that do not
    divide evenly over the processes ended the job before). Here the peer has one more batch, and one more turn in
    each: this process samples 3 turns of each of its batches (the last with none of its own) and 2 of the peer's
    extra batch, its own answers unchanged."""
    from types import SimpleNamespace

    import src.generation as generation

    _use(tokenizer, "chatml-qwen2.5")
    call, stop, final = TURNS["chatml-qwen2.5"]
    events = []

    def scripted(model, tok, contexts, max_new_tokens, batch_size, eos_ids, sampling=None, seeds=None):
        events.append(("generate", len(contexts)))
        return [_ids(tok, final if "<tool_response>" in tok.decode(context) else call) for context in contexts]

    peer_going = [True, True, True, False] * 3 + [True, True, False]  # each keep_sampling's answer from the peer
    monkeypatch.setattr(generation, "sample_ids", scripted)
    monkeypatch.setattr(generation, "in_lockstep", lambda model: True)
    monkeypatch.setattr(generation, "most_on_any_rank", lambda count: [count + 1])
    monkeypatch.setattr(generation, "any_rank", lambda going: [peer_going.pop(0) or going])
    prompts = [_ids(tokenizer, "What is 123 times 456?" + " please" * index) for index in range(5)]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=_ids(tokenizer, stop)))
    answers = generation.generate(model, tokenizer, prompts, 400, 2, tools=_session(runner, 3), details=True,
                                  on_batch=lambda count: events.append(("answered", count)))
    assert events == [("generate", 2), ("generate", 2), ("generate", 0), ("answered", 2)] * 2 + [
        ("generate", 1), ("generate", 1), ("generate", 0), ("answered", 1),
        ("generate", 0), ("generate", 0), ("answered", 0)] and not peer_going
    assert all(answer["text"].endswith(final) and answer["turns"] == 2 for answer in answers)


def test_a_template_with_no_tool_syntax_or_no_result_after_the_models_end_token_is_refused_in_one_line(tokenizer):
    from src.tools import check_template

    tokenizer.chat_template = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                               "{% endfor %}")
    with pytest.raises(ToolsError, match="^--tools: the chat template has no tool-call syntax"):
        call_syntax(tokenizer)
    _use(tokenizer, "gpt-oss")  # its call turns end with <|call|>: a model whose end tokens lack it cannot continue
    assert check_template(tokenizer, set(_ids(tokenizer, "<|call|><|return|>"))) == HARMONY
    with pytest.raises(ToolsError, match="no tool result after a turn that ends with any of the model's end tokens "
                                         r"\(<\|return\|>\)"):
        check_template(tokenizer, set(_ids(tokenizer, "<|return|>")))
    _use(tokenizer, "chatml-qwen2.5")
    assert tool_result_text(tokenizer, "<|im_end|>", [("multiply", "6")]) == RESULTS["chatml-qwen2.5"].replace(
        "56088", "6")


def test_grpo_trains_the_turns_the_model_wrote_and_never_the_tools_result_with_credit_per_turn(tmp_path):
    """GRPO with --tools, in this process on a tiny model with Qwen2.5's template, its sampling scripted (a call, then
    the answer once the result is in the context; every other answer's seed calls a tool that does not exist): the
    tool runs, TRL's loss mask (tool_mask, from the rollout's env_mask) is 0 exactly over the result and the
    template's text around it, the judge reads the whole trajectory, tool use is logged; with --turn_credit 0.5 each
    turn's tokens get the trajectory's advantage plus 0.5 x the turn's score normalised over the group (every answer
    ends right, so the trajectory's advantage is 0 and only the call's turn tells the answers apart)."""
    import statistics
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from conftest import build_tiny_model
    from src.judges import ProgrammaticJudge
    from src.tools import ToolSession
    from src.trainers.grpo import JudgeReward, PreparedGRPOTrainer
    from tool_registry import product_judge

    path = build_tiny_model(tmp_path / "model", ["What is 123 times 456? It is 56088. multiply"],
                            template="chatml-qwen2.5")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, im_end]
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    rows = [{"prompt": QUESTION, "prompt_ids": prompt_ids, "meta": {"product": 56088}}] * 4
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to=[], max_steps=1,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=200, logging_steps=1,
                      save_strategy="no", remove_unused_columns=False, learning_rate=1e-3, beta=0.0)
    trainer = PreparedGRPOTrainer(model=model, processing_class=tokenizer, args=args,
                                  train_dataset=datasets.Dataset.from_list(rows),
                                  reward_funcs=[JudgeReward(ProgrammaticJudge(product_judge), "product")])
    toolbox = load_toolbox("tool_registry:MULTIPLY")
    call, final = TURNS["chatml-qwen2.5"][0], TURNS["chatml-qwen2.5"][2]
    with ToolRunner(toolbox, timeout_s=5.0) as runner:
        trainer.use_tools(ToolSession(toolbox, runner, max_tool_turns=2))
        trainer.turn_credit = 0.5
        wrong = call.replace("multiply", "divide")
        trainer._sampled = lambda contexts, seeds, budget: [  # noqa: SLF001 - the sampling seam of this test
            _ids(tokenizer, final if "<tool_response>" in tokenizer.decode(context) else
                 call if seed % 2 else wrong) for context, seed in zip(contexts, seeds)]
        seen = {}
        compute_loss = trainer._compute_loss

        def recording(model, inputs):
            seen.update(inputs)
            return compute_loss(model, inputs)

        trainer._compute_loss = recording
        trainer.train()
    call_ids, result_ids, final_ids = _ids(tokenizer, call), _ids(tokenizer, RESULTS["chatml-qwen2.5"]), _ids(
        tokenizer, final)
    expected = [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(final_ids)
    completions = [row.tolist() for row in seen["completion_ids"]]
    right = [index for index, row in enumerate(completions) if row[:len(expected)] == call_ids + result_ids + final_ids]
    assert right and len(right) < 4  # both kinds of answer were sampled
    assert seen["tool_mask"][right[0], :len(expected)].tolist() == expected
    history = trainer.state.log_history[0]
    assert history["rewards/product/mean"] == 1.0  # the judge read the final turn after the tool's result
    assert history["tools/calls_per_answer"] == 1.0 and history["tools/errors_per_answer"] == (4 - len(right)) / 4
    turns = [[1.0 if index in right else 0.0, 1.0] for index in range(4)]  # the call's score, the answer's
    values = [value for answer in turns for value in answer]
    mean, spread = statistics.fmean(values), statistics.stdev(values)
    for index in range(4):
        mask = (seen["tool_mask"][index] * seen["completion_mask"][index]).tolist()
        first_turn_end = mask.index(0)
        advantages = seen["advantages"][index]
        assert advantages[0].item() == pytest.approx(0.5 * (turns[index][0] - mean) / (spread + 1e-4), abs=1e-5)
        assert advantages[first_turn_end - 1].item() == advantages[0].item()
        last = max(position for position, token in enumerate(mask) if token)
        assert advantages[last].item() == pytest.approx(0.5 * (1.0 - mean) / (spread + 1e-4), abs=1e-5)


def test_the_answer_audit_reports_tool_use_before_and_after():
    """Held-out answers with --tools carry their tool record (src/generation.py): the audit's calls per answer, valid
    share, errors by kind and turns, before → after, in the console line and the report's table."""
    from src.audit.answers import answers_audit
    from src.reporting.audit import answers_section

    def stats(calls, valid, errors, turns):
        return {"tokens": 20, "ended": True, "repetition": 0.0, "calls": calls, "valid_calls": valid,
                "tool_errors": errors, "turns": turns}

    samples = [{"reference_answer": "x", "trained_answer": "y", "answer_stats": {
        "reference": stats(1, 0, {"unparsed": 1}, 2), "trained": stats(1, 1, {}, 2)}},
        {"reference_answer": "x", "trained_answer": "y", "answer_stats": {
            "reference": stats(0, 0, {}, 1), "trained": stats(2, 1, {"timeout": 1}, 3)}}]
    audit = answers_audit(samples)
    assert audit["tool_calls_per_answer_before"] == 0.5 and audit["tool_calls_per_answer_after"] == 1.5
    assert audit["tool_valid_share_before"] == 0.0 and audit["tool_valid_share_after"] == pytest.approx(2 / 3, abs=1e-6)
    assert audit["tool_errors_before"] == {"unparsed": 1} and audit["tool_errors_after"] == {"timeout": 1}
    assert audit["tool_turns_per_answer_after"] == 2.5
    table = "\n".join(answers_section({"test": audit}))
    assert "| valid calls | 0.0% → 66.7% |" in table and "unparsed 1 → timeout 1" in table
    plain = answers_audit([{"reference_answer": "x", "trained_answer": "y", "answer_stats": {
        "reference": {"tokens": 3, "ended": True, "repetition": 0.0}, "trained": {"tokens": 3, "ended": True,
                                                                                    "repetition": 0.0}}}])
    assert not any(key.startswith("tool_") for key in plain)  # no tools: no tool rows


def test_the_data_audit_counts_calls_that_do_not_parse_name_an_unknown_tool_or_break_the_schema(tmp_path):
    """Rows' tool calls, prepared as a run prepares them (Qwen2.5's template, DeepSeek-style arguments as text too):
    the audit counts every call and each problem, and says so as the stage opens."""
    from conftest import write_jsonl
    from src.audit.run import format_data_audit
    from src.config import DataArguments, SFTArguments
    from src.data import prepare_data

    tokenizer = build_template_tokenizer(["What is 123 times 456? It is 56088. multiply"], "chatml-qwen2.5")
    schemas = json.dumps(load_toolbox("tool_registry:MULTIPLY").template_tools())

    def call(name, arguments):
        return [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": name, "arguments": arguments}}]}]

    answers = [call("multiply", {"a": 1, "b": 2}), call("multiply", '{"a": 1, "b": 2}'), call("multiply", "{oops"),
               call("divide", {"a": 1}), call("multiply", {"a": "one", "b": 2})]
    rows = [{"prompt": [{"role": "user", "content": f"What is {index} times 2? ({index})"}], "tools": schemas,
             "chosen": answers[index % 5], "rejected": [{"role": "assistant", "content": "No idea."}]}
            for index in range(20)]
    prepared = prepare_data(DataArguments(dataset_name=str(write_jsonl(tmp_path / "calls.jsonl", rows)), val_size=0,
                                          test_size=0, max_length=4096), SFTArguments(), "dpo", 0, tokenizer,
                            tmp_path / "cache")
    train = prepared.summary["audit"]["train"]
    assert (train["tool_calls"], train["tool_unparsed"], train["tool_unknown"], train["tool_schema"]) == (20, 4, 4, 4)
    assert "20 tool calls; 4 with arguments that do not parse, 4 naming a tool the row's `tools` lack, 4 breaking " \
           "its schema" in format_data_audit(prepared.summary["audit"], "dpo")
    # A `tools` column that is not JSON: one line naming the row, not a traceback from inside the tokenizing map.
    from src.data import DataError

    broken = write_jsonl(tmp_path / "broken.jsonl", [dict(rows[0], tools="[{not json")] + rows[1:])
    with pytest.raises(DataError, match=r"broken.jsonl row 1: .*its `tools` column is not JSON \(") as raised:
        prepare_data(DataArguments(dataset_name=str(broken), val_size=0, test_size=0, max_length=4096), SFTArguments(),
                     "dpo", 0, tokenizer, tmp_path / "cache")
    assert "\n" not in str(raised.value)


def test_the_embedded_tool_task_holds_out_its_questions_and_judges_trajectories(tmp_path):
    """src/embedded/tools_task.py: held-out questions asked in no training split, SFT calls careless in about
    SFT_WRONG_CALLS of the chats, pairs preferring the right call; its template is Hermes-style with the result in its
    tool role; the judge reads a trajectory's final turn and first call; `measure` tables each stage with intervals."""
    from datasets import Dataset

    from src.audit.judged import judge_pairs
    from src.data import sample_fields, tokenize_preference
    from src.embedded import tools_task
    from src.judges import judge_for
    from src.world import World
    from src.embedded.model import build_tokenizer

    files = tools_task.build()
    held_out = {row["prompt"][0]["content"] for split in ("validation", "test") for row in files[f"prompts/{split}"]}
    asked = {row["messages"][0]["content"] for row in files["sft/train"]} | {
        row["prompt"][0]["content"] for name in ("dpo/train", "prompts/train") for row in files[name]}
    assert len(held_out) == 300 and not held_out & asked
    careless = [row["messages"][1]["tool_calls"][0]["function"]["arguments"]["b"] != row["meta"]["b"]
                for row in files["sft/train"]]
    assert abs(sum(careless) / len(careless) - tools_task.SFT_WRONG_CALLS) < 0.03
    pair = files["dpo/train"][0]
    assert pair["chosen"][0]["tool_calls"][0]["function"]["arguments"]["b"] == pair["meta"]["b"]
    tokenizer = build_tokenizer(["What is 123 * 456? 56088 multiply {}:,\"ab name arguments 0123456789"],
                                chat_template=tools_task.CHAT_TEMPLATE,
                                special_tokens=tools_task.TOOL_SPECIALS)
    assert call_syntax(tokenizer) == HERMES
    assert tool_result_text(tokenizer, "<|end|>", [("multiply", "56088")]) == "<|tool|>56088<|assistant|>"
    row = {"meta": {"a": 123, "b": 456, "answer": "56088"}}
    right = '<tool_call>{"name":"multiply","arguments":{"a":123,"b":456}}</tool_call><|end|><|tool|>56088<|assistant|>56088<|end|>'
    careless_call = right.replace('"b":456', '"b":45').replace("56088", "5535")
    assert tools_task.check(row, right) | {"reward": 0} == {"score": 1.0, "correct": True, "called": True,
                                                             "right_call": True, "reward": 0,
                                                             "turn_rewards": [1.0, 1.0]}
    assert tools_task.check(row, careless_call)["turn_rewards"] == [0.0, 0.0]
    assert tools_task.check(row, "56088<|end|>")["correct"] and not tools_task.check(row, "56088")["called"]
    # A DPO pair's answers end at their call: scored by the call, so the judge tells the right one from the careless
    call_only = right.split("<|end|>")[0] + "<|end|>"
    assert [tools_task.check(row, text)["score"] for text in (call_only, call_only.replace('"b":456', '"b":45'))] \
        == [1.0, 0.0]
    # ... and so does the data audit, which reads a pair's answer as the template writes it (not its empty content)
    pairs = Dataset.from_list([dict(pair, **tokenize_preference(pair, tokenizer)) for pair in files["dpo/train"][:4]])
    audit, inverted = judge_pairs(judge_for("src.embedded.tools_task:check", None), pairs, None, "dpo", 4, 0, World(),
                                  tokenizer)
    assert audit["judge_tie_share"] == 0 and not inverted, audit
    # The samples show an SFT chat's reference as the template writes it: the call, its result, the answer
    chat = files["sft/test"][0]
    shown = sample_fields(chat, tokenizer)["sample_chosen"]
    call = chat["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert shown == (f'<tool_call>{{"name":"multiply","arguments":{{"a":{call["a"]},"b":{call["b"]}}}}}</tool_call>'
                     f'<|end|><|tool|>{chat["messages"][2]["content"]}<|assistant|>{chat["messages"][3]["content"]}'
                     "<|end|>"), shown
    for stage, directory in (("sft", tmp_path / "sft"), ("dpo", tmp_path / "dpo"), ("grpo", tmp_path)):
        directory.mkdir(exist_ok=True)
        verdicts = [{"reference": tools_task.check(row, careless_call), "trained": tools_task.check(
            row, right if stage == "grpo" or index % 2 else careless_call)} for index in range(10)]
        (directory / "samples_test.jsonl").write_text("".join(json.dumps({"verdict": verdict}) + "\n"
                                                              for verdict in verdicts))
    table = tools_task.measure(tmp_path)
    assert "| untrained | 10 | 0.0% ±0.0 | 100.0% ±0.0 | 0.0% ±0.0 |" in table
    assert "| after SFT | 10 | 50.0% ±31.0 | 100.0% ±0.0 | 50.0% ±31.0 |" in table
    assert "| after GRPO | 10 | 100.0% ±0.0 | 100.0% ±0.0 | 100.0% ±0.0 |" in table


def test_held_out_answers_with_tools_are_trajectories_with_their_tool_record(tokenizer, runner, monkeypatch):
    """src/generation.py's generate with a ToolSession (every stage's held-out answers): the text is the trajectory
    as the template wrote it, the audit's tokens are the model's own (both turns, not the result), and the record
    carries the tool use."""
    import src.generation as generation

    _use(tokenizer, "chatml-qwen2.5")
    call, stop, final = TURNS["chatml-qwen2.5"]
    stop_ids = set(_ids(tokenizer, stop))

    def scripted(model, tok, contexts, max_new_tokens, batch_size, eos_ids, sampling=None, seeds=None, *rest, **kw):
        assert eos_ids == stop_ids
        return [_ids(tokenizer, final if "<tool_response>" in tokenizer.decode(context) else call)
                for context in contexts]

    monkeypatch.setattr(generation, "sample_ids", scripted)
    monkeypatch.setattr(generation, "stop_ids", lambda model, tok: stop_ids)
    (answer,) = generation.generate(None, tokenizer, [[]], 200, 4, details=True, tools=_session(runner, 2))
    assert answer["text"] == call + RESULTS["chatml-qwen2.5"] + final
    assert answer["tokens"] == len(_ids(tokenizer, call)) - 1 + len(_ids(tokenizer, final)) - 1 and answer["ended"]
    assert (answer["calls"], answer["valid_calls"], answer["turns"], answer["tool_errors"]) == (1, 1, 2, {})


def test_the_tools_flags_are_checked_with_the_configuration_in_one_line_each():
    from src.config_error import ConfigError
    from src.config_parse import parse_config

    for flags, message in [(["--tools", "x"], "^--tools x: expected module:registry"),
                           (["--max_tool_turns", "0"], "^--max_tool_turns 0: at least 1"),
                           (["--turn_credit", "0.5"], "^--turn_credit 0.5: .* with --tools"),
                           (["--tools", REGISTRY, "--turn_credit", "-1"], "^--turn_credit -1")]:
        with pytest.raises(ConfigError, match=message):
            parse_config(flags, require_sources=False)
    # Rounds sample with the tools (test_a_round_with_tools_...): no longer refused.
    rounds = parse_config(["--tools", REGISTRY, "--rounds", "1", "--judge", "tool_registry:product_judge"],
                          require_sources=False)
    assert (rounds.training.tools, rounds.dpo.rounds) == (REGISTRY, 1)
    from conftest import PROJECT_ROOT

    config = parse_config(["--config", str(PROJECT_ROOT / "configs" / "sft_dpo_grpo_tools.yaml")],
                          require_sources=False)
    assert (config.training.tools, config.training.max_tool_turns, config.training.turn_credit) == (
        "src.embedded.tools_task:TOOLS", 2, 0.0)


def multiply_task(tmp_path: Path, count: int):
    """A tiny Qwen-template model that stops at <|im_end|>, and `count` multiply prompts with their products (meta):
    (model folder, prompts file, the model's tokenizer)."""
    from transformers import AutoTokenizer, GenerationConfig

    from conftest import build_tiny_model

    questions = [(100 + 37 * index, 200 + 53 * index) for index in range(count)]
    corpus = [f"What is {a} times {b}? It is {a * b}." for a, b in questions] + [TURNS["chatml-qwen2.5"][0]]
    model = build_tiny_model(tmp_path / "model", corpus, template="chatml-qwen2.5")
    tokenizer = AutoTokenizer.from_pretrained(model)
    ends = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id).save_pretrained(model)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}],
                                        "meta": {"product": a * b}}) + "\n" for a, b in questions))
    return model, data, tokenizer


def test_grpo_with_tools_gives_the_same_numbers_on_1x2_and_2x1_and_after_a_killed_job(tmp_path, monkeypatch):
    """GRPO with --tools, 2 steps of 8 answers (2 prompts x 4), forked (tests/forked.py): 2 processes x 1 accumulation
    step, and 1 x 2 killed whole right after checkpoint-1 and launched again. Each answer's first turn is scripted from
    its turn seed (a right multiply call or a call to a tool that does not exist: a tool result or an error result);
    every later turn is the tiny model's own seeded sampling after the result. The answers (tool results included),
    the judge's rewards, the advantages and the loss are the same on either split and after the resume."""
    import re

    from src.trainers.grpo import PreparedGRPOTrainer

    model, data, tokenizer = multiply_task(tmp_path, 8)
    sampled = PreparedGRPOTrainer._sampled

    def first_turn_scripted(self, contexts, seeds, budget):
        written = sampled(self, contexts, seeds, budget)  # the model's own turns (and the collective it may make)
        for index, (context, seed) in enumerate(zip(contexts, seeds)):
            text = self._tokenizer.decode(context)
            asked = re.findall(r"What is (\d+) times (\d+)\?", text)  # none: ZeRO-3's stand-in turn, discarded
            if asked and "<tool_response>" not in text:
                a, b = asked[-1]
                call = TURNS["chatml-qwen2.5"][0].replace("123", a).replace("456", b)
                if int(a) % 2 == 0:  # answered without a call: one turn (a process may be done before the other)
                    call = f"It is {int(a) * int(b)}.<|im_end|>"
                written[index] = _ids(self._tokenizer, call if seed % 2 else call.replace("multiply", "divide"))
        return written

    monkeypatch.setattr(PreparedGRPOTrainer, "_sampled", first_turn_scripted)  # inherited by the forked runs
    import forked
    import grpo_probe
    from src import run_files, seams

    from engine_launch import accelerate_environment

    runs = {}
    for name, processes, accumulation in (("2x1", 2, 1), ("1x2", 1, 2), ("zero3", 2, 1)):
        probe = tmp_path / "probe" / name
        arguments = [str(probe), "--stage", "grpo", "--model_name_or_path", str(model), "--dataset_name", str(data),
                     "--results_dir", str(tmp_path / "results"), "--run_name", name, "--batch_size", "8",
                     "--num_generations", "4", "--max_steps", "2", "--gradient_accumulation_steps", str(accumulation),
                     "--max_new_tokens", "96", "--learning_rate", "1e-3", "--beta", "0.1", "--logging_steps", "1",
                     "--save_steps", "1", "--num_samples", "0", "--val_size", "0", "--test_size", "0",
                     "--max_length", "192", "--seed", "5", "--judge", "tool_registry:result_judge",
                     "--tools", "tool_registry:MULTIPLY", "--max_tool_turns", "1", "--audit_judge_pairs", "0"]
        environment = (accelerate_environment("zero3") if name == "zero3" else dict(os.environ)) | {
            "OMP_NUM_THREADS": "1"}
        killed = tmp_path / f"killed-{name}"
        seam = seams.env({}, kill_at_checkpoint=f"after_complete:1:*:{killed}") if processes == 1 else {}
        result = forked.run_job(processes, arguments, env=environment | seam, entry=grpo_probe.entry)
        if seam:
            assert Path(f"{killed}.rank0").exists() and result.returncode == -9, result.stdout[-3000:]
            result = forked.run_job(processes, arguments, env=environment, entry=grpo_probe.entry)
        assert result.returncode == 0, f"{name}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        ranks = [json.loads((probe / f"rank{rank}.json").read_text()) for rank in range(processes)]
        records = run_files.read_jsonl(tmp_path / "results" / name / run_files.METRICS)
        runs[name + " turns"] = [{answer["step"]: 0 for answer in rank["answers"]} | {
            answer["step"]: 1 for answer in rank["answers"] if "<tool_response>" in tokenizer.decode(answer["answer"])}
            for rank in ranks]  # per rank and step: whether any answer went on after a tool result
        runs[name] = {"answers": sorted((answer["step"], answer["prompt"], answer["answer"], answer["advantage"])
                                        for rank in ranks for answer in rank["answers"]),
                      "rewards": ranks[0]["rewards"], "metrics": [record for record in records if "loss" in record]}
    reference, resumed, zero3 = runs["2x1"], runs["1x2"], runs["zero3"]
    # Step 1: one process's answers all stop at their first turn while the other's go on after a tool result: under
    # ZeRO-3 (every generate call gathers the parameters from both) the done one joins the other's turns.
    assert runs["zero3 turns"] == runs["2x1 turns"] and runs["2x1 turns"][0][0] != runs["2x1 turns"][1][0]
    assert zero3["answers"] == reference["answers"] and zero3["rewards"] == reference["rewards"]
    assert [record["loss"] for record in zero3["metrics"]] == pytest.approx(
        [record["loss"] for record in reference["metrics"]], rel=1e-5, abs=1e-7)
    results = [answer for answer in reference["answers"] if "<tool_response>" in tokenizer.decode(answer[2])]
    assert len(reference["answers"]) == 16 and 0 < len(results) < 16  # both kinds of first turn were sampled
    assert any(answer[3] != 0 for answer in reference["answers"])
    assert [answer[:3] for answer in resumed["answers"]] == [answer[:3] for answer in reference["answers"]
                                                            if answer[0] == 1]  # the resumed launch's step 2
    assert [answer[3] for answer in resumed["answers"]] == pytest.approx(
        [answer[3] for answer in reference["answers"] if answer[0] == 1], abs=1e-5)
    assert resumed["rewards"] == {"1": reference["rewards"]["1"]}
    assert [record["step"] for record in resumed["metrics"]] == [1, 2]
    for key in ("loss", "kl", "reward", "tools/calls_per_answer", "tools/errors_per_answer", "tools/turns_per_answer"):
        assert [record[key] for record in resumed["metrics"]] == pytest.approx(
            [record[key] for record in reference["metrics"]], abs=1e-5), key


def round_first_turns_scripted(monkeypatch) -> None:
    """A round's sampling (src/generation.py sample_ids) with each answer's first turn scripted from its turn seed: a
    right multiply call for the question asked (greedy too), or on an even seed a call to `divide`, a tool that does
    not exist (an error result); every later turn is the tiny model's own seeded sampling after the result. Planted in
    this process, so the forked runs inherit it."""
    import re

    import src.generation as generation

    sample_ids = generation.sample_ids

    def first_turn_scripted(model, tok, contexts, max_new_tokens, batch_size, eos_ids, sampling=None, seeds=None,
                            *rest, **kwargs):
        written = sample_ids(model, tok, contexts, max_new_tokens, batch_size, eos_ids, sampling, seeds, *rest,
                             **kwargs)
        for index, context in enumerate(contexts):
            text = tok.decode(context)
            asked = re.findall(r"What is (\d+) times (\d+)\?", text)
            if asked and "<tool_response>" not in text:
                call = TURNS["chatml-qwen2.5"][0].replace("123", asked[-1][0]).replace("456", asked[-1][1])
                right = seeds is None or seeds[index] % 2
                written[index] = _ids(tok, call if right else call.replace("multiply", "divide"))
        return written

    monkeypatch.setattr(generation, "sample_ids", first_turn_scripted)


def round_with_tools_args(model: Path, data: Path, results: Path, name: str, *extra: str) -> list[str]:
    """A --rounds 1 --tools run of the multiply task: 4 answers per prompt, 2 round steps, a checkpoint at each."""
    return ["--stage", "dpo", "--rounds", "1", "--model_name_or_path", str(model), "--dataset_name", str(data),
            "--results_dir", str(results), "--run_name", name, "--batch_size", "4", "--round_max_steps", "2",
            "--round_samples", "4", "--eval_strategy", "no", "--save_steps", "1", "--logging_steps", "1",
            "--num_samples", "0", "--val_size", "0", "--test_size", "0", "--max_new_tokens", "160",
            "--max_length", "320", "--learning_rate", "1e-3", "--seed", "6", "--judge", "tool_registry:result_judge",
            "--tools", "tool_registry:MULTIPLY", "--max_tool_turns", "1", "--audit_judge_pairs", "0", *extra]


def assert_pairs_are_trajectories_with_their_tool_blocks_masked(pairs: list[dict], tokenizer) -> None:
    """Each pair of the multiply round: chosen ran the right call (the product came back), rejected called `divide`
    (the error came back); the prompt's ids as generation started from them; each answer's ids decode to what the
    judge read and its loss mask is 0 exactly over its one tool block (the result in the template's tool role and the
    generation prompt after it)."""
    for pair in pairs:
        assert pair["chosen_score"] == 1 and pair["rejected_score"] == 0
        trajectory = pair["trajectory"]
        assert trajectory["prompt_ids"] == tokenizer.apply_chat_template(
            pair["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for answer, result in (("chosen", str(pair["meta"]["product"])),
                               ("rejected", '{"error": "unknown tool divide')):
            ids, mask = trajectory[f"{answer}_ids"], trajectory[f"{answer}_loss_mask"]
            assert tokenizer.decode(ids, skip_special_tokens=False) == pair[answer][0]["content"]  # what the judge read
            masked = [position for position, keep in enumerate(mask) if not keep]
            block = tokenizer.decode([ids[position] for position in masked], skip_special_tokens=False)
            assert masked == list(range(masked[0], masked[-1] + 1))  # one tool block, between the model's turns
            assert block.startswith("\n<|im_start|>user\n<tool_response>\n" + result)
            assert block.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n") and 0 < masked[0]


def assert_first_batch_read_the_models_own_tokens(run_dir: Path, pairs: list[dict]) -> None:
    """The round's first micro-batch (2 pairs: a row twice where the round has fewer pairs than a global batch) read
    log-probs at the model's own tokens only: the masks reached DPO (the packed forward's check counts the tokens it
    compared)."""
    from itertools import combinations_with_replacement

    from src import run_files

    check = run_files.read_json(run_dir / run_files.TRAINING_INFO)["forward"]["first_batch_check"]
    counted = [sum(sum(pair["trajectory"][f"{answer}_loss_mask"]) for answer in ("chosen", "rejected"))
               for pair in pairs]
    whole = [sum(len(pair["trajectory"][f"{answer}_ids"]) for answer in ("chosen", "rejected")) for pair in pairs]
    two = list(combinations_with_replacement(range(len(pairs)), 2))
    assert check["passed"] and check["tokens"] in {counted[i] + counted[j] for i, j in two}, check
    assert check["tokens"] not in {whole[i] + whole[j] for i, j in two}


# the token means too (entropy, logits/*, mean_token_accuracy): before they were logged as the window's means over its
# tokens, 1 x 2's step 1 read (3/196 + 2/197) / 2 = 0.0127292 against 2 x 1's 5/393 = 0.0127226 (TRL's mean of the
# micro-batches' ratios)
STEP_NUMBERS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
                "rewards/margins", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")


def test_a_round_with_tools_trains_its_pairs_of_trajectories_the_same_on_1x2_and_2x1_and_after_kills(tmp_path,
                                                                                                      monkeypatch):
    """--rounds 1 from prompts with --tools, forked (tests/forked.py) on 2 processes x 1 accumulation step and 1 x 2
    (round_first_turns_scripted: the tool runs, the next turn is the model's own), the judge reading the whole
    trajectory (the product came back: 1). A pair's answers are its trajectories as sampled, their loss mask 0 exactly
    over the tool blocks, prepared as the collator's mask columns (tests/test_packed_dpo.py: masked tokens out of the
    policy, reference and cache). The 1 x 2 job is killed (SIGKILL) in the round's sampling (its first batch of
    trajectories sampled, its tool worker running, no pairs written), then right after checkpoint-1 (its pairs
    written), and launched again each time: the pairs, their masks and the round's losses and logged metrics are those
    of the 2 x 1 job, never killed."""
    from src import run_files, seams
    from test_resilience import seconds_until_gone

    model, data, tokenizer = multiply_task(tmp_path, 4)
    round_first_turns_scripted(monkeypatch)
    import forked

    runs = {}
    for name, processes, accumulation in (("2x1", 2, 1), ("1x2", 1, 2)):
        arguments = round_with_tools_args(model, data, tmp_path / "results", name, "--gradient_accumulation_steps",
                                          str(accumulation))
        environment = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
        run_dir = tmp_path / "results" / name
        if processes == 1:
            sampled, saved, tag = tmp_path / "killed-sampling", tmp_path / "killed-checkpoint", f"{tmp_path}-tools"
            killing = environment | seams.env({}, kill_starter=f"sampling:{sampled}", run_tag=tag,
                                              kill_at_checkpoint=f"after_complete:1:*:{saved}")
            killed = forked.run_job(processes, arguments, env=killing)
            assert sampled.exists() and killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-3000:]
            seconds_until_gone(tag)  # the tool worker ended with its job
            assert not (run_dir / "pairs").exists() and not (run_dir / "round.json").exists()
            killed = forked.run_job(processes, arguments, env=killing)
            assert Path(f"{saved}.rank0").exists() and killed.returncode == -9, killed.stdout[-3000:]
            assert "round 1: sampling" in killed.stdout + killed.stderr
            assert (run_dir / "model" / "checkpoint-1").is_dir()
            pairs_written = (run_dir / "pairs" / "train.jsonl").read_bytes()
        result = forked.run_job(processes, arguments, env=environment)
        assert result.returncode == 0, f"{name}: {result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if processes == 1:
            assert "round 1: pairs written by an earlier launch, reused" in result.stdout
            assert "resuming from" in result.stdout and "round 1: sampling" not in result.stdout + result.stderr
            assert (run_dir / "pairs" / "train.jsonl").read_bytes() == pairs_written
        pairs = run_files.read_jsonl(run_dir / "pairs" / "train.jsonl")  # the last round's: the run's own
        steps = {record["step"]: [record[key] for key in STEP_NUMBERS]
                 for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "loss" in record}
        runs[name] = (pairs, steps)
        assert_first_batch_read_the_models_own_tokens(run_dir, pairs)
    pairs, steps = runs["2x1"]
    assert pairs == runs["1x2"][0] and list(steps) == list(runs["1x2"][1]) == [1, 2]
    for step in steps:
        assert steps[step] == pytest.approx(runs["1x2"][1][step], rel=1e-5, abs=1e-6), step
    assert steps[2][0] < steps[1][0]  # it trained (the first step's loss is log 2: the policy is its reference)
    # 4 pairs, one global batch (a partial one is left out of each epoch: tests/test_training.py's partial_global_batch)
    assert len(pairs) == 4
    assert_pairs_are_trajectories_with_their_tool_blocks_masked(pairs, tokenizer)
    # Prepared as DPO reads them: the sampled ids and the masks as the collator's columns (not the texts retokenized).
    from src.data.shapes import normalize_row
    from src.data.tokenization import token_columns_of, tokenize_preference

    row = normalize_row(pairs[0], "explicit_prompt", None)
    assert tokenize_preference(row, tokenizer) == pairs[0]["trajectory"]
    assert token_columns_of(row, "dpo", tokenizer, None, None)[-2:] == ("chosen_loss_mask", "rejected_loss_mask")


def test_a_round_with_tools_after_an_offline_dpo_stage_trains_its_trajectories_beside_the_datas_held_out_pairs(
        tmp_path, monkeypatch):
    """`--stage dpo --rounds 1 --tools`, one forked process: the DPO stage on the data's own pairs (text answers), then
    round 1 samples the train prompts with the tool running (round_first_turns_scripted) and trains on pairs of
    trajectories (masks 0 over the tool blocks), with the data's held-out pairs beside them (an empty `trajectory`):
    the round's evaluation reads those whole, every answer token (its eval log-probs are the final model's sums over
    the whole answers, worked out here), and the held-out answers of both stages are trajectories with the tool run."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    import forked
    from src import run_files
    from src.config_parse import parse_config
    from src.rounds import round_data

    model, prompts, tokenizer = multiply_task(tmp_path, 8)
    rows = [row | {"chosen": [{"role": "assistant", "content": f"It is {row['meta']['product']}."}],
                   "rejected": [{"role": "assistant", "content": f"It is {row['meta']['product'] + 1}."}]}
            for row in run_files.read_jsonl(prompts)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    round_first_turns_scripted(monkeypatch)
    arguments = round_with_tools_args(model, data, tmp_path / "results", "staged", "--max_steps", "1", "--val_size",
                                      "2", "--test_size", "2", "--gradient_accumulation_steps", "2", "--num_samples", "2", "--eval_strategy", "steps",
                                      "--eval_steps", "2")
    result = forked.run_main(arguments, env=dict(os.environ) | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "results" / "staged"
    assert run_files.read_json(run_dir / "dpo" / run_files.TRAINING_INFO)["status"] == "completed"
    assert run_files.read_json(run_dir / run_files.TRAINING_INFO)["model_name_or_path"] == str(
        run_dir / "dpo" / "model" / "final")  # the round starts from the DPO stage's model
    pairs = run_files.read_jsonl(run_dir / "pairs" / "train.jsonl")
    assert pairs and all(pair["source_row"] is not None for pair in pairs)
    assert_pairs_are_trajectories_with_their_tool_blocks_masked(pairs, tokenizer)
    assert_first_batch_read_the_models_own_tokens(run_dir, pairs)
    held_out = run_files.read_jsonl(run_dir / "pairs" / "validation.jsonl")
    by_prompt = {row["prompt"][0]["content"]: row for row in rows}
    assert len(held_out) == 2 and all(row["trajectory"] is None and row["chosen_score"] is None and
                                      row["chosen"] == by_prompt[row["prompt"][0]["content"]]["chosen"]
                                      for row in held_out)
    # The round's evaluation (step 2, its last) read each held-out answer whole: its log-prob sum per pair is the
    # final model's over every answer token, as prepared (ids from the texts, an empty mask).
    config = parse_config(arguments, require_sources=False)
    validation = round_data(config, run_dir / "pairs", tokenizer).splits["validation"]
    assert [row["chosen_loss_mask"] for row in validation] == [[], []]
    final = AutoModelForCausalLM.from_pretrained(run_dir / "model" / "final").eval()

    def answer_logps(row, answer):
        ids = torch.tensor([row["prompt_ids"] + row[f"{answer}_ids"]])
        with torch.no_grad():
            logps = final(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        return logps[len(row["prompt_ids"]) - 1:].sum().item()

    evaluated = [record for record in run_files.read_jsonl(run_dir / run_files.METRICS) if "eval_loss" in record]
    assert evaluated and evaluated[-1]["step"] == 2 and math.isfinite(evaluated[-1]["eval_loss"])
    for answer in ("chosen", "rejected"):
        whole = sum(answer_logps(row, answer) for row in validation) / len(validation)
        assert evaluated[-1][f"eval_logps/{answer}"] == pytest.approx(whole, abs=1e-3)
    # Both stages' held-out answers: trajectories with the tool run (greedy: the scripted right call, its result).
    for directory in (run_dir / "dpo", run_dir):
        for sample in run_files.read_jsonl(directory / "samples_test.jsonl"):
            assert sample["answer_stats"]["trained"]["calls"] == 1 and sample["verdict"]["trained"]["score"] == 1.0


def test_a_rounds_trajectories_are_prepared_as_sampled_beside_the_datas_own_held_out_pairs(tmp_path):
    """A round after an offline DPO stage writes the data's held-out pairs beside its trajectories (an empty
    `trajectory`): preparation takes the train pairs' ids and masks as sampled, and tokenizes the held-out pairs'
    texts with empty masks (trained whole; the collators skip an empty mask)."""
    from transformers import AutoTokenizer

    from conftest import build_tiny_model, preference_rows
    from src.config_parse import parse_config
    from src.packed_dpo import mask_answers, pack_pairs
    from src.rounds import SCORE_COLUMNS, pair_trajectory, round_data, write_pairs

    model = build_tiny_model(tmp_path / "model", ["the sky is blue green red"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = preference_rows(8)
    train = [row | {"chosen_score": 1, "rejected_score": 0, "mean_score": 0.5, "source_row": index,
                    "trajectory": pair_trajectory([3, 4 + index], {"ids": [5, 6, 7], "loss_mask": [1, 0, 1]},
                                                  {"ids": [8, 9], "loss_mask": [1, 0]})}
             for index, row in enumerate(rows[:4])]
    held_out = [row | dict.fromkeys(SCORE_COLUMNS) | {"trajectory": None} for row in rows[4:]]
    write_pairs(tmp_path / "round", train, {"validation": held_out[:2], "test": held_out[2:]}, {})
    config = parse_config(["--model_name_or_path", str(model), "--dataset_name", str(tmp_path / "round" / "pairs"),
                           "--results_dir", str(tmp_path / "results")], require_sources=False)
    prepared = round_data(config, tmp_path / "round" / "pairs", tokenizer)
    first = prepared.train[0]
    assert (first["prompt_ids"], first["chosen_ids"], first["chosen_loss_mask"], first["rejected_loss_mask"]) == (
        [3, 4], [5, 6, 7], [1, 0, 1], [1, 0])
    held = prepared.splits["validation"][0]
    assert held["chosen_loss_mask"] == [] and len(held["chosen_ids"]) > 1  # the text, tokenized
    import torch

    batch = {"completion_mask": torch.ones(2, 12, dtype=torch.long)}
    example = {key: held[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids", "chosen_loss_mask",
                                          "rejected_loss_mask")}
    mask_answers(batch, [example], None)
    assert batch["completion_mask"].eq(1).all()  # an empty mask masks nothing
    packed = pack_pairs([example], None, 0, "prefix_shared", 40)
    assert (packed["packed_shift_labels"] != -100).sum() == len(held["chosen_ids"]) + len(held["rejected_ids"])
