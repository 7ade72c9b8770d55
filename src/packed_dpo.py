"""The packed, prefix-shared forward as a trainer builds it: each pair's prompt is computed once and (almost) no
padding is computed. This module owns what a trainer whose objective row has `packed_forward` asks for: `forward_plan`
(packed or TRL's padded forward for this model and configuration, which layout, which attention) and the collators
(TRL's padded batch as usual, so every loss type, `ld_alpha`, WPO weights and metric of TRL's loss code read it
unchanged, and next to it the packed layout of the same examples; the answers' loss masks applied to both).

Where the rest lives:
- src/packed_layout.py: the layout (segments `[prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected]`, or varlen under
  flash-attention; rows; where each scored token's outputs go in TRL's padded layout) and the token counts;
- src/packed_attention.py: the masks (dense 4D or FlexAttention's BlockMask, per layer kind with its window) and which
  one a row runs;
- src/packed_forward.py: TRL's fused forward redirected to the packed layout during TRL's own loss call, the first-batch
  check against the padded forward, the tokens counted both ways.

Never silently wrong: trust is the allow-list of src/packed_dpo_support.py (each family proven exact in
tests/test_packed_support.py; anything else refused with its cause before data preparation), and the first packed
forward of a run is checked against the padded one (src/packed_forward.py); a mismatch, or an error, on any rank turns
packing off for the run with one warning line naming the difference and the likely cause.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from src.distributed import print0
from src.packed_attention import FLEX, AttentionPolicy, policy_for
from src.packed_dpo_support import FLASH_PREFIX, announce_padded, refusal
from src.packed_forward import PackedDPOForward
from src.packed_layout import ANSWER_MASKS, PAIR_ANSWERS, pack_pairs
from src.private_api import attention_implementation


def attention_layout(model) -> str:
    """"prefix_shared" (a 4D mask) or "varlen" (flash-attention: sequences told apart by restarting positions)."""
    implementation = str(attention_implementation(model.config) or "")
    return "varlen" if FLASH_PREFIX in implementation else "prefix_shared"


def unsupported_reason(model, args, peft_config=None) -> str | None:
    """Why the packed forward cannot be trusted for this model and configuration, or None: the allow-list and causes
    of src/packed_dpo_support.py. What is not refused is still checked against the padded forward on the first batch."""
    return refusal(model.config, attn_implementation=attention_implementation(model.config),
                   router_aux_loss_coef=getattr(args, "router_aux_loss_coef", None),
                   truncation_mode=getattr(args, "truncation_mode", "keep_start"),  # legacy pair configs: none
                   prompt_learning=peft_config is not None and getattr(peft_config, "is_prompt_learning", False))


# --- the collators ----------------------------------------------------------------------------------------------

def _examples_are_pairs(examples: list[dict]) -> list[dict]:
    return examples


def _input_ids_width(batch: dict) -> int:
    return batch["input_ids"].shape[1]


@dataclass
class PackedPreferenceCollator:
    """The trainer's padded batch (its own collator: TRL's DataCollatorForPreference for DPO), plus the packed layout
    of the same examples (PACKED_KEYS, after `prefix`). Another trainer's examples and batch are read through
    `as_pairs` (examples → prompt_ids and the `answers` keys), `answers` (the answer columns, in the order of the
    padded rows they fill: `[chosen; rejected]` by default, one key for one answer per prompt) and `padded_width` (the
    width of those padded rows): SimPO's and ORPO's (src/trainers/legacy_pairs.py), KTO's (src/trainers/kto.py: its
    reference pass's completion and KL completion as a pair; its training step's completions, and with prefix "KL_"
    its KL completions, one answer each). A collator is itself a padded collator of another: the KTO step's two
    passes are one collator inside another."""

    padded_collator: object           # has pad_token_id, and max_length where it truncates
    layout: str = "prefix_shared"     # or "varlen"
    attention_cost: float = 0.0       # per key, relative to a token's other work: attention_cost_of
    as_pairs: Callable = _examples_are_pairs
    padded_width: Callable = _input_ids_width
    score_prompt: bool = False        # see pack_pairs
    answers: tuple[str, ...] = PAIR_ANSWERS
    prefix: str = ""                  # of the packed keys in the batch (another pass of the same batch: "KL_")
    attention: AttentionPolicy | None = None  # dense mask or FlexAttention by row width (src/packed_attention.py)

    @property
    def pad_token_id(self) -> int:
        return self.padded_collator.pad_token_id

    @property
    def max_length(self) -> int | None:
        return getattr(self.padded_collator, "max_length", None)

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.padded_collator(examples)
        mask_answers(batch, self.as_pairs(examples), self.max_length, self.answers)
        packed = pack_pairs(self.as_pairs(examples), self.max_length, self.pad_token_id, self.layout,
                            self.padded_width(batch), self.attention_cost, self.score_prompt, self.answers,
                            self.attention)
        batch.update({self.prefix + key: value for key, value in packed.items()})
        return batch


@dataclass
class AnswerMaskedCollator:
    """TRL's padded preference batch with the answers' loss masks applied (mask_answers): the collator of the padded
    forward, so the policy, the reference pass and its cache read the masks as the packed forward's collator does."""

    padded_collator: object

    @property
    def pad_token_id(self) -> int:
        return self.padded_collator.pad_token_id

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.padded_collator(examples)
        mask_answers(batch, examples, getattr(self.padded_collator, "max_length", None))
        return batch


def mask_answers(batch: dict, examples: list[dict], max_length: int | None,
                 answers: tuple[str, ...] = PAIR_ANSWERS) -> None:
    """Each answer's loss mask (ANSWER_MASKS, where the examples carry it) multiplied into TRL's `completion_mask`:
    answer j of example i fills padded row j * examples + i from the prompt's length on, truncated as the padded
    collator truncates (keep_start); TRL's loss, metrics and reference pass then count the model's own tokens only."""
    keys = [(row_block, ANSWER_MASKS[key]) for row_block, key in enumerate(answers)
            if key in ANSWER_MASKS and examples and ANSWER_MASKS[key] in examples[0]]
    if not keys:  # no trajectory in this batch (and another trainer's batch may have no completion_mask)
        return
    width = batch["completion_mask"].shape[1]
    for row_block, mask_key in keys:
        for index, example in enumerate(examples):
            start = len(example["prompt_ids"])
            end = min(start + len(example[mask_key]), width if max_length is None else min(max_length, width))
            if end > start:
                row = row_block * len(examples) + index
                mask = torch.tensor(list(example[mask_key])[:end - start], dtype=batch["completion_mask"].dtype)
                batch["completion_mask"][row, start:end] *= mask


# --- the plan ---------------------------------------------------------------------------------------------------

def attention_cost_of(model) -> float:
    """Attention's work per key against the rest of a token's (projections and MLP, ~12 hidden² per layer, vs ~4
    hidden): the packer's trade of padding against a wider dense mask (src/packed_layout.py _rows)."""
    return 1 / (3 * model.config.get_text_config().hidden_size)


def forward_plan(model, trl_config, peft_config, packed: bool = True, attention: str = "auto") -> PackedDPOForward:
    """The packed forward of a trainer: on unless `--padding_free false` or the model cannot honour it (then the
    padded forward, with one warning line saying why). Every objective whose row has `packed_forward` builds it here.
    `attention`: --packed_attention (auto, dense or flex; src/packed_attention.py), for the prefix-shared layout."""
    if not packed:
        return PackedDPOForward("--padding_free false")
    reason = unsupported_reason(model, trl_config, peft_config)
    if reason:
        announce_padded(reason)
    layout = attention_layout(model)
    policy = None
    if layout == "prefix_shared":
        on_cuda = not getattr(trl_config, "use_cpu", False) and torch.cuda.is_available()
        policy = policy_for(model, attention, on_cuda)
        if attention == FLEX and not policy.flex_possible:
            print0(f"  warning: --packed_attention flex: FlexAttention cannot run here ({policy.why_not_flex}); the "
                   "dense mask runs instead")
    return PackedDPOForward(reason, layout, half_precision=bool(trl_config.bf16 or trl_config.fp16), attention=policy)

