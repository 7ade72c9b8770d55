"""The embedded default's model: a character-level tokenizer trained with `tokenizers` on the shipped data and a
small Llama built from a config, randomly initialised, saved once into the cache and loaded from there after.

    python -m src.embedded.model            # builds it (if missing) and prints where it is

The reasoning variant (`--embedded_reasoning`) is the same model with a tokenizer trained on the reasoning data and
a chat template that behaves as DeepSeek-R1-Distill's: its generation prompt opens the reasoning (`<|assistant|><think>`
and a newline), it cuts an assistant message to what follows its `</think>`, and `<think>` / `</think>` are added
tokens that are not special (decoding keeps them, as R1's tokenizer does).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from src.chat_templates import THINK_CLOSE, THINK_OPEN
from src.embedded.generate import data_dir
from src.run_safety.build_once import build_once, cache_root

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|unk|>"]
# Roles are marked by special tokens, so no newlines are needed; {% generation %} marks the assistant tokens for
# TRL's assistant_only_loss.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# The reasoning variant's: DeepSeek-R1-Distill's behaviour (tests/chat_templates/deepseek-r1-distill.jinja) in this
# template's tokens.
REASONING_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{%- set content = message['content'] -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "<|assistant|>{% generation %}{{ content }}<|end|>{% endgeneration %}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{{ '\n' }}{%- endif -%}"
)
# 4 layers x 128 wide: big enough to learn the tasks in about a minute of CPU, small enough to stay there.
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
}
VERSION = "embedded-model-v1"


def _model_data_files(reasoning: bool = False) -> list[Path]:
    """The files the tokenizer is trained on and the model's cache key reads: dpo/ and sft/ (prompts/ repeats dpo/'s
    questions, so the tokenizer and the cached model stay the ones those two have always built)."""
    return [path for stage in ("dpo", "sft") for path in sorted((data_dir(reasoning) / stage).glob("*.jsonl"))]


def _corpus(reasoning: bool = False) -> list[str]:
    texts = []
    for path in _model_data_files(reasoning):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            for key in ("messages", "prompt", "chosen", "rejected"):
                texts.extend(message["content"] for message in row.get(key, []))
    return texts


def build_tokenizer(texts: list[str], reasoning: bool = False, chat_template: str | None = None,
                    special_tokens: tuple[str, ...] = ()):
    """A character-level tokenizer: BPE trained with no room for merges, so every character is one token — digits
    and letters stay separate, which is what arithmetic and string tasks need. The reasoning variant's has the
    reasoning tags as two added tokens and its own template (see the module doc); another task's (the tool task,
    src/embedded/tools_task.py) its own template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set("".join(texts)))
    tokenizer = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tokenizer.decoder = decoders.Fuse()
    specials = SPECIAL_TOKENS + list(special_tokens)
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(specials), special_tokens=specials, initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>", unk_token="<|unk|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", *special_tokens],
    )
    wrapped.chat_template = chat_template or (REASONING_CHAT_TEMPLATE if reasoning else CHAT_TEMPLATE)
    if reasoning:
        wrapped.add_tokens([THINK_OPEN, THINK_CLOSE])  # added, not special: decoding keeps them
    return wrapped


def build_model(tokenizer, seed: int = 0, shape: dict | None = None):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **(shape or MODEL_SHAPE),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def embedded_model_dir(reasoning: bool = False) -> Path:
    template = REASONING_CHAT_TEMPLATE if reasoning else CHAT_TEMPLATE
    digest = hashlib.sha256(
        (VERSION + json.dumps(MODEL_SHAPE, sort_keys=True) + template).encode()
        + b"".join(path.read_bytes() for path in _model_data_files(reasoning))
    ).hexdigest()[:12]
    return cache_root() / f"{VERSION}{'-reasoning' if reasoning else ''}-{digest}"


def ensure_embedded_model(reasoning: bool = False) -> Path:
    """Build the model once per cache (concurrent processes wait for the one building it) and return its path."""

    def build(target: Path) -> None:
        import transformers  # seconds: not imported by a preflight that finds the model built

        tokenizer = build_tokenizer(_corpus(reasoning), reasoning)
        model = build_model(tokenizer)
        transformers.utils.logging.disable_progress_bar()  # "Writing model shards" was a new machine's first line
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)

    return build_once(embedded_model_dir(reasoning), build)


if __name__ == "__main__":
    print(ensure_embedded_model())
