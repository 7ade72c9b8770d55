"""Tools a sampled answer calls, run while sampling: the registry (`--tools module:registry`), each template's call
syntax, running a call in a worker process under `--tool_timeout`, the result fed back in the template's own tool role,
and the multi-turn trajectory (`--max_tool_turns`) with the tool results masked from the loss.

    toolbox = load_toolbox("my_tools:TOOLS")                 # plain Python functions, schemas from their signatures
    with ToolRunner(toolbox, timeout_s=5) as runner:
        trajectories = sample_with_tools(sample, tokenizer, prompt_ids, toolbox, runner, max_tool_turns=4)

A trajectory is the answer-side ids as sampling built them: each turn the model wrote (mask 1), then each tool result
as the template renders it in its tool role followed by the generation prompt (mask 0), and so on until a turn makes
no call, the turns run out, or the token budget does. Training on it (GRPO: TRL's `env_mask`) trains what the model
wrote and never what a tool returned.

A misbehaving tool is a counted event, never a crash: a call that does not parse, names an unknown tool, breaks the
schema, raises, returns a non-string, or runs past the timeout gives the model an error result (`{"error": ...}`) and is
counted in the trajectory's `errors`; a tool that hangs is killed with its worker, which is restarted for the next
call. The worker is a separate process that exits with the process that started it (src/run_safety/parent_watch.py).
docs/tools.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
from typing import Any, Callable

from src.chat_templates import template_source


class ToolsError(ValueError):
    """A --tools registry or template that cannot be used: one line naming the flag and the fix."""


# --------------------------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolBox:
    """The tools of a registry: name → JSON schema (as chat templates take them: {"type": "function", "function":
    {name, description, parameters}}), and the registry's spec the worker loads the functions from."""

    spec: str
    schemas: dict[str, dict]

    def template_tools(self) -> list[dict]:
        """The schemas as a chat template's `tools` argument."""
        return list(self.schemas.values())


def _registry(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ToolsError(f"--tools {spec}: expected module:registry (a module attribute holding a dict or list of "
                         "functions), e.g. my_tools:TOOLS")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ToolsError(f"--tools {spec}: cannot import {module_name} ({error}); put it on PYTHONPATH or fix the "
                         "name") from None
    if not hasattr(module, attribute):
        raise ToolsError(f"--tools {spec}: {module_name} has no attribute {attribute}")
    return getattr(module, attribute)


def _entries(spec: str, registry: Any) -> dict[str, tuple[Callable, dict | None]]:
    """name → (function, explicit schema or None). A dict maps names to functions or to {"function", "schema"}; a
    list holds functions (named by their __name__)."""
    if isinstance(registry, dict):
        items = list(registry.items())
    elif isinstance(registry, (list, tuple)):
        items = [(getattr(item, "__name__", None), item) for item in registry]
    else:
        raise ToolsError(f"--tools {spec}: the registry is a {type(registry).__name__}; give a dict of name → function "
                         "(or → {'function': f, 'schema': {...}}) or a list of functions")
    entries = {}
    for name, value in items:
        function, schema = (value.get("function"), value.get("schema")) if isinstance(value, dict) else (value, None)
        if not isinstance(name, str) or not name or not callable(function):
            raise ToolsError(f"--tools {spec}: entry {name!r} is not a named function; give plain Python functions")
        entries[name] = (function, schema)
    if not entries:
        raise ToolsError(f"--tools {spec}: the registry is empty")
    return entries


def _schema(spec: str, name: str, function: Callable, explicit: dict | None) -> dict:
    """A tool's schema as templates take it: the explicit one (a full {"type": "function", ...} or just its
    "parameters"), else transformers' `get_json_schema` from the function's type hints and docstring."""
    if explicit is not None:
        if not isinstance(explicit, dict):
            raise ToolsError(f"--tools {spec}: the schema of {name} is not a JSON object")
        if explicit.get("type") == "function" and isinstance(explicit.get("function"), dict):
            schema = explicit
        else:
            schema = {"type": "function", "function": {"name": name, "description": (inspect.getdoc(function) or name)
                                                       .split("\n")[0], "parameters": explicit}}
        parameters = schema["function"].get("parameters")
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ToolsError(f"--tools {spec}: the schema of {name} has no parameters of type object (a JSON schema: "
                             "{'type': 'object', 'properties': {...}, 'required': [...]})")
        return {"type": "function", "function": {**schema["function"], "name": name}}
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as error:  # transformers raises its own parsing exceptions, one line each
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ToolsError(f"--tools {spec}: no schema for {name} from its signature ({reason}): give every argument a "
                         "type hint and a line in the docstring's Args, or the schema itself ({'function': f, "
                         "'schema': {...}})") from None
    schema["function"]["name"] = name
    return schema


def load_toolbox(spec: str) -> ToolBox:
    """The registry `module:attribute` as a ToolBox (every tool's schema checked), or one ToolsError line."""
    entries = _entries(spec, _registry(spec))
    return ToolBox(spec, {name: _schema(spec, name, function, explicit) for name, (function, explicit)
                          in entries.items()})


# --------------------------------------------------------------------------------------------------------------------
# Call syntax per template
# --------------------------------------------------------------------------------------------------------------------

HERMES, DEEPSEEK, LLAMA_JSON, HARMONY = "hermes", "deepseek", "llama_json", "harmony"
_SYNTAX_MARKS = ((HARMONY, "<|channel|>"), (DEEPSEEK, "tool▁call▁begin"), (HERMES, "<tool_call>"),
                 (LLAMA_JSON, '"parameters": '))
SYNTAX_NAMES = {HERMES: "Qwen / Hermes <tool_call>", DEEPSEEK: "DeepSeek-R1's tool-call tokens",
                LLAMA_JSON: "Llama 3.1's JSON", HARMONY: "gpt-oss's commentary channel"}


def call_syntax(tokenizer, chat_template: str | None = None) -> str:
    """How the template writes a tool call (read from its text), or one ToolsError line when it has no tool syntax."""
    source = template_source(tokenizer, chat_template)
    for syntax, mark in _SYNTAX_MARKS:
        if mark in source and ("tool_calls" in source or syntax == HARMONY and "functions." in source):
            return syntax
    raise ToolsError("--tools: the chat template has no tool-call syntax (it never renders tool_calls): use a model "
                     "whose template has one, or give one with --chat_template_path")


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call as the answer wrote it: its name and arguments, or why it does not parse (`problem`)."""

    name: str | None
    arguments: Any = None
    problem: str | None = None


def _json_call(text: str, arguments_key: str) -> Call:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return Call(None, problem=f"the call is not JSON ({error.msg})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return Call(None, problem="the call names no tool")
    return Call(value["name"], value.get(arguments_key, value.get("arguments", {})))


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>\w*<｜tool▁sep｜>([^\n]*)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                            re.DOTALL)
# gpt-oss names the recipient before the channel (as its template renders a call) or after it (as the model often
# writes it): " to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>" or
# "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>".
_HARMONY_CALL = re.compile(r"(?:to=functions\.([\w.-]+)\s*<\|channel\|>commentary|<\|channel\|>commentary\s+"
                           r"to=functions\.([\w.-]+))[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)<\|call\|>",
                           re.DOTALL)


def parse_calls(syntax: str, text: str) -> list[Call]:
    """The tool calls of one turn's text (decoded with its special tokens), in the order written; [] for none."""
    if syntax == HERMES:
        return [_json_call(body, "arguments") for body in _HERMES_CALL.findall(text)]
    if syntax == DEEPSEEK:
        calls = [Call(name.strip(), body) for name, body in _DEEPSEEK_CALL.findall(text)]
        if not calls and "<｜tool▁call▁begin｜>" in text:
            return [Call(None, problem="the call block does not parse")]
        return [_arguments_parsed(call) for call in calls]
    if syntax == HARMONY:
        return [_arguments_parsed(Call(before or after, body)) for before, after, body in _HARMONY_CALL.findall(text)]
    if syntax == LLAMA_JSON:  # the whole turn is one JSON object, before its end of turn
        body = re.sub(r"<\|(?:eot_id|eom_id|end_of_text)\|>\s*$", "", text.strip()).strip()
        if not body.startswith("{"):
            return []
        return [_json_call(body, "parameters")]
    raise ValueError(f"unknown call syntax {syntax}")


def _arguments_parsed(call: Call) -> Call:
    try:
        return Call(call.name, json.loads(call.arguments))
    except json.JSONDecodeError as error:
        return Call(call.name, problem=f"the arguments are not JSON ({error.msg})")


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
               "null": type(None)}


def schema_problem(schema: dict, arguments: Any) -> str | None:
    """Why the arguments break the tool's parameters schema (required, unknown and typed properties, enums), or None."""
    parameters = (schema.get("function") or schema).get("parameters") or {}
    if not isinstance(arguments, dict):
        return "the arguments are not a JSON object"
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required") or [] if name not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown and (properties or parameters.get("additionalProperties") is False):
        return f"unknown argument(s) {', '.join(unknown)}"
    for name, value in arguments.items():
        expected = (properties.get(name) or {}).get("type")
        kinds = expected if isinstance(expected, list) else [expected] if expected else []
        if kinds and not any(isinstance(value, _JSON_TYPES.get(kind, object)) and not (
                kind in ("integer", "number") and isinstance(value, bool)) for kind in kinds):
            return f"argument {name} is {type(value).__name__}, not {'/'.join(kinds)}"
        if "enum" in (properties.get(name) or {}) and value not in properties[name]["enum"]:
            return f"argument {name} is not one of {properties[name]['enum']}"
    return None


# --------------------------------------------------------------------------------------------------------------------
# Running a call: a worker process, a timeout, an error result for anything but a string
# --------------------------------------------------------------------------------------------------------------------


class ToolRunner:
    """Runs tool calls in one worker process (`python -m src.tools --serve SPEC`, a process group of its own) that
    exits with this process; a call past `timeout_s` kills the worker (and whatever it started), which is restarted
    for the next call. `run(name, arguments)` → (result text, error or None); it never raises for the tool's sake."""

    def __init__(self, toolbox: ToolBox, timeout_s: float):
        self.toolbox = toolbox
        self.timeout_s = timeout_s
        self.worker: subprocess.Popen | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        if self.worker is None or self.worker.poll() is not None:
            # The worker imports the registry where this process found it: its import path, whole.
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            paths = [root] + [os.path.abspath(path or os.getcwd()) for path in sys.path]
            environment = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "src.tools", "--serve", self.toolbox.spec, "--parent", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=environment, cwd=os.getcwd(),
                start_new_session=True, text=True, bufsize=1)
            atexit.register(self.close)  # an ordinary exit ends it at once (a killed one: its parent watch)
        return self.worker

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None and worker.poll() is None:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.wait()

    def run(self, name: str, arguments: dict) -> tuple[str, str | None]:
        worker = self._start()
        try:
            worker.stdin.write(json.dumps({"name": name, "arguments": arguments}) + "\n")
            worker.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            return _error_result(f"{name} could not be sent to its worker"), "died"
        ready, _, _ = select.select([worker.stdout], [], [], self.timeout_s)
        if not ready:
            self.close()  # a hung tool: killed with its worker, restarted for the next call
            return _error_result(f"{name} ran past --tool_timeout {self.timeout_s:g} s"), "timeout"
        line = worker.stdout.readline()
        if not line:
            self.close()
            return _error_result(f"{name} stopped its process"), "died"
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:  # something wrote to the worker's own stdout (a C extension): start afresh
            self.close()
            return _error_result(f"{name} wrote past its result"), "died"
        if "error" in reply:
            return _error_result(reply["error"]), reply["kind"]
        return reply["result"], None


def _error_result(message: str) -> str:
    return json.dumps({"error": message})


def _serve(spec: str, parent: int) -> None:
    """The worker: one JSON request a line on stdin, one reply a line on the real stdout (the tools' own prints go to
    stderr); exits with its parent."""
    from src.run_safety.parent_watch import exit_with_parent

    exit_with_parent(parent)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    functions = {name: function for name, (function, _) in _entries(spec, _registry(spec)).items()}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = functions[request["name"]](**request["arguments"])
        except Exception as error:  # the tool's own failure: the model sees it as the call's result
            reply = {"error": f"{request['name']} raised {type(error).__name__}: {error}", "kind": "raised"}
        else:
            reply = ({"result": result} if isinstance(result, str) else
                     {"error": f"{request['name']} returned a {type(result).__name__}, not text", "kind": "not_text"})
        replies.write(json.dumps(reply) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# The tool's result in the template's tool role, and the multi-turn trajectory
# --------------------------------------------------------------------------------------------------------------------


def tool_result_text(tokenizer, stop: str, results: list[tuple[str, str]], template_kwargs: dict | None = None) -> str:
    """What follows a turn that ended with `stop` (its last token) and made calls: the results (name, text) in the
    template's tool role, then its generation prompt for the next turn. Read off a conversation of one call rendered
    without and with its results (the way TRL's GRPO builds it), cut after the turn's last `stop`."""
    kwargs = {key: value for key, value in (template_kwargs or {}).items() if key != "tools"}
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name, _ in results]
    if "tool▁call▁begin" in template_source(tokenizer):  # DeepSeek's template concatenates the arguments as text
        calls = [{"type": "function", "function": {"name": name, "arguments": "{}"}} for name, _ in results]
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    turn = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    tools = [{"role": "tool", "name": name, "content": text} for name, text in results]
    full = tokenizer.apply_chat_template(conversation + tools, tokenize=False, add_generation_prompt=True, **kwargs)
    # The turn ends at its k-th `stop`; the template may rewrite the turn once a result follows it (Qwen3 drops the
    # empty reasoning block of a turn that is no longer the last), so the cut is counted in `stop`s, not characters.
    count = turn.count(stop) if stop else 0
    cut = -1
    for _ in range(count):
        cut = full.find(stop, cut + 1)
        if cut < 0:
            break
    suffix = full[cut + len(stop):] if count and cut >= 0 else ""
    if not suffix or any(text not in suffix and json.dumps(text) not in suffix for _, text in results):
        raise ToolsError(f"--tools: the chat template does not write a tool's result after a turn that ends with "
                         f"{stop!r}: it cannot be continued while sampling; use a template that appends tool results "
                         "in a tool role (--chat_template_path)")
    return suffix


def check_template(tokenizer, stop_ids: set[int], template_kwargs: dict | None = None) -> str:
    """The template's call syntax, once it is known that a tool's result can follow a turn ending at one of the
    model's end tokens (`stop_ids`); else one ToolsError line (before anything is sampled)."""
    syntax = call_syntax(tokenizer)
    stops = [tokenizer.decode([token], skip_special_tokens=False) for token in sorted(stop_ids)]
    for stop in stops:
        try:
            tool_result_text(tokenizer, stop, [("tool", "1")], template_kwargs)
            return syntax
        except ToolsError:
            continue
    raise ToolsError(f"--tools: the chat template writes no tool result after a turn that ends with any of the model's "
                     f"end tokens ({', '.join(stops) or 'none'}): add the token its call turns end with to the model's "
                     "generation_config.eos_token_id, or use a template that appends tool results (--chat_template_path)")


@dataclasses.dataclass
class Trajectory:
    """One sampled answer with its tool turns: the answer-side ids (mask 1: the model wrote it; 0: a tool result and
    the template's text around it), the calls made, how many were valid (parsed, known, within the schema, ran and
    returned text), the errors by kind, and the turns used."""

    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    calls: int = 0
    valid: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    turns: int = 0
    ended: bool = False  # its last turn stopped at an end token (not at the token budget)

    def add(self, ids: list[int], written: bool) -> None:
        self.ids += ids
        self.mask += [int(written)] * len(ids)

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def text(self, tokenizer) -> str:
        """What the judges read: the whole trajectory as the template wrote it (its special tokens kept, so the turns
        and the tool results stay apart; padding dropped)."""
        pad = tokenizer.pad_token_id
        return tokenizer.decode([token for token in self.ids if token != pad], skip_special_tokens=False)

    def record(self) -> dict:
        """What the answer audit and the logs read."""
        return {"calls": self.calls, "valid_calls": self.valid, "tool_errors": dict(self.errors),
                "turns": self.turns}


def call_results(calls: list[Call], toolbox: ToolBox, runner: ToolRunner, trajectory: Trajectory
                 ) -> list[tuple[str, str]]:
    """Each call run (or refused) → (name, result text), counted in the trajectory."""
    results = []
    for call in calls:
        trajectory.calls += 1
        name = call.name or "unknown"
        if call.problem:
            problem, kind = call.problem, "unparsed"
        elif call.name not in toolbox.schemas:
            problem, kind = f"unknown tool {call.name}; the tools are {', '.join(sorted(toolbox.schemas))}", "unknown"
        else:
            problem = schema_problem(toolbox.schemas[call.name], call.arguments)
            kind = "schema"
        if problem:
            trajectory.count_error(kind)
            results.append((name, _error_result(problem)))
            continue
        text, error = runner.run(call.name, call.arguments)
        if error:
            trajectory.count_error(error)
        else:
            trajectory.valid += 1
        results.append((name, text))
    return results


@dataclasses.dataclass
class ToolSession:
    """A run's tools on one process: the registry, its worker, the turns an answer may use, the template's keyword
    arguments (--chat_template_kwargs) its tool results are rendered with."""

    toolbox: ToolBox
    runner: ToolRunner
    max_tool_turns: int
    template_kwargs: dict | None = None

    def close(self) -> None:
        self.runner.close()


def session_for(config) -> ToolSession | None:
    """The run's ToolSession (--tools, --tool_timeout, --max_tool_turns), or None without --tools."""
    training = config.training
    if not training.tools:
        return None
    toolbox = load_toolbox(training.tools)
    return ToolSession(toolbox, ToolRunner(toolbox, training.tool_timeout), training.max_tool_turns,
                       config.data.chat_template_kwargs)


def sample_with_tools(sample: Callable, tokenizer, prompts: list[list[int]], session: ToolSession,
                      max_new_tokens: int, stop_ids: set[int]) -> list[Trajectory]:
    """Each prompt's trajectory: `sample(indices, contexts, turn, budgets)` writes one turn for every prompt still
    going (its index, its context's token ids → the turn's ids, ending at a stop token or its budget), whose calls are
    run and their results appended in the template's tool role, up to `max_tool_turns` rounds of calls and
    `max_new_tokens` answer tokens in all (tool results included, as TRL's GRPO counts a completion)."""
    toolbox, runner, max_tool_turns = session.toolbox, session.runner, session.max_tool_turns
    syntax = call_syntax(tokenizer)
    trajectories = [Trajectory() for _ in prompts]
    going = list(range(len(prompts)))
    for turn in range(max_tool_turns + 1):
        budgets = [max_new_tokens - len(trajectories[index].ids) for index in going]
        written = sample(going, [prompts[index] + trajectories[index].ids for index in going], turn, budgets)
        next_going = []
        for index, ids in zip(going, written):
            trajectory = trajectories[index]
            trajectory.add(ids, written=True)
            trajectory.turns += 1
            trajectory.ended = bool(ids) and ids[-1] in stop_ids
            if not trajectory.ended or turn == max_tool_turns:
                continue
            calls = parse_calls(syntax, tokenizer.decode(ids, skip_special_tokens=False))
            if not calls:
                continue
            results = call_results(calls, toolbox, runner, trajectory)
            stop = tokenizer.decode(ids[-1:], skip_special_tokens=False)
            suffix = tokenizer(tool_result_text(tokenizer, stop, results, session.template_kwargs),
                               add_special_tokens=False)["input_ids"]
            if len(trajectory.ids) + len(suffix) >= max_new_tokens:
                trajectory.count_error("no_budget")  # the result does not fit: the answer ends at its call
                continue
            trajectory.add(suffix, written=False)
            next_going.append(index)
        going = next_going
        if not going:
            break
    return trajectories


def summary(trajectories: list[Trajectory]) -> dict:
    """Tool use over answers: calls per answer, the valid share, errors by kind, turns per answer."""
    answers = len(trajectories) or 1
    calls = sum(trajectory.calls for trajectory in trajectories)
    errors: dict[str, int] = {}
    for trajectory in trajectories:
        for kind, count in trajectory.errors.items():
            errors[kind] = errors.get(kind, 0) + count
    return {"answers": len(trajectories), "calls_per_answer": calls / answers,
            "valid_share": sum(trajectory.valid for trajectory in trajectories) / calls if calls else None,
            "errors": errors, "turns_per_answer": sum(trajectory.turns for trajectory in trajectories) / answers}


def validate_config(config) -> None:
    """--tools and its knobs against the run (src/config_checks.py's validate calls it): one ConfigError line per mistake.
    Every stage answers its held-out prompts with the tools; GRPO samples with them too."""
    from src.config_error import ConfigError

    training = config.training
    try:
        validate(training.tools, training.max_tool_turns, training.tool_timeout)
    except ToolsError as error:
        raise ConfigError(str(error)) from None
    if training.turn_credit < 0 or training.turn_credit and not training.tools:
        raise ConfigError(f"--turn_credit {training.turn_credit:g}: the weight of per-turn credit in GRPO's "
                          "advantages, 0 or more, with --tools (the turns are a trajectory's)")
    if training.tools and config.dpo.rounds:
        raise ConfigError("--tools with --rounds: round pairs of tool trajectories are not trained yet (their tool "
                          "results would need masking in DPO); use GRPO (--stage grpo) for rollouts with tools")


def validate(tools: str | None, max_tool_turns: int, tool_timeout: float) -> None:
    """--tools and its knobs, one line per mistake (the registry loaded and every schema checked)."""
    if max_tool_turns < 1:
        raise ToolsError(f"--max_tool_turns {max_tool_turns}: at least 1 (rounds of calls an answer may make)")
    if tool_timeout <= 0:
        raise ToolsError(f"--tool_timeout {tool_timeout:g}: seconds a call may run; give a positive number")
    if tools:
        load_toolbox(tools)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve" and sys.argv[3] == "--parent":
        _serve(sys.argv[2], int(sys.argv[4]))
