"""Prompt and answer ids as generation sees them: the one place a chat row becomes the ids a stage trains on.

    prompt_ids, answer_ids = conversation_ids(tokenizer, prompt_messages, answer_messages)

The prompt ids are exactly the ids generation starts from (the template applied to the prompt with its generation
prompt), and the answer ids are that answer as the model writes it from there: its reasoning, its tool calls, the
template's end of turn. TRL 1.16 instead keeps the common prefix of the template applied to the prompt and to prompt
+ answer, so a template that rewrites the last assistant message decides silently what is trained: DeepSeek-R1 and
its distills cut every assistant message to what follows its last `</think>` while their generation prompt opens
`<think>\\n`, which trains the final answers without their reasoning, on a sequence the model never meets.

How an answer is placed (`answer_texts`):
1. Its reasoning goes where the template reads it: a `reasoning_content` or `thinking` field when the template reads
   one, else inline as `<think>\\n…\\n</think>\\n\\n` when the template knows those tags (the data may hold it in either
   shape: a field beside the content, or the tags inside it).
2. The template renders prompt + answer. Where that text continues the generation prompt and keeps every part of the
   answer (reasoning, final content, each tool call's name) in order, what follows the generation prompt is the answer
   (ChatML, Llama 3, Qwen3, gpt-oss, generation-marker templates: TRL's ids, unchanged).
3. Where the template rewrote it (R1's split on `</think>`, or a generation prompt that opens the reasoning block the
   rendered turn lacks), the answer is spliced: the generation prompt's opened block is continued with the reasoning as
   the model writes it, then the template's own rendering of the rest of the turn (final content, tool calls, end of
   turn) — the turn rendered without its reasoning, which the template does not rewrite.
4. Anything else cannot be expressed by the template: `TemplateCannotExpress`, one line naming what and the fix.

`tests/test_chat_templates.py` holds the table of real templates that proves prompt + answer ids equal the ids of
generating the answer.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # where data sets put an answer's reasoning
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class TemplateCannotExpress(ValueError):
    """The chat template cannot render what the row holds (the caller names the row and the template)."""


@dataclass(frozen=True)
class ReasoningSyntax:
    """How a chat template writes an assistant's reasoning: the message field it reads, and whether it knows the
    `<think>` tags (inline, or around the field it reads)."""

    field: str | None
    tags: bool


def template_source(tokenizer, chat_template: str | None = None) -> str:
    """The Jinja text a row is rendered with (a tokenizer with several named templates: all of them, joined)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else template


def template_label(tokenizer) -> str:
    """The template a message names: the model's (its name or path) or the one --chat_template_path gave."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the chat template of {name}" if name else "the model's chat template"


@functools.lru_cache(maxsize=8)  # once per template, not once per row
def reasoning_syntax(template: str) -> ReasoningSyntax:
    """The template's way with reasoning, read from its text: Qwen3 reads `reasoning_content`, gpt-oss `thinking`;
    DeepSeek-R1 and Qwen3 know `</think>`."""
    field = next((name for name in REASONING_FIELDS if f".{name}" in template or f"'{name}'" in template
                  or f'"{name}"' in template), None)
    return ReasoningSyntax(field=field, tags=THINK_CLOSE in template)


@dataclass(frozen=True)
class Reasoning:
    """An assistant message's parts: its reasoning (None: none given), its final content, whether the reasoning came
    in a field, and whether an inline reasoning block was closed (an opened `<think>` with no `</think>`: False)."""

    reasoning: str | None
    content: str
    from_field: str | None = None
    closed: bool = True


def split_reasoning(message: dict) -> Reasoning:
    """A message's reasoning and final content, from a reasoning field or from `<think>…</think>` inside the content
    (the opening tag may be missing: R1-style models' answers start after the `<think>\\n` their generation prompt
    wrote)."""
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value.strip():
            return Reasoning(value.strip("\n"), content, from_field=name)
    if THINK_CLOSE in content:
        before, _, after = content.rpartition(THINK_CLOSE)
        return Reasoning(before.split(THINK_OPEN)[-1].strip("\n"), after.lstrip("\n"))
    if content.lstrip().startswith(THINK_OPEN):  # opened, never closed: all of it is reasoning, no answer
        return Reasoning(content.lstrip()[len(THINK_OPEN):].strip("\n"), "", closed=False)
    return Reasoning(None, content)


def reasoning_block(reasoning: str | None) -> str:
    """The reasoning as DeepSeek-R1 and Qwen3 write it before their answer (empty reasoning: an empty block)."""
    return f"{THINK_OPEN}\n{(reasoning or '').strip(chr(10))}\n{THINK_CLOSE}\n\n"


def _without_reasoning(message: dict) -> dict:
    return {key: value for key, value in message.items() if key not in REASONING_FIELDS}


def placed(message: dict, syntax: ReasoningSyntax, keep_reasoning: bool) -> dict:
    """An assistant message with its reasoning where the template reads it (or removed: keep_reasoning False)."""
    if message.get("role") != "assistant":
        return message
    parts = split_reasoning(message)
    out = _without_reasoning(message)
    if parts.reasoning is None:
        return out
    if not keep_reasoning:
        return out | {"content": parts.content}
    if syntax.field:
        return out | {"content": parts.content, syntax.field: parts.reasoning}
    if syntax.tags:
        return out | {"content": reasoning_block(parts.reasoning) + parts.content}
    if parts.from_field:
        raise TemplateCannotExpress(
            f"the answer's reasoning is in a '{parts.from_field}' field, which this template ignores (it reads no "
            "reasoning field and knows no <think> tags): use a template that reads it (--chat_template_path), put the "
            "reasoning in the content as <think>…</think>, or train on the final answers alone (--reasoning drop)")
    return message  # reasoning tags inside the content of a template that knows none: trained as the data writes it


def _pieces(message: dict) -> list[str]:
    """What must survive rendering, in order: reasoning, final content, each tool call's name."""
    parts = split_reasoning(message)
    pieces = [text for text in (parts.reasoning, parts.content.strip()) if text and text.strip()]
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        if function.get("name"):
            pieces.append(str(function["name"]))
    return pieces


def _holds(text: str, messages: list[dict]) -> bool:
    position = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for piece in _pieces(message):
            found = text.find(piece.strip(), position)
            if found < 0:
                return False
            position = found + len(piece.strip())
    return True


def _common_prefix_length(first: str, second: str) -> int:
    return len(os.path.commonprefix([first, second]))


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    """The template's text of the messages; where one message's content is a list of parts (an image's: vision
    templates iterate the parts), every message's is, text as a text part (TRL's prepare_multimodal_messages shape)."""
    if any(isinstance(message.get("content"), list) for message in messages):
        messages = [message | {"content": [{"type": "text", "text": message["content"]}]}
                    if isinstance(message.get("content"), str) else message for message in messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def answer_texts(tokenizer, prompt: list[dict], answers: list[list[dict]], keep_reasoning: bool = True,
                 chat_template: str | None = None, **template_kwargs) -> tuple[str, list[str]]:
    """(the prompt as generation starts from it, each answer as the model writes it from there): see the module's
    docstring for how an answer is placed. The answers share the prompt (a pair's chosen and rejected)."""
    syntax = reasoning_syntax(template_source(tokenizer, chat_template))
    kwargs = {"chat_template": chat_template, **template_kwargs}
    generation_prompt = _render(tokenizer, prompt, add_generation_prompt=True, **kwargs)
    texts = []
    for answer in answers:
        if any(message.get("role") == "tool" for message in answer):
            raise TemplateCannotExpress(
                "the answer holds a tool's result (a 'tool' message), which would be trained as if the model wrote "
                "it: end the answer at its tool call, and put the turns up to the last tool result in the prompt (one "
                "row per assistant turn; sampled trajectories with --tools mask the results themselves)")
        answer = [placed(message, syntax, keep_reasoning) for message in answer]
        full = _render(tokenizer, prompt + answer, **kwargs)
        if full.startswith(generation_prompt) and _holds(full[len(generation_prompt):], answer):
            texts.append(full[len(generation_prompt):])
            continue
        try:
            texts.append(_spliced(tokenizer, prompt, answer, generation_prompt, syntax, kwargs))
        except _Rewritten:
            raise TemplateCannotExpress(_rewrite_message(full[_common_prefix_length(full, generation_prompt):],
                                                         prompt, answer)) from None
    return generation_prompt, texts


def answer_text(tokenizer, prompt: list[dict], answer: list[dict], keep_reasoning: bool = True,
                chat_template: str | None = None, **template_kwargs) -> tuple[str, str]:
    """answer_texts for one answer."""
    prompt_text, (text,) = answer_texts(tokenizer, prompt, [answer], keep_reasoning, chat_template, **template_kwargs)
    return prompt_text, text


def shown_answer(tokenizer, prompt: list[dict], answer: list[dict], chat_template: str | None = None,
                 **template_kwargs) -> str | None:
    """A dataset's answer that holds tool calls or results (an SFT chat's call, result, answer) as the template
    writes it after the generation prompt, special tokens kept: the way a sampled trajectory is shown and judged
    (src/tools.py). None when the template does not render it as a continuation of the prompt."""
    kwargs = {"chat_template": chat_template, **template_kwargs}
    generation_prompt = _render(tokenizer, prompt, add_generation_prompt=True, **kwargs)
    full = _render(tokenizer, prompt + answer, **kwargs)
    return full[len(generation_prompt):] if full.startswith(generation_prompt) else None


class _Rewritten(Exception):
    """The splice does not apply: answer_text says what the template drops."""


def _spliced(tokenizer, prompt, answer, generation_prompt, syntax, kwargs) -> str:
    """The answer written from the generation prompt when the template rewrote it (see the module's docstring)."""
    assistants = [message for message in answer if message.get("role") == "assistant"]
    if len(answer) != 1 or len(assistants) != 1 or not syntax.tags:
        raise _Rewritten
    message = answer[0]
    parts = split_reasoning(message)
    if message.get("content") is None and message.get("tool_calls"):
        parts = Reasoning(parts.reasoning, "")
    bare = _without_reasoning(message) | {"content": parts.content if message.get("content") is not None else None}
    history = _render(tokenizer, prompt, **kwargs) if prompt else ""
    rendered = _render(tokenizer, prompt + [bare], **kwargs)
    if not rendered.startswith(history) or not generation_prompt.startswith(history):
        raise _Rewritten
    turn, opener = rendered[len(history):], generation_prompt[len(history):]
    block = reasoning_block(parts.reasoning)
    # The turn's header (R1's "<｜Assistant｜>") is what the turn and the generation prompt share; past it the generation
    # prompt opens the reasoning block (R1's "<think>\n"). Backed off to where the block starts ("<" is shared too).
    header = _common_prefix_length(opener, turn)
    while header and not block.startswith(opener[header:]):
        header -= 1
    opened = opener[header:]
    if parts.reasoning and THINK_CLOSE in opener:
        raise TemplateCannotExpress(
            "its generation prompt closes the reasoning block before the answer (thinking off), but the answer "
            "reasons: train on the final answers alone (--reasoning drop) or turn thinking on")
    if not block.startswith(opened):
        raise _Rewritten
    text = block[len(opened):] + turn[header:]
    if not _holds(opener[:header] + opened + text, [message | {"content": parts.content}]):
        raise _Rewritten
    return text


def _rewrite_message(rendered_answer: str, prompt: list[dict], answer: list[dict]) -> str:
    """What the template does to the answer (`rendered_answer`: its rendering past the prompt), and the fix."""
    calls = [call for message in answer for call in message.get("tool_calls") or []]
    if calls and not _holds(rendered_answer, [{"role": "assistant", "content": "", "tool_calls": calls}]):
        return ("it drops the answer's tool calls (it has no syntax for them, or none for this message's shape): use "
                "a template with tool syntax (--chat_template_path)")
    if calls and any(message.get("tool_calls") for message in prompt if message.get("role") == "assistant"):
        # DeepSeek-R1's template sets its first-call flag once per conversation: a later turn's calls are written as
        # a continuation of the first turn's block, without the block's opening, which the model never generates.
        return ("it writes a tool call that follows earlier calls in the conversation without its call block's "
                "opening (DeepSeek-R1's template: its first-call flag never resets): train that turn from a prompt "
                "without the earlier calls, or use a template that opens every turn's calls (--chat_template_path)")
    return ("it renders the answer other than as the model continues its generation prompt (it drops or moves part "
            "of it): use a template that renders the answer as written (--chat_template_path), or train on the final "
            "answers alone (--reasoning drop)")


def final_answer(text: str) -> str:
    """What a judge scores by default: the answer after its reasoning ("" when the reasoning never closed: an answer
    cut before it reached one)."""
    return split_reasoning({"content": text}).content


def reasoning_of(text: str) -> str | None:
    """A generated answer's reasoning (None: it has none)."""
    return split_reasoning({"content": text}).reasoning


# gpt-oss (the harmony format) writes each part of an answer in a channel: analysis (its reasoning), final (the answer),
# commentary (tool calls), each `<|channel|>NAME<|message|>TEXT` closed by <|end|>, <|return|> or <|call|>.
_HARMONY = re.compile(r"<\|channel\|>(\w+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)"
                      r"(?=<\|end\|>|<\|return\|>|<\|call\|>|$)", re.DOTALL)


def decoded_answer(tokenizer, ids: list[int]) -> str:
    """A generated answer's text, special tokens dropped (`skip_special_tokens`), except the ones that carry its
    structure: gpt-oss's channels, which that decoding would run together ("analysis…assistantfinal…"), become its
    reasoning in `<think>…</think>` then its final answer, the shape judges, audits and round pairs read (and a round
    pair places back in gpt-oss's `thinking` field). An answer with a tool call (commentary) keeps its markers."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if "<|channel|>" not in (getattr(tokenizer, "added_tokens_encoder", None) or {}):
        return text
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    channels = _HARMONY.findall(raw)
    if not channels:
        return text
    if any(name not in ("analysis", "final") for name, _ in channels):
        return raw.replace(tokenizer.pad_token or "\0", "")
    reasoning = "".join(body for name, body in channels if name == "analysis")
    final = [body for name, body in channels if name == "final"]
    if not final:  # cut (or stopped) inside its analysis: a reasoning that never closed
        return f"{THINK_OPEN}\n{reasoning}"
    return (reasoning_block(reasoning) if reasoning else "") + "".join(final)


def opened_reasoning(tokenizer, prompt_ids: list[int]) -> str:
    """The reasoning block a generation prompt leaves open for the model to continue (DeepSeek-R1's "<think>\n"), or
    "": prepended to a generated answer, it makes the answer say where its reasoning starts and whether it closed."""
    tail = tokenizer.decode(prompt_ids[-16:])
    start = tail.rfind(THINK_OPEN)
    return tail[start:] if start >= 0 and tail.rfind(THINK_CLOSE) < start else ""


def conversation_ids(tokenizer, prompt: list[dict], *answers: list[dict], keep_reasoning: bool = True,
                     chat_template: str | None = None, **template_kwargs) -> tuple[list[int], ...]:
    """(prompt ids, each answer's ids): the ids generation starts from, and each answer's ids as the model generates
    them (tokenized on their own: generation continues the prompt's ids, it never re-tokenizes across the boundary)."""
    prompt_text, texts = answer_texts(tokenizer, prompt, list(answers), keep_reasoning, chat_template,
                                      **template_kwargs)
    ids = tokenizer([prompt_text, *texts], add_special_tokens=False)["input_ids"]
    return tuple(ids)


def tools_argument(row: dict) -> dict:
    """The row's tool schemas for the template (`tools` may arrive as JSON text from a file)."""
    tools = row.get("tools")
    if not isinstance(tools, str):
        return {"tools": tools}
    try:
        return {"tools": json.loads(tools)}
    except json.JSONDecodeError as error:
        raise TemplateCannotExpress(f"its `tools` column is not JSON ({error}): give the tool schemas as a JSON list "
                                    "of {\"type\": \"function\", \"function\": {...}} objects") from None
