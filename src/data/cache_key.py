"""The prepared data's key: a hash of everything that determines it (format, stage, source files, the data flags, KTO's
partner rule, the seed, the tokenizer), so a change to any of them prepares again and nothing else does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from src.config import DataArguments, SFTArguments
from src.data.kto import KL_PARTNERS
from src.data.mixtures import mixture_sources
from src.data.shapes import stage_shape
from src.data.sources import source_fingerprint, source_location
from src.objectives import SEQUENCES, UNPAIRED


# Bump when the prepared layout or ids change, so old caches are not reused (8: chat answers as generation writes them,
# src/chat_templates.py; 9: a tool chat's held-out prompt is its question, the audit counts tool calls).
PREPARED_FORMAT = 9


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token,
                        type(tokenizer).__name__], default=str)
    return hashlib.sha256((state + extra).encode()).hexdigest()[:16]


def prepared_key(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, processing=None) -> str:
    """The key; `processing` (a vision model's, src/vision.py) adds its processor's settings: how many tokens an image
    becomes and its tensors (the image files read are checked after: src/data/images.py changed_images)."""
    parts = {
        "format": PREPARED_FORMAT,
        "stage": stage,
        "source": source_fingerprint(source_location(data, stage)) if not data.dataset_mixture else
        [source_fingerprint(source_location(source, stage)) for source, _ in mixture_sources(data)],
        "mixture": data.dataset_mixture,
        "data": {key: getattr(data, key) for key in ("dataset_config", "dataset_split", "prompt_column",
                                                   "chosen_column", "rejected_column", "messages_column",
                                                   "completion_column", "text_column", "meta_columns",
                                                   "system_prompt", "chat_prompts", "val_size",
                                                   "test_size", "max_train_samples", "max_length",
                                                   "label_column", "kto_from_pairs", "reasoning",
                                                   "chat_template_kwargs")},
        "kl_partners": KL_PARTNERS if stage_shape(stage) == UNPAIRED else None,
        "assistant_only_loss": sft.assistant_only_loss if stage_shape(stage) == SEQUENCES else None,
        "seed": seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    if processing is not None:  # a text model's key is unchanged
        parts["processor"] = processing.fingerprint()
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prepared_path(data: DataArguments, sft: SFTArguments, stage: str, seed: int, tokenizer, cache_dir: Path,
                  processing=None) -> Path:
    """Where the prepared data of these settings lives in the cache (complete once built: build_once's marker)."""
    return Path(cache_dir) / f"{stage}-{prepared_key(data, sft, stage, seed, tokenizer, processing)}"
