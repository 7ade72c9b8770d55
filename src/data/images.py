"""A row's images, as users' data holds them, read into the prepared data (src/vision.py IMAGE_COLUMN: each image
file's bytes, in the order the prompt shows them).

Where the images come from (any mix in one row):
- an `images` column (a list) or an `image` column (one): datasets' Image feature (its bytes, or its path), a file
  path (relative to the data file's directory, or absolute), a `data:image/...;base64,` URL, or raw bytes;
- the image parts of the messages: `{"type": "image"}` placeholders, filled from the column in order; OpenAI's
  `{"type": "image_url", "image_url": {"url": path or data URL}}` and `{"type": "image", "image"|"url"|"path": ...}`
  with the image in the part itself.
A chat whose messages hold no image part gets the column's images before the text of its first user message (TRL's
prepare_multimodal_messages rule). Every message's content becomes a list of text and image parts (the shape vision
chat templates read); an answer's becomes its text. Each image is read and decoded whole here, once: a missing or
unreadable file, a count of image parts that differs from the images given, an image in an answer are one line naming
the row (and the file), before any token is counted.

The files read are recorded beside the prepared data (IMAGE_FILES: each one's path, size and modification time), so a
later run whose image files changed under the same data file prepares again (src/data/prepare.py `changed_images`),
and the reference log-probs cache, keyed by the prepared data, follows.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path

from src.data.errors import DataError
from src.data.shapes import is_chat
from src.vision import IMAGE_COLUMN, decode

IMAGE_COLUMNS = ("images", "image")  # the columns users' vision data names (TRL's, datasets' Image feature)
PROMPT_CHATS = ("prompt", "messages")  # where image parts may be (a chat's turns before its answer)
ANSWERS = ("chosen", "rejected", "completion")
PAYLOAD_KEYS = ("image", "url", "path")  # an image part's own image ({"type": "image", "image": ...})
FILES_READ = "_image_files"  # a row's image files as read (file_stamp), while preparing
IMAGE_FILES = "image_files.json"  # the prepared data's image files as read, sorted


def image_column(columns) -> str | None:
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


def _parts_carry_images(dataset, column: str) -> bool:
    """Whether any message of a chat column holds an image part (type image or image_url): read from its Arrow
    column, whether the parts are structs or JSON (datasets' Json feature for parts of mixed keys)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for chunk in dataset.data.column(column).chunks:
        if not pa.types.is_list(chunk.type) or not pa.types.is_struct(chunk.type.value_type) or \
                chunk.type.value_type.get_field_index("content") < 0:
            continue
        content = pc.struct_field(pc.list_flatten(chunk), "content")
        if not pa.types.is_list(content.type):
            continue  # text content
        parts = pc.list_flatten(content)
        if isinstance(parts.type, pa.BaseExtensionType):  # JSON text of each part
            if pc.any(pc.match_substring_regex(parts.storage, r'"type"\s*:\s*"image')).as_py():
                return True
        elif pa.types.is_struct(parts.type) and parts.type.get_field_index("type") >= 0:
            if pc.any(pc.starts_with(pc.struct_field(parts, "type"), "image")).as_py():
                return True
    return False


def has_images(raw) -> bool:
    """Whether a source's rows carry images: an images / image column, or a message part that is an image."""
    return any(image_column(dataset.column_names) is not None or any(
        _parts_carry_images(dataset, name) for name in (*PROMPT_CHATS, *ANSWERS) if name in dataset.column_names)
        for dataset in raw.values())


def undecoded(raw):
    """The source with its image columns read as {bytes, path} (datasets' Image feature without decoding): the bytes
    are what the prepared data keeps, and a path is read from the data file's directory, not the working one."""
    from datasets import Image, List

    name = image_column(raw[next(iter(raw))].features)
    if name is None:
        return raw
    feature = raw[next(iter(raw))].features[name]
    if isinstance(feature, Image):
        return raw.cast_column(name, Image(decode=False))
    if isinstance(getattr(feature, "feature", None), Image):
        return raw.cast_column(name, List(Image(decode=False)))
    return raw


def normalized_image_features(normalized: dict) -> dict:
    """The Arrow types of a row gather_images made: chats of text and image parts, answers as text."""
    from datasets import List, Value

    text = Value("string")
    parts = List({"role": text, "content": List({"type": text, "text": text})})
    out = {}
    for name, feature in normalized.items():
        if name in IMAGE_COLUMNS:
            continue
        chat = hasattr(feature, "feature") and isinstance(feature.feature, dict) and "role" in feature.feature
        out[name] = parts if name in PROMPT_CHATS and chat else \
            List({"role": text, "content": text}) if name in ANSWERS and chat else feature
    return out | {IMAGE_COLUMN: List(Value("binary")), FILES_READ: List(Value("string"))}


def gather_images(row: dict, base: Path, where: str, number: int) -> dict:
    """A normalised row (its source image column still in it) → its images read into IMAGE_COLUMN and its chats in
    the vision shape (the module's docstring); one line naming the row for anything that cannot be read or counted."""
    column = next((name for name in IMAGE_COLUMNS if name in row), None)
    given = row.pop(column, None) if column else None
    given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    out = dict(row)
    for name in ANSWERS:
        if name in out:
            out[name] = _answer(out[name], name, where, number)
    chat = next((name for name in PROMPT_CHATS if is_chat(out.get(name))), None)
    if chat is None:
        if given:
            raise DataError(f"{where} row {number}: {len(given)} image(s) with a text prompt: give the prompt as chat "
                            "messages ([{'role': 'user', 'content': ...}]); its images then go before the text of its "
                            "first user message, or where its {'type': 'image'} parts are")
        return out | {IMAGE_COLUMN: [], FILES_READ: []}
    messages, sources = _structured(out[chat], given, where, number)
    out[chat] = messages
    read = [_read(source, base, where, number, index + 1) for index, source in enumerate(sources)]
    return out | {IMAGE_COLUMN: [data for data, _ in read], FILES_READ: [stamp for _, stamp in read if stamp]}


def _text_parts(content) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _answer(value, name: str, where: str, number: int):
    """An answer's messages with their content as text (a vision set's answers come as text parts too)."""
    if not is_chat(value):
        return value
    messages = []
    for message in value:
        parts = _text_parts(message.get("content"))
        if any(part.get("type") != "text" for part in parts if isinstance(part, dict)):
            raise DataError(f"{where} row {number}: '{name}' holds an image part: images belong to the prompt (the "
                            "model answers from them; it does not write them)")
        text = "".join(part.get("text") or "" for part in parts if isinstance(part, dict))
        messages.append({"role": message["role"], "content": text if parts or message.get("content") is not None
                         else None})
    return messages


def _structured(messages: list[dict], given: list, where: str, number: int) -> tuple[list[dict], list]:
    """(the messages with every content a list of text and image parts, the images in the order of their parts):
    bare {"type": "image"} parts take the given images in order, parts with their own image keep it."""
    out, sources, remaining, placed = [], [], list(given), False
    for message in messages:
        parts = []
        for part in _text_parts(message.get("content")):
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
                continue
            if kind not in ("image", "image_url"):
                raise DataError(f"{where} row {number}: a message part of type {kind!r}; the parts read here are "
                                "text, image and image_url")
            own = part.get("image_url") if kind == "image_url" else next(
                (part[key] for key in PAYLOAD_KEYS if part.get(key) is not None), None)
            if isinstance(own, dict):
                own = own.get("url")
            if own is None:
                if not remaining:
                    raise DataError(_count_line(where, number, messages, given))
                own = remaining.pop(0)
            sources.append(own)
            placed = True
            parts.append({"type": "image", "text": None})
        out.append({"role": message["role"], "content": parts})
    if not placed and remaining:  # no image part: the images go first in the first user message (TRL's rule)
        first_user = next((index for index, message in enumerate(out) if message["role"] == "user"), None)
        if first_user is None:
            raise DataError(f"{where} row {number}: {len(remaining)} image(s) and no user message to show them in")
        out[first_user]["content"] = [{"type": "image", "text": None} for _ in remaining] + \
            out[first_user]["content"]
        sources, remaining = remaining, []
    if remaining:
        raise DataError(_count_line(where, number, messages, given))
    return out, sources


def _count_line(where: str, number: int, messages: list[dict], given: list) -> str:
    bare = sum(1 for message in messages for part in _text_parts(message.get("content"))
               if isinstance(part, dict) and part.get("type") == "image"
               and all(part.get(key) is None for key in PAYLOAD_KEYS))
    return (f"{where} row {number}: its messages hold {bare} image part(s) ({{'type': 'image'}}) for {len(given)} "
            "image(s) in its images column: give one image per part, in order")


def _read(source, base: Path, where: str, number: int, index: int) -> tuple[bytes, str | None]:
    """One image's bytes, decoded once to prove them readable, and its file's stamp (None: not read from a file)."""
    name, stamp, file = f"{where} row {number}: image {index}", None, ""
    if isinstance(source, dict):  # datasets' Image feature, undecoded
        data, path = source.get("bytes"), source.get("path")
        source = data if data is not None else path
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        try:
            data = base64.b64decode(source.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error):
            raise DataError(f"{name} is a data URL that is not base64 (data:image/png;base64,...)") from None
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise DataError(f"{name} is a web address; images are read from files here: download them and give their "
                        f"paths (relative to the data file) ({source[:80]})")
    elif isinstance(source, str) and source:
        path = Path(source).expanduser()
        path = path if path.is_absolute() else base / path
        file = f" ({path})"
        try:
            data = path.read_bytes()
            stamp = file_stamp(path)
        except FileNotFoundError:
            raise DataError(f"{name} does not exist{file}") from None
        except OSError as error:
            raise DataError(f"{name} cannot be read: {error.strerror}{file}") from None
    else:
        raise DataError(f"{name} is {type(source).__name__}, not an image (a path, a data URL or bytes)")
    try:
        decode(data)
    except Exception as error:  # noqa: BLE001 - PIL raises many types for a damaged or foreign file
        from PIL import UnidentifiedImageError

        reason = "not a format PIL reads" if isinstance(error, UnidentifiedImageError) else \
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{name} is not a readable image ({reason}){file}") from None
    return data, stamp


def file_stamp(file: Path) -> str:
    """A file's identity without reading it: its resolved path, size and modification time."""
    status = file.stat()
    return f"{file.resolve()}\t{status.st_size}\t{status.st_mtime_ns}"


def write_image_files(target: Path, datasets_read: list) -> None:
    """The image files the preparation read (the tokenizing map's FILES_READ columns), beside the prepared data."""
    import pyarrow.compute as pc

    stamps = set()
    for dataset in datasets_read:
        if FILES_READ in dataset.column_names:
            stamps.update(pc.unique(pc.list_flatten(dataset.data.column(FILES_READ))).to_pylist())
    if stamps:
        (target / IMAGE_FILES).write_text(json.dumps(sorted(stamps), indent=0) + "\n")


def changed_images(target: Path) -> str | None:
    """None when every image file the prepared data read is as it was; else a digest of them as they are now (the
    key of the preparation that reads them again)."""
    record = target / IMAGE_FILES
    if not record.exists():
        return None
    stamps = json.loads(record.read_text())
    now = []
    for stamp in stamps:
        file = Path(stamp.split("\t")[0])
        now.append(file_stamp(file) if file.exists() else f"{file}\tmissing")
    return None if now == stamps else hashlib.sha256("\n".join(now).encode()).hexdigest()[:12]


def image_base(where: str, location: str) -> Path:
    """The directory a row's relative image paths start from: its data file's."""
    for candidate in (Path(where), Path(location)):
        if candidate.is_file():
            return candidate.resolve().parent
        if candidate.is_dir():
            return candidate.resolve()
    return Path.cwd()
