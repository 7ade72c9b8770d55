"""Secrets kept out of what a run writes: every value under a key named like a secret (token, key, password, ...)
replaced, recursively, before training_info.json, reports and trackers see it."""

from __future__ import annotations

import re
from typing import Any


SECRET_NAME = re.compile(r"token|secret|password|passwd|api_?key|credential", re.IGNORECASE)
NOT_SECRETS = {"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token",
               "include_num_input_tokens_seen", "max_new_tokens", "eval_do_concat_batches"}


def redact_secrets(value: Any) -> Any:
    """A copy with every value under a key named like a secret (token, key, password, ...) replaced, recursively:
    what goes into training_info.json, reports and trackers."""
    if isinstance(value, dict):
        return {key: "<redacted>" if (SECRET_NAME.search(str(key)) and str(key) not in NOT_SECRETS
                                      and item not in (None, "", False)) else redact_secrets(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    return value
