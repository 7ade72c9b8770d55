"""How long the run's sequences are, for the memory plan: read from the data audit of the run's prepared data.

A launch, its `--dry_run` preflight and `python -m src.audit` prepare the data once (src/data/) and keep, beside
it in the cache, the audit of the sequences as they train: prompt + reasoning + answer (with `--reasoning drop`, the
final answers'), the longest, and the `--max_length` that keeps 99% of them whole. check_gpu.py finds that prepared
data by the same key a launch computes, which takes the model's tokenizer: from its directory or the Hub cache, never
downloaded. No model, data or prepared data on this machine (or any failure to read them): no lengths, and the plan
is made at `--max_length`, as every batch may reach it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from src.config import EMBEDDED, Config
from src.config_parse import stage_config
from src.data import SUMMARY_FILE, prepared_path
from src.models import ModelError, apply_chat_template_path, load_tokenizer
from src.objectives import SEQUENCES, objective
from src.run_safety.build_once import cache_root, is_complete


@dataclass
class DataLengths:
    """The training split's lengths in tokens, as trained (src/data/pair_audit.py, src/data/'s counts)."""

    longest_tokens: int  # the longest sequence, uncut (a pair: prompt + the longer answer)
    suggested_max_length: int | None  # the 99th percentile, rounded up to 64: what keeps 99% whole
    truncated_share: float | None  # the share --max_length cuts
    reasoning_share: float | None  # the share of answers that reason (None: none does)
    reasoning_cut_share: float | None  # the share whose reasoning --max_length cuts (the larger side's)
    reasoning: str  # "keep" or "drop", as prepared
    packed: bool  # SFT --packing: every sequence is filled to --max_length whatever the data
    source: str  # where the numbers came from, for the plan line

    def planned_tokens(self, max_length: int) -> int:
        """Tokens per sequence the largest batch reaches: the longest sequence, cut to --max_length."""
        return max_length if self.packed else min(max_length, self.longest_tokens)


def _largest(values) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def lengths_from_summary(summary: dict, path: Path, packed: bool) -> DataLengths | None:
    """The training split's lengths from a prepared data's summary.json; None when it has none (a prompts-only
    preparation: no answers yet)."""
    counts, audit = summary.get("splits", {}).get("train") or {}, (summary.get("audit") or {}).get("train") or {}
    if counts.get("longest_tokens") is None or "suggested_max_length" not in audit:
        return None
    sides = ("chosen", "rejected", "completion")
    return DataLengths(
        longest_tokens=int(counts["longest_tokens"]),
        suggested_max_length=audit["suggested_max_length"],
        truncated_share=audit.get("truncated_share"),
        reasoning_share=_largest(audit.get(f"{side}_reasoning_share") for side in sides),
        reasoning_cut_share=_largest(audit.get(f"{side}_reasoning_cut_share") for side in sides),
        reasoning=summary.get("reasoning") or "keep",
        packed=packed,
        source=f"the data audit of the prepared data in {path}",
    )


def find_data_lengths(config: Config, stage: str) -> DataLengths | None:
    """The lengths of `stage`'s data as the launch of `config` would prepare it, when that preparation is in this
    machine's cache; else None (see the module doc)."""
    staged = stage_config(config, stage)
    model, template = staged.model.model_name_or_path, staged.model.chat_template_path
    if not model or model == EMBEDDED or not staged.data.dataset_name:
        return None
    if template and not Path(template).expanduser().exists():  # a Hub tokenizer's template: no download here
        return None
    try:
        tokenizer = apply_chat_template_path(load_tokenizer(str(Path(model).expanduser()) if Path(model).expanduser()
                                                            .exists() else model, staged.model.trust_remote_code,
                                                            local_files_only=True), template)
        path = prepared_path(staged.data, staged.sft, stage, staged.training.seed, tokenizer, cache_root() / "datasets")
        if not is_complete(path):
            return None
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (ModelError, OSError, ValueError):
        return None
    packed = objective(stage).data_shape == SEQUENCES and bool(staged.sft.packing)
    return lengths_from_summary(summary, path, packed)
