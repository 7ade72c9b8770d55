"""What a source's rows are and what preparation makes of them: the shape recognised from its columns and first row
(explicit or implicit prompts, text or chats, UltraFeedback, Anthropic HH, ShareGPT, Orca, KTO labels, prompts alone),
the column mapping flags, and each row normalised to the objective's shape.

Preparation reads an objective's row's `data_shape` (src/objectives/spec.py), never its name; PROMPTS (prompts alone,
for on-policy rounds that start from them: src/rounds.py) is a preparation of its own. A shape's name may stand for a
stage where only the shape matters (detecting a pair's layout).
"""

from __future__ import annotations

import re
from typing import Any

from src.config import DataArguments
from src.data.errors import DataError
from src.objectives import OBJECTIVES, PAIRED_SHAPES, PAIRS, PROMPTS, UNPAIRED, shape_of


# Words a thumbs-up / thumbs-down column holds in public feedback sets (compared lower-cased, stripped), beside
# booleans and 1/0.
LABEL_WORDS = {
    True: ("true", "yes", "1", "up", "thumbs_up", "thumbsup", "thumbs up", "👍", "+1", "good", "positive", "desirable",
           "like", "liked", "accept", "accepted", "pos"),
    False: ("false", "no", "0", "down", "thumbs_down", "thumbsdown", "thumbs down", "👎", "-1", "bad", "negative",
            "undesirable", "dislike", "disliked", "reject", "rejected", "neg"),
}
CHAT_COLUMNS = ("prompt", "chosen", "rejected", "messages", "completion")  # columns that may hold messages
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
# ShareGPT's speakers (`from`: ShareGPT, Vicuna, LLaMA-Factory's sharegpt format) → chat roles. TRL's
# maybe_convert_to_chatml renames the keys but keeps the values: "human" / "gpt" would reach the chat template as role
# names (printed as such by most templates), and assistant_only_loss would find no assistant turn to learn from.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool"}


def holds_prompts_only(columns: list[str] | None) -> bool:
    """Prompts without answers: a `prompt` column (text or chat) and neither `chosen` nor `rejected`."""
    return bool(columns) and "prompt" in columns and not {"chosen", "rejected"} & set(columns)


def is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "role" in item and "content" in item
                                           for item in value) and len(value) > 0


def _hh_to_messages(transcript: str) -> list[dict]:
    """Anthropic HH transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") → chat messages."""
    parts = _HH_TURN.split("\n\n" + transcript.lstrip("\n"))
    messages = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


# The --*_column flags: each maps a source column to its canonical name
COLUMN_FLAGS = (("prompt_column", "prompt"), ("chosen_column", "chosen"), ("rejected_column", "rejected"),
                ("messages_column", "messages"), ("completion_column", "completion"), ("text_column", "text"),
                ("label_column", "label"))


def _mapped_sources(data: DataArguments) -> set[str]:
    """The source columns a --*_column flag maps."""
    return {getattr(data, flag) for flag, _ in COLUMN_FLAGS if getattr(data, flag, None)}


def columns_after_mapping(columns: list[str], data: DataArguments) -> list[str]:
    """A source's column names as preparation sees them: the --meta_columns gathered into `meta`, the --*_column
    flags' renamed to their canonical names."""
    if data.meta_columns:
        kept = _mapped_sources(data)
        columns = [column for column in columns if column not in data.meta_columns or column in kept]
        columns += [] if "meta" in columns else ["meta"]
    renamed = {getattr(data, flag): canonical for flag, canonical in COLUMN_FLAGS if getattr(data, flag, None)}
    return [renamed.get(column, column) for column in columns]


def prompts_as_chats(raw, location: str):
    """--chat_prompts: each text prompt of prompts alone → a chat of one user message (the model's chat template then
    renders it, as for data that comes as chats); chat prompts stay as they are. Batched over Arrow."""
    columns = raw[next(iter(raw))].column_names
    if not holds_prompts_only(columns):
        raise DataError(f"--chat_prompts turns text prompts alone into chats, and {location} holds "
                        f"{', '.join(columns)}: drop the flag (chat data already renders through the template)")

    def as_chats(batch: dict) -> dict:
        return {"prompt": [[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                           for prompt in batch["prompt"]]}

    return raw.map(as_chats, batched=True, desc="prompts as chats")


def gather_meta(raw, data: DataArguments, location: str):
    """Each row's --meta_columns values gathered into its `meta` (a dict; a `meta` the data has keeps its keys, a
    gathered column of the same name wins), the gathered columns dropped unless a --*_column flag maps them too. One
    line naming the flag for a column the data does not have. Batched over Arrow, as every preparation step."""
    columns = raw[next(iter(raw))].column_names
    missing = [column for column in data.meta_columns if column not in columns]
    if missing:
        raise DataError(f"--meta_columns {' '.join(missing)}: no such column in {location}; the data has "
                        f"{', '.join(columns)}")
    dropped = [column for column in data.meta_columns if column not in _mapped_sources(data) and column != "meta"]

    def gather(batch: dict) -> dict:
        existing = batch.get("meta") or [None] * len(batch[columns[0]])
        return {"meta": [{**(meta if isinstance(meta, dict) else {}),
                          **{column: batch[column][index] for column in data.meta_columns}}
                         for index, meta in enumerate(existing)]}

    return raw.map(gather, batched=True, remove_columns=dropped, desc="gathering meta")


def apply_column_mapping(columns: list[str], data: DataArguments) -> dict[str, str]:
    """{source column: canonical name} from the --*_column flags, checked against what exists."""
    mapping = {}
    for flag, canonical in COLUMN_FLAGS:
        source = getattr(data, flag)
        if source is None or source == canonical:
            continue
        if source not in columns:
            raise DataError(f"--{flag} {source}: no such column; the data has {', '.join(columns)}")
        mapping[source] = canonical
    return mapping


def stage_shape(stage: str) -> str:
    """The data shape a preparation for `stage` makes: its objective's row's, PROMPTS, or a shape's own name."""
    return shape_of(stage) if stage in OBJECTIVES or stage == PROMPTS else stage


def detect_shape(columns: list[str], first_row: dict, stage: str) -> str:
    """Name the layout of the (column-mapped) data, or explain what is missing."""
    kind = stage_shape(stage)
    row = OBJECTIVES.get(stage)
    if kind == PROMPTS:
        return _prompts_layout(columns, stage, row)
    if kind == UNPAIRED:
        return _unpaired_layout(columns)
    if kind in PAIRED_SHAPES:
        return _pairs_layout(columns, first_row, row)
    return _sequences_layout(columns)


def _prompts_layout(columns: list[str], stage: str, row) -> str:
    """Prompts alone (on-policy rounds, GRPO): a 'prompt' column and no answers."""
    names = set(columns)
    if row is not None and {"chosen", "rejected"} & names:  # an objective that trains on prompts (GRPO)
        raise DataError(f"--stage {stage} trains on prompts alone and samples its own answers, and the data holds "
                        f"{' and '.join(sorted({'chosen', 'rejected'} & names))} answers: give prompts (a 'prompt' "
                        "column, text or chat, and an optional 'meta' the judge reads), or train on the pairs with "
                        "a pair objective (--stage dpo)")
    if "prompt" in names:
        return PROMPTS
    raise DataError(f"prompts for on-policy rounds need a 'prompt' column (text or chat messages); the data has "
                    f"{', '.join(columns)}; map yours with --prompt_column")


def _unpaired_layout(columns: list[str]) -> str:
    """KTO's rows: prompt, completion and a thumbs up / down label, or preference pairs to convert."""
    names = set(columns)
    if {"prompt", "completion", "label"} <= names:
        return "unpaired"
    if {"chosen", "rejected"} <= names:
        return "kto_pairs"  # preference pairs; converted to unpaired rows only when asked (_prepare_source)
    missing = [name for name in ("prompt", "completion", "label") if name not in names]
    raise DataError(
        f"KTO data needs prompt, completion and label (thumbs up / down) columns: missing {', '.join(missing)}; "
        f"the data has {', '.join(columns)}; map yours with --prompt_column / --completion_column / "
        "--label_column (preference pairs: --kto_from_pairs)"
    )


def _pairs_layout(columns: list[str], first_row: dict, row) -> str:
    """Preference pairs (DPO's, a reward model's): which of the public layouts, from the columns and the first row."""
    names = set(columns)
    if row is not None and row.on_policy_rounds and holds_prompts_only(columns) and names <= {"prompt", "meta", "tools"}:
        raise DataError(
            "the data holds prompts without chosen and rejected answers: prompts alone train by on-policy rounds "
            "(--rounds N with a --judge that scores answers, e.g. --judge module:function), or give preference "
            "pairs (add chosen and rejected columns)")
    if row is not None and not row.causal_lm and holds_prompts_only(columns):
        raise DataError("a reward model learns from preference pairs, and the data holds prompts without chosen "
                        "and rejected answers: give pairs, or train the policy from these prompts with --stage "
                        "dpo --rounds N and a --judge")
    if {"conversations", "chosen", "rejected"} <= names:
        return "sharegpt_pairs"  # LLaMA-Factory's ShareGPT ranking data: the turns so far, then one answer each
    if {"prompt", "chosen", "rejected"} <= names:
        if is_chat(first_row["chosen"]) and isinstance(first_row["prompt"], str):
            return "ultrafeedback"  # the prompt column is a text copy of the user turn inside chosen/rejected
        return "explicit_prompt"
    if {"question", "chosen", "rejected"} <= names:
        return "orca"
    if {"chosen", "rejected"} <= names:
        if isinstance(first_row["chosen"], str) and "\n\nHuman: " in "\n\n" + first_row["chosen"].lstrip("\n"):
            return "anthropic_hh"
        return "implicit_prompt"
    missing = [name for name in ("prompt", "chosen", "rejected") if name not in names]
    rounds = ("; or, for prompts alone, on-policy rounds: --rounds N and a --judge"
              if row is not None and row.on_policy_rounds and "prompt" in names else "")
    raise DataError(
        f"preference data needs chosen and rejected answers (and a prompt, explicit or shared): missing "
        f"{', '.join(missing)}; the data has {', '.join(columns)}; map yours with --prompt_column / "
        f"--chosen_column / --rejected_column{rounds}"
    )


def _sequences_layout(columns: list[str]) -> str:
    """SFT's sequences: a chat, ShareGPT turns, prompt + completion, plain text, or the preferred side of pairs."""
    names = set(columns)
    if holds_prompts_only(columns) and "completion" not in names:
        raise DataError("SFT needs answers to learn from, and the data holds prompts alone: with --stage sft_then_dpo "
                        "and prompts for the rounds, give the SFT data in the recipe's sft: block (sft: {dataset_name: "
                        "...}) or as --sft.dataset_name")
    if "messages" in names:
        return "messages"
    if "conversations" in names:
        return "sharegpt"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "text" in names:
        return "text"
    if {"chosen", "rejected"} <= names or {"question", "chosen", "rejected"} <= names:
        return "preference"  # SFT on the preferred answers
    raise DataError(
        f"SFT data needs a 'messages' chat, 'prompt' + 'completion', or 'text' column; the data has "
        f"{', '.join(columns)}; map yours with --messages_column, --prompt_column/--completion_column or --text_column"
    )


def _sharegpt_messages(turns, column: str) -> list[dict]:
    """ShareGPT turns ({from, value}; one turn alone as in LLaMA-Factory's ranking data's chosen / rejected) → chat
    messages with the roles chat templates know (SHAREGPT_ROLES)."""
    from trl.data_utils import maybe_convert_to_chatml

    turns = [turns] if isinstance(turns, dict) else turns
    messages = maybe_convert_to_chatml({"conversations": turns})["messages"]
    for message in messages:
        if message.get("role") not in SHAREGPT_ROLES:
            raise DataError(f"'{column}' has a turn from {message.get('role')!r}: the known speakers are "
                            f"{', '.join(SHAREGPT_ROLES)}; rename it in the data")
        message["role"] = SHAREGPT_ROLES[message["role"]]
    return messages


def normalize_row(row: dict, shape: str, system_prompt: str | None, has_chat_template: bool = True) -> dict:
    """One row of a recognised shape → TRL's standard or conversational columns (plus `meta`/`tools` if present).

    Transcript shapes (Anthropic HH, orca) become chats when the tokenizer has a chat template to render them, and
    stay text otherwise, so base models without a template can still train on them."""
    from trl.data_utils import extract_prompt

    # `trajectory`: a round's pair of sampled tool trajectories, trained as sampled (src/rounds.py pair_trajectory).
    # `images` / `image`: the source's images, read into the row by src/data/images.py (gather_images).
    extra = {key: row[key] for key in ("meta", "tools", "trajectory", "images", "image") if key in row}
    if shape == "explicit_prompt":
        out = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
    elif shape in ("ultrafeedback", "implicit_prompt"):
        out = dict(extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]}))
    elif shape == "anthropic_hh" and has_chat_template:
        out = dict(extract_prompt({"chosen": _hh_to_messages(row["chosen"]),
                                   "rejected": _hh_to_messages(row["rejected"])}))
    elif shape == "anthropic_hh":
        out = dict(extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]}))
    elif shape == "orca" and has_chat_template:
        prompt = [{"role": "user", "content": row["question"]}]
        if row.get("system"):
            prompt.insert(0, {"role": "system", "content": row["system"]})
        out = {"prompt": prompt, "chosen": [{"role": "assistant", "content": row["chosen"]}],
               "rejected": [{"role": "assistant", "content": row["rejected"]}]}
    elif shape == "orca":
        system = f"{row['system']}\n\n" if row.get("system") else ""
        out = {"prompt": f"{system}{row['question']}\n\n", "chosen": row["chosen"], "rejected": row["rejected"]}
    elif shape == PROMPTS:
        out = {"prompt": row["prompt"]}
    elif shape == "messages":
        out = {"messages": row["messages"]}
    elif shape == "sharegpt":
        out = {"messages": _sharegpt_messages(row["conversations"], "conversations")}
    elif shape == "sharegpt_pairs":  # `chosen` / `rejected`: one {from, value} message each (or a list of them)
        out = {"prompt": _sharegpt_messages(row["conversations"], "conversations"),
               "chosen": _sharegpt_messages(row["chosen"], "chosen"),
               "rejected": _sharegpt_messages(row["rejected"], "rejected")}
    elif shape == "prompt_completion":
        out = {"prompt": row["prompt"], "completion": row["completion"]}
        if "label" in row:  # thumbs-up / down rows (the SFT stage of sft_then_kto keeps the thumbs-up ones)
            out["label"] = parse_label(row["label"])
    elif shape == "text":
        out = {"text": row["text"]}
    elif shape == "preference":
        pair = normalize_row(row, detect_shape(list(row), row, PAIRS), system_prompt, has_chat_template)
        out = {"prompt": pair["prompt"], "completion": pair["chosen"]}
    elif shape == "unpaired":
        out = {"prompt": row["prompt"], "completion": row["completion"], "label": parse_label(row["label"])}
    elif shape == "kto_pairs":  # the pair, normalised; prepare_batch makes its two unpaired rows
        out = normalize_row(row, detect_shape(list(row), row, PAIRS), None, has_chat_template)
    else:
        raise ValueError(f"unknown shape {shape}")
    if system_prompt:
        for key in ("prompt", "messages"):
            if is_chat(out.get(key)) and out[key][0]["role"] != "system":
                out[key] = [{"role": "system", "content": system_prompt}] + out[key]
    return out | extra


def parse_label(value: Any) -> bool:
    """A thumbs-up / thumbs-down value → True (desirable) / False; anything else is refused (the caller names the row)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        for label, words in LABEL_WORDS.items():
            if word in words:
                return label
    raise DataError(f"'label' is {value!r}, not a thumbs up / down: use true/false, 1/0 or a word like up/down, "
                    "👍/👎, good/bad (KTO learns from two classes only; a score or rating needs thresholding first)")


def unpaired_rows(pair: dict) -> list[dict]:
    """A normalised preference pair as KTO's two unpaired rows: the chosen answer desirable, the rejected one not."""
    extra = {key: pair[key] for key in ("meta", "tools") if key in pair}
    return [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen", **extra}
            for side in ("chosen", "rejected")]


def text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if is_chat(value):
        return "".join(_content_text(message["content"]) for message in value)
    return ""


def _content_text(content) -> str:
    """A message's text: its content, or the text of its parts (an image part: none)."""
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return str(content or "")
