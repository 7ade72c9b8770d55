"""Whether the Hugging Face Hub can be reached, asked once and quickly.

The Hub client retries an unreachable host for most of a minute before failing. A 3-second TCP probe tells us up
front; when it fails, the libraries are switched to their local caches (HF_HUB_OFFLINE), so a cached model or
dataset still loads and a missing one fails at once with a clear message. A run that needs nothing from the Hub
(local or embedded model and data, no push) is switched to the local caches without a probe or a message.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0


def is_offline(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(environ.get(name, "0") not in ("0", "", "false", "False")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the URL's host and port opens within `timeout` (the trackers' probe too)."""
    endpoint = urlparse(url)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or (80 if endpoint.scheme == "http" else 443)),
                                      timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def hub_reachable(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return reachable(environ.get("HF_ENDPOINT", "https://huggingface.co"))


def looks_like_hub_id(name: str) -> bool:
    """`org/name` or `name` that is not a local path."""
    return not Path(name).expanduser().exists() and not name.startswith((".", "/", "~")) and name.count("/") <= 1


def needs_hub(names: list[str]) -> bool:
    return any(looks_like_hub_id(name) for name in names)


def use_local_files_only() -> None:
    """Nothing the run reads or writes is on the Hub: the libraries use their local files and make no network calls
    of their own (datasets counts each load with a request to S3, huggingface_hub sends telemetry). An explicit
    HF_HUB_OFFLINE / HF_DATASETS_OFFLINE setting is left as it is. Must run before huggingface_hub is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def use_local_cache_if_hub_unreachable(names: list[str]) -> bool:
    """Switch to offline mode when any of `names` is a Hub id and the Hub cannot be reached. Must run before
    huggingface_hub is imported (it reads the variable once). Returns whether it switched."""
    if is_offline() or not needs_hub(names) or hub_reachable():
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    return True
