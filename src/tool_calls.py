"""Tool calls as data: a `--tools module:registry` registry and its JSON schemas, each chat template's call syntax
and the calls parsed out of an answer's text, a call's arguments checked against its schema, and the flags' checks.
Light (no torch; transformers only to derive a schema): the config checks and the data audit read it.
src/tools.py runs the calls while sampling. docs/tools.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
from typing import Any, Callable

from src.chat_templates import template_source
from src.config_error import ConfigError


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


def registry_functions(spec: str) -> dict[str, Callable]:
    """name → function of the registry `module:attribute` (what the tool worker runs)."""
    return {name: function for name, (function, _) in _entries(spec, _registry(spec)).items()}


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
    from transformers.utils import get_json_schema  # transformers (seconds): only when --tools is given

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


def validate_config(config) -> None:
    """--tools and its knobs against the run (src/config_checks.py's validate calls it): one ConfigError line per
    mistake.
    Every stage answers its held-out prompts with the tools; GRPO and on-policy rounds sample with them too."""
    training = config.training
    try:
        validate(training.tools, training.max_tool_turns, training.tool_timeout)
    except ToolsError as error:
        raise ConfigError(str(error)) from None
    if training.turn_credit < 0 or training.turn_credit and not training.tools:
        raise ConfigError(f"--turn_credit {training.turn_credit:g}: the weight of per-turn credit in GRPO's "
                          "advantages, 0 or more, with --tools (the turns are a trajectory's)")


def validate(tools: str | None, max_tool_turns: int, tool_timeout: float) -> None:
    """--tools and its knobs, one line per mistake (the registry loaded and every schema checked)."""
    if max_tool_turns < 1:
        raise ToolsError(f"--max_tool_turns {max_tool_turns}: at least 1 (rounds of calls an answer may make)")
    if tool_timeout <= 0:
        raise ToolsError(f"--tool_timeout {tool_timeout:g}: seconds a call may run; give a positive number")
    if tools:
        load_toolbox(tools)
