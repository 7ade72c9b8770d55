"""Tools run while sampling: a call run in a worker process under `--tool_timeout`, the result fed back in the
template's own tool role, and the multi-turn trajectory (`--max_tool_turns`) with the tool results masked from the
loss. The registry, the call syntax and the checks are src/tool_calls.py's.

    toolbox = load_toolbox("my_tools:TOOLS")                 # plain Python functions, schemas from their signatures
    with ToolRunner(toolbox, timeout_s=5) as runner:
        trajectories = sample_with_tools(sample, tokenizer, prompt_ids, ToolSession(toolbox, runner, 4), 256, stops)

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
import json
import os
import select
import signal
import subprocess
import sys
from typing import Callable

from src.chat_templates import template_source
from src.run_safety.parent_watch import exit_with_parent
from src.tool_calls import (Call, ToolBox, ToolsError, call_syntax, load_toolbox, parse_calls, registry_functions,
                            schema_problem)


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
    exit_with_parent(parent)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    functions = registry_functions(spec)
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
                      max_new_tokens: int, stop_ids: set[int], keep_sampling: Callable | None = None
                      ) -> list[Trajectory]:
    """Each prompt's trajectory: `sample(indices, contexts, turn, budgets)` writes one turn for every prompt still
    going (its index, its context's token ids → the turn's ids, ending at a stop token or its budget), whose calls are
    run and their results appended in the template's tool role, up to `max_tool_turns` rounds of calls and
    `max_new_tokens` answer tokens in all (tool results included, as TRL's GRPO counts a completion).
    `keep_sampling(going)` (a collective: whether any process still has a turn to write) makes every process sample
    the same number of turns, `sample` called with none of its own once it is done: under DeepSpeed ZeRO-3 each
    generate call gathers the parameters from every process, and a process that stopped early would leave the others
    waiting in it."""
    toolbox, runner, max_tool_turns = session.toolbox, session.runner, session.max_tool_turns
    syntax = call_syntax(tokenizer)
    trajectories = [Trajectory() for _ in prompts]
    going = list(range(len(prompts)))
    for turn in range(max_tool_turns + 1):
        if not (keep_sampling(bool(going)) if keep_sampling else going):
            break
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


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve" and sys.argv[3] == "--parent":
        _serve(sys.argv[2], int(sys.argv[4]))
