"""A normalised row to token ids, as TRL's trainers would tokenize it themselves (same helpers, same prompt/completion
boundary, same EOS rules; tests/test_data.py checks the ids are identical): preference pairs, KTO's unpaired rows, a
reward model's pairs, SFT sequences (assistant-only loss through TRL's training chat template), and the prompt and
reference fields of held-out samples. A row with images (src/data/images.py) has its prompt's ids from the model's
processor (src/vision.py: each image placeholder expanded to the image's tokens, as TRL's vision collators do); its
answers are text, tokenized alone as for any chat.
"""

from __future__ import annotations

from src.chat_templates import answer_texts, conversation_ids, shown_answer, tools_argument
from src.config import SFTArguments
from src.data.shapes import stage_shape, text_of
from src.objectives import PAIRS, PROMPTS, SCORED_PAIRS, UNPAIRED
from src.private_api import trl_tokenize
from src.vision import IMAGE_COLUMN, decode


def _template_kwargs(row: dict, configured: dict | None = None) -> dict:
    """What the chat template is called with for a row: --chat_template_kwargs (e.g. Qwen3's enable_thinking), and
    the row's tool schemas."""
    return {**(configured or {}), **tools_argument(row)}


def row_images(row: dict) -> list:
    """A prepared row's images, decoded (PIL), in the order of its prompt's image parts."""
    return [decode(data) for data in row.get(IMAGE_COLUMN) or []]


def _conversation_ids(tokenizer, processing, row: dict, prompt, *answers, **kwargs) -> tuple[list[int], ...]:
    """conversation_ids, with the prompt's ids from the processor where the row has images."""
    images = row_images(row)
    if not images:
        return conversation_ids(tokenizer, prompt, *answers, **kwargs)
    prompt_text, texts = answer_texts(tokenizer, prompt, list(answers), **kwargs)
    return (processing.prompt_ids(prompt_text, images), *tokenizer(texts, add_special_tokens=False)["input_ids"])


def tokenize_preference(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None,
                        processing=None) -> dict:
    """prompt_ids / chosen_ids / rejected_ids: for chats, the prompt as generation starts from it and each answer as
    the model writes it from there (src/chat_templates.py; TRL's ids wherever the template does not rewrite the
    answer); for text, as TRL's DPOTrainer builds them (EOS appended, the completion where the two diverge).
    `processing`: a vision model's (src/vision.py ImageProcessing), for a row with images."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    if row.get("trajectory"):  # a round's sampled tool trajectories: their ids as sampled, with their loss masks
        return dict(row["trajectory"])
    if is_conversational(row):
        prompt_ids, chosen_ids, rejected_ids = _conversation_ids(
            tokenizer, processing, row, row["prompt"], row["chosen"], row["rejected"], keep_reasoning=keep_reasoning,
            **_template_kwargs(row, template_kwargs))
        return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    eos = tokenizer.eos_token
    chosen = row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos
    rejected = row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos
    prompt_ids = _tokenize(tokenizer, row["prompt"])["input_ids"]
    chosen_full = _tokenize(tokenizer, row["prompt"] + chosen)["input_ids"]
    rejected_full = _tokenize(tokenizer, row["prompt"] + rejected)["input_ids"]
    # The completion starts where prompt and prompt+completion diverge (a text prompt's last word may merge with the
    # answer's first).
    prompt_length = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return {
        "prompt_ids": prompt_ids[:prompt_length],
        "chosen_ids": chosen_full[prompt_length:],
        "rejected_ids": rejected_full[prompt_length:],
    }


def tokenize_unpaired(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """prompt_ids / completion_ids: a chat's as generation sees them (src/chat_templates.py); text as TRL's
    KTOTrainer builds them (EOS appended, the completion where prompt and prompt+completion diverge)."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    if is_conversational(row):
        prompt_ids, completion_ids = conversation_ids(tokenizer, row["prompt"], row["completion"],
                                                      keep_reasoning=keep_reasoning,
                                                      **_template_kwargs(row, template_kwargs))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    eos = tokenizer.eos_token
    completion = row["completion"] if row["completion"].endswith(eos) else row["completion"] + eos
    prompt_ids = _tokenize(tokenizer, row["prompt"])["input_ids"]
    full = _tokenize(tokenizer, row["prompt"] + completion)["input_ids"]
    prompt_length = common_prefix_length(prompt_ids, full)
    return {"prompt_ids": prompt_ids[:prompt_length], "completion_ids": full[prompt_length:]}


def tokenize_reward(row: dict, tokenizer, keep_reasoning: bool = True, template_kwargs: dict | None = None) -> dict:
    """chosen_ids / rejected_ids (whole sequences: prompt and answer), the DPO pair's ids joined: what the reward
    model scores is the prompt as generation starts from it followed by the answer as generated."""
    return reward_ids(tokenize_preference(row, tokenizer, keep_reasoning, template_kwargs))


def reward_ids(pair: dict) -> dict:
    """A DPO pair's ids (tokenize_preference) joined into the reward model's two whole sequences."""
    return {"chosen_ids": pair["prompt_ids"] + pair["chosen_ids"],
            "rejected_ids": pair["prompt_ids"] + pair["rejected_ids"]}


def sft_chat_template(tokenizer, sft: SFTArguments) -> str | None:
    """The template TRL's SFTTrainer tokenizes with: its training template when assistant-only loss needs
    generation markers the model's own template lacks."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if sft.assistant_only_loss and not has_generation_markers(tokenizer.chat_template):
        return get_training_chat_template(tokenizer)
    return None


def tokenize_sft(row: dict, tokenizer, assistant_only_loss: bool, chat_template: str | None,
                 keep_reasoning: bool = True, template_kwargs: dict | None = None, processing=None) -> dict:
    """input_ids (+ completion_mask / assistant_masks). A chat's answer is the one generation writes
    (src/chat_templates.py): TRL's SFTTrainer ids (and its assistant masks) where the template renders the answer
    as written; where it rewrites the last assistant turn, the prompt as generation starts from it and that turn as
    generated (earlier turns stay as the prompt renders them, as generation sees them)."""
    from trl.data_utils import common_prefix_length, is_conversational

    _tokenize = trl_tokenize()

    kwargs = {"chat_template": chat_template, **_template_kwargs(row, template_kwargs)}
    eos = tokenizer.eos_token
    if is_conversational(row):
        if "prompt" in row:
            prompt, answer = row["prompt"], row["completion"]
        else:
            assistant = [i for i, message in enumerate(row["messages"]) if message["role"] == "assistant"]
            if not assistant and row_images(row):  # the whole chat, its images' tokens in it; nothing answers
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False, **kwargs)
                return {"input_ids": processing.prompt_ids(text, row_images(row))}
            if not assistant:  # nothing the model answers: the chat trains as the template renders it
                full = _tokenize(tokenizer, row["messages"], return_assistant_tokens_mask=assistant_only_loss, **kwargs)
                return {key: full[key] for key in ("input_ids", "assistant_masks") if key in full}
            prompt, answer = row["messages"][:assistant[-1]], row["messages"][assistant[-1]:]
        prompt_ids, answer_ids = _conversation_ids(tokenizer, processing, row, prompt, answer,
                                                   keep_reasoning=keep_reasoning, **kwargs)
        input_ids = prompt_ids + answer_ids
        output = {"input_ids": input_ids}
        if "prompt" in row:
            output["completion_mask"] = [0] * len(prompt_ids) + [1] * len(answer_ids)
        if assistant_only_loss:
            # TRL's masks (the template's generation blocks) where its rendering of the chat is this very sequence;
            # where the template rewrote the answer, the answer's tokens are the assistant's.
            full = _tokenize(tokenizer, prompt + answer, return_assistant_tokens_mask=True, **kwargs)
            output["assistant_masks"] = (full["assistant_masks"] if full["input_ids"] == input_ids
                                         and "assistant_masks" in full else
                                         [0] * len(prompt_ids) + [1] * len(answer_ids))
        return output
    if "prompt" in row:
        completion = row["completion"] if row["completion"].endswith(eos) else row["completion"] + eos
        prompt_ids = _tokenize(tokenizer, row["prompt"], chat_template=chat_template)["input_ids"]
        full = _tokenize(tokenizer, row["prompt"] + completion, chat_template=chat_template)
        prompt_length = common_prefix_length(prompt_ids, full["input_ids"])
        return {"input_ids": full["input_ids"],
                "completion_mask": [0] * prompt_length + [1] * (len(full["input_ids"]) - prompt_length)}
    text = row["text"] if row["text"].endswith(eos) else row["text"] + eos
    return {"input_ids": _tokenize(tokenizer, text, chat_template=chat_template)["input_ids"]}


def sample_fields(row: dict, tokenizer, template_kwargs: dict | None = None, processing=None) -> dict:
    """What the sample outputs need for a held-out row: the prompt as the model sees it and the dataset's answer."""
    from trl.data_utils import is_conversational

    if "chosen" in row:
        prompt, reference, rejected = row["prompt"], row["chosen"], row["rejected"]
    elif "completion" in row and row.get("label") is False:  # a thumbs-down row: its answer is the one to avoid
        prompt, reference, rejected = row["prompt"], "", row["completion"]
    elif "completion" in row:
        prompt, reference, rejected = row["prompt"], row["completion"], None
    elif "prompt" in row and "messages" not in row:  # prompts alone (rounds from prompts): no answer to show
        prompt, reference, rejected = row["prompt"], None, None
    elif "messages" in row and any(message["role"] == "assistant" for message in row["messages"]):
        # The reference is the whole reply to the last user turn: a tool-using reply (call, result, answer) is
        # answered from the question, as sampling with --tools answers it (src/tools.py), not from its last result.
        messages = row["messages"]
        last_user = max((i for i, message in enumerate(messages) if message["role"] == "user"), default=-1)
        start = next((i for i in range(last_user + 1, len(messages)) if messages[i]["role"] == "assistant"),
                     max(i for i, message in enumerate(messages) if message["role"] == "assistant"))
        prompt, reference, rejected = messages[:start], messages[start:], None
    elif "messages" in row:  # a chat with no assistant turn trains as text; nothing to answer
        return {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": text_of(row["messages"]),
                "sample_rejected": None, "judge_prompt": None}
    else:
        return {"sample_prompt": "", "sample_prompt_ids": [], "sample_chosen": text_of(row["text"]),
                "sample_rejected": None, "judge_prompt": ""}
    if is_conversational({"prompt": prompt}):
        rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                 **_template_kwargs(row, template_kwargs))
    else:
        rendered = prompt
    images = row_images(row)
    prompt_ids = processing.prompt_ids(rendered, images) if images else \
        tokenizer(rendered, add_special_tokens=not is_conversational({"prompt": prompt}))["input_ids"]
    return {
        "sample_prompt": rendered,
        "sample_prompt_ids": prompt_ids,
        "sample_chosen": None if reference is None else _answer_shown(tokenizer, prompt, reference, row,
                                                                       template_kwargs),
        "sample_rejected": None if rejected is None else _answer_shown(tokenizer, prompt, rejected, row,
                                                                        template_kwargs),
        # The prompt as the data has it (messages or text): a judge renders it with its own tokenizer, the way a
        # reward model trained on this kind of data saw it (src/judges.py).
        "judge_prompt": prompt,
    }


def _answer_shown(tokenizer, prompt, answer, row: dict, template_kwargs: dict | None) -> str:
    """The dataset's answer as the samples show it: its text; one with tool calls or results as the template writes
    it (its messages' contents alone would drop the calls and run the results into the answer)."""
    from trl.data_utils import is_conversational

    with_tools = is_conversational({"prompt": prompt}) and isinstance(answer, list) and any(
        message.get("tool_calls") or message.get("role") == "tool" for message in answer)
    shown = shown_answer(tokenizer, prompt, answer, **_template_kwargs(row, template_kwargs)) if with_tools else None
    return text_of(answer) if shown is None else shown


def token_columns_of(first_row: dict, stage: str, tokenizer, sft: SFTArguments, chat_template: str | None):
    """The id and mask columns the stage's tokenization writes (SFT's depend on the data and the loss)."""
    kind = stage_shape(stage)
    if kind == PAIRS:  # a round's tool trajectories add their loss masks (src/packed_layout.py ANSWER_MASKS)
        masks = ("chosen_loss_mask", "rejected_loss_mask") if first_row.get("trajectory") else ()
        return ("prompt_ids", "chosen_ids", "rejected_ids") + masks
    if kind == PROMPTS:
        return ("prompt_ids",)
    if kind == UNPAIRED:
        return ("prompt_ids", "completion_ids")
    if kind == SCORED_PAIRS:
        return ("chosen_ids", "rejected_ids")
    if "prompt" in first_row:
        from trl.data_utils import is_conversational

        masks = ("assistant_masks",) if sft.assistant_only_loss and is_conversational(first_row) else ()
        return ("input_ids", "completion_mask") + masks
    if "messages" in first_row:
        return ("input_ids",) + (("assistant_masks",) if sft.assistant_only_loss else ())
    return ("input_ids",)


def has_trainable_token(item: dict, max_length: int, sft: SFTArguments) -> bool:
    """Whether an SFT row keeps a token that contributes to the loss after truncation to max_length."""
    masks = [item[key] for key in ("completion_mask", "assistant_masks") if key in item]
    if "completion_mask" in item and sft.completion_only_loss is False:
        masks = [item[key] for key in ("assistant_masks",) if key in item]
    if not masks:
        return True
    return any(all(bits) for bits in zip(*(mask[:max_length] for mask in masks)))
