"""What a tokenizer's chat template can render, read from its Jinja source: the roles it names, whether it renders
content parts; a dataset's chat messages checked against it before tokenizing (one line naming the row), and a
template's refusal while rendering a row turned into one line.
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager

from src.chat_templates import TemplateCannotExpress, template_label, template_source
from src.data.errors import DataError
from src.data.files import row_origin


# Message roles TRL and the common chat templates know; chat_roles adds any other role the model's template names
# (developer, ipython, ...).
CHAT_ROLES = ("system", "user", "assistant", "tool")
# How templates name roles: message['role'] == 'user', 'user' != message.role, message['role'] in ['user', 'tool']
_TEMPLATE_ROLE = re.compile(r"""role['"\]]*\s*(?:==|!=)\s*['"](\w+)['"]|['"](\w+)['"]\s*(?:==|!=)\s*[\w.\['"]*role\b""")
_TEMPLATE_ROLE_LIST = re.compile(r"""role['"\]]*\s+(?:not\s+)?in\s+[\[(]([^\])]*)[\])]""")
# How templates that take content as a list of parts tell them apart: content is string, part['type'], part.type
_TEMPLATE_PARTS = re.compile(
    r"""content['"\]]*\s+is\s+(?:not\s+)?(?:string|iterable|sequence|mapping)|\[['"]type['"]\]|\.type\b""")


def chat_roles(tokenizer) -> list[str]:
    """The message roles a run accepts: TRL's, and any other role the tokenizer's chat template compares with."""
    text = template_source(tokenizer)
    named = {first or second for first, second in _TEMPLATE_ROLE.findall(text)}
    for group in _TEMPLATE_ROLE_LIST.findall(text):
        named |= set(re.findall(r"""['"](\w+)['"]""", group))
    return list(CHAT_ROLES) + sorted(named - set(CHAT_ROLES))


def renders_content_parts(tokenizer) -> bool:
    """Whether the chat template reads message content given as a list of parts ([{"type": "text", "text": ...}]), as
    multimodal templates do; a text-only template prints such a list as its Python repr."""
    return bool(_TEMPLATE_PARTS.search(template_source(tokenizer)))


def check_chat_messages(raw, columns: dict[str, str], tokenizer, location: str, origins: dict | None = None) -> None:
    """Every message of the chat columns ({column: the name the user gave it}) has a role the template knows and
    content it can render. A role no template branch handles ("robot", a typo like "assitant") renders as if it were
    valid, or not at all, and content given as a list of parts reaches a text-only template as a Python repr: either
    way the run trains to the end on it. Checked on the source's Arrow columns before any row is normalized (no row
    reaches Python): the row named is the source file's (`origins`: load_source_with_origins's)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Value

    roles = chat_roles(tokenizer)
    known, parts_rendered = pa.array(roles), renders_content_parts(tokenizer)
    for split, dataset in raw.items():
        where = location if len(raw) == 1 else f"{location} ({split})"
        for column, name in columns.items():
            kind = dataset.features.get(column)
            if not (hasattr(kind, "feature") and isinstance(kind.feature, dict) and "role" in kind.feature):
                continue  # text, or a chat column shaped otherwise (check_row names those)
            parts = not parts_rendered and not isinstance(kind.feature.get("content"), Value)
            offset = 0
            for chunk in dataset.data.column(column).chunks:
                flat = pc.list_flatten(chunk)
                parents = pc.list_parent_indices(chunk)
                unknown = pc.index(pc.invert(pc.is_in(pc.struct_field(flat, "role"), value_set=known)), True).as_py()
                if unknown >= 0:
                    row = parents[unknown].as_py()
                    message = unknown - pc.index(parents, row).as_py() + 1
                    role = pc.struct_field(flat, "role")[unknown].as_py()
                    close = difflib.get_close_matches(str(role), roles, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    file, number = row_origin((origins or {}).get(split), where, offset + row + 1)
                    raise DataError(
                        f"{file} row {number}: '{name}' message {message} has role {role!r}{hint}; the "
                        f"model's chat template and TRL know {', '.join(roles)}: fix the role in the data"
                    )
                listed = pc.index(pc.is_valid(pc.struct_field(flat, "content")), True).as_py() if parts else -1
                if listed >= 0:
                    row = parents[listed].as_py()
                    message = listed - pc.index(parents, row).as_py() + 1
                    file, number = row_origin((origins or {}).get(split), where, offset + row + 1)
                    raise DataError(
                        f"{file} row {number}: '{name}' message {message} has its content as a list of "
                        "parts, which the model's chat template prints as a Python list: write each message's content "
                        "as text"
                    )
                offset += len(chunk)


@contextmanager
def template_refusals(source: str, number: int, tokenizer=None):
    """A chat template that raises on a row (raise_exception("Conversation roles must alternate ..."), an undefined
    field): one line naming the row, not a Jinja traceback from inside the tokenizing map."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateCannotExpress as error:
        raise DataError(f"{source} row {number}: {template_label(tokenizer)}: {error}") from None
    except TemplateError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{source} row {number}: the chat template refused it ({reason}); fix the row or the "
                        "template (--chat_template_path)") from None
