"""The packed, prefix-shared DPO forward: each pair's prompt is computed once and (almost) no padding is computed.

This module owns the toolkit's coupling to TRL 1.16's DPOTrainer internals for that forward, so a TRL upgrade that
changes them is this file's work:
- TRL's batch layout (`DataCollatorForPreference`: rows `[prompt+chosen; prompt+rejected]`, right-padded, with
  `completion_mask`), which `DPOTrainer._compute_loss` / `compute_ref_log_probs` read;
- TRL's fused LM head (`add_fused_lm_head`: `model(..., labels=..., fused_lm_head=True)` → `FusedCausalLMOutput` with
  per-token `log_probs`, `entropy`, `mean_logits`, `is_top1`, `log_sum_sq_probs`, `label_mask`, each `(rows, len-1)`),
  including its `shift_labels=` argument (labels already aligned with the positions that predict them), and that it
  calls the model's `base_model` (the backbone) before projecting its `last_hidden_state`: a hook there hands the
  head only the positions whose log-prob is read (`_hidden_states_at`), so the LM head never runs over the prompt.

How: the collator builds TRL's padded batch as usual (every loss type, `ld_alpha`, WPO weights and metric of TRL's
loss code read it unchanged) and, next to it, the packed layout. During TRL's loss / reference computation the model's
fused forward is redirected: it runs the packed tokens instead and scatters the per-token outputs back into the padded
`(2 * pairs, len - 1)` layout TRL expects. Only those per-token scalars are ever padded, never a token's computation.

Layout (sdpa / eager: a 4D mask; on a GPU FlexAttention's BlockMask of the same rule where src/packed_attention.py
picks it by row width, all segments then in one bucketed row): one segment per pair, `[prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected]`.
The last prompt token is the one position that predicts an answer's first token, and it must predict both answers'
first tokens: it is written once per answer (same token, same position, same visible keys → the same hidden state),
so each pair repeats exactly one prompt token. Position ids restart after the shared prompt for each answer; the mask
is causal within the segment except that the rejected answer does not see the chosen one. A padded forward of one
answer per prompt (KTO's completions, its KL completions: `answers` of one key) packs as one segment per row,
`[prompt | answer]`: the same layout with nothing shared, padding-free. Segments are packed
first-fit-decreasing into rows at least as long as the batch's longest segment, the width chosen to balance padding
against the dense mask's attention cost; the rest of a row is padding (counted).

Layout (flash-attention, varlen): flash-attention takes no such mask, so each answer is its own sequence
`[prompt | answer]` with positions restarting at 0 (transformers turns that into varlen); all sequences of the
micro-batch are one row: no padding, but the prompt is computed twice.

Sliding windows: a model whose config lists `layer_types` takes one mask per layer kind (a dict keyed by kind), each
with its window counted in positions; one without (Mistral, Phi-3, StarCoder2) one mask with its `sliding_window`.

Never silently wrong: trust is the allow-list of src/packed_dpo_support.py (each family proven exact in
tests/test_packed_support.py; anything else refused with its cause before data preparation), and the first packed
forward of a run is checked against the padded one (same model, same batch, no grad); a mismatch, or an error, on any
rank turns packing off for the run with one warning line naming the difference and the likely cause.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from src.distributed import any_rank, print0
from src.packed_attention import DENSE, FLEX, AttentionPolicy, flex_implementation, flex_rows, policy_for, \
    prefix_shared_block_mask
from src.private_api import attention_implementation
from src.packed_dpo_support import FLASH_PREFIX, announce_padded, refusal

PACKED_KEYS = ("packed_input_ids", "packed_position_ids", "packed_shift_labels", "packed_segment_ids",
               "packed_branch_ids", "packed_source_index", "padded_target_index", "packed_counts")
SHARED, CHOSEN, REJECTED = 0, 1, 2
PAIR_ANSWERS = ("chosen_ids", "rejected_ids")  # a pair's answers, in the order of TRL's padded rows
PASSES = ("policy", "kl", "reference")          # the forwards counted apart (PackedDPOForward.counts)
PACKED_FORMAT = 2        # in the reference cache key: bump when the layout or masks change (2: per-layer windows)
ONE_MASK = "*"           # layer_windows' key when every layer takes the same mask
FP32_TOLERANCE = 1e-4    # per-token log-prob, absolute + relative: fp32 packed vs padded differ by ~1e-6
HALF_TOLERANCE = 1e-1    # bf16 / fp16: rounding differs with the shapes; a leak through the mask shifts far more

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("packed_dpo_plan", default=None)
TAPE: contextvars.ContextVar = contextvars.ContextVar("fused_forward_tape", default=None)  # src/dpo_eval.py


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


def likely_cause(config) -> str:
    """What most often makes a model's packed log-probs differ, for the first-batch check's warning."""
    windows = {kind: window for kind, window in layer_windows(config).items() if window}
    if windows:
        return f"its attention window ({', '.join(f'{k} {w}' for k, w in windows.items())} positions) is applied " \
               "differently from transformers' masks"
    return "the model or attention implementation does not honour the packed mask or positions"


# --- the collator -----------------------------------------------------------------------------------------------

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
    attention_cost: float = 0.0       # per key, relative to a token's other work: see _rows
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
        packed = pack_pairs(self.as_pairs(examples), self.max_length, self.pad_token_id, self.layout,
                            self.padded_width(batch), self.attention_cost, self.score_prompt, self.answers,
                            self.attention)
        batch.update({self.prefix + key: value for key, value in packed.items()})
        return batch


def attention_cost_of(model) -> float:
    """Attention's work per key against the rest of a token's (projections and MLP, ~12 hidden² per layer, vs ~4
    hidden): the packer's trade of padding against a wider dense mask (_rows)."""
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


def _truncated(example: dict, max_length: int | None, answers: tuple[str, ...]) -> tuple[list, list[list]]:
    """The prompt and each answer as TRL's collators truncate them (keep_start, each prompt+answer to max_length)."""
    prompt = list(example["prompt_ids"])[:max_length]
    cut = None if max_length is None else max_length - len(prompt)
    return prompt, [list(example[key])[:cut] for key in answers]


def _first_fit_decreasing(sizes: list[int], width: int) -> list[list[int]]:
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        slot = next((r for r, used in enumerate(fill) if used + sizes[i] <= width), None)
        if slot is None:
            rows.append([])
            fill.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        fill[slot] += sizes[i]
    return rows


def _rows(sizes: list[int], attention_cost: float) -> tuple[int, list[list[int]]]:
    """The row width and rows (segment indices) for a 4D-masked forward: a dense mask costs every row width² in
    attention, so wider rows pad less but attend more. Cost of a token ∝ 1 + attention_cost * width (attention_cost:
    the attention's share per key, ~1 / (3 * hidden_size)); the width among a few candidates that costs least."""
    longest, total = max(sizes), sum(sizes)
    best = None
    for width in sorted({longest, *(max(longest, -(-total // k)) for k in range(1, len(sizes) + 1))}):
        rows = _first_fit_decreasing(sizes, width)
        cost = len(rows) * width * (1 + attention_cost * width)
        if best is None or cost < best[0]:
            best = (cost, width, rows)
    return best[1], best[2]


def pack_pairs(examples: list[dict], max_length: int | None, pad_token_id: int, layout: str,
               padded_length: int, attention_cost: float = 0.0, score_prompt: bool = False,
               answers: tuple[str, ...] = PAIR_ANSWERS, attention: AttentionPolicy | None = None) -> dict:
    """The packed tensors for a micro-batch of prompts with one or two answers each (`answers`: their keys, in the
    order of the padded rows: answer j of example i is padded row j * examples + i; see the module docstring for the
    layouts).

    packed_source_index / padded_target_index: for every scored token, where its per-token outputs sit in the
    flattened packed `(rows, width)` output and in TRL's flattened padded `(answers * examples, padded_length - 1)`
    output. Scored: the answers' tokens, and with `score_prompt` also the prompt's (from its second token) in the first
    answer's row (ORPO's NLL term covers prompt + chosen answer): the shared prompt's positions, computed once.
    `attention`: where it picks FlexAttention for the dense layout's width, every segment goes in one bucketed row."""
    if len(answers) not in (1, 2):
        raise ValueError(f"the packed layout holds one or two answers per prompt, not {len(answers)}")
    segments, useful, repeated = _segments(examples, max_length, layout, score_prompt, answers)
    width, rows = _packed_rows([len(segment[0]) for segment in segments], layout, attention_cost, attention)
    packed = _packed_tensors(segments, rows, width, pad_token_id, padded_length, layout)
    computed = len(rows) * width
    # computed, padding, repeated prompt, useful tokens
    packed["packed_counts"] = torch.tensor([computed, computed - useful - repeated, repeated, useful], dtype=torch.long)
    return packed


def _segments(examples: list[dict], max_length: int | None, layout: str, score_prompt: bool,
              answers: tuple[str, ...]) -> tuple[list[tuple], int, int]:
    """The layout's segments (per segment: tokens, positions, branch ids, labels, [(padded row, padded start, offset,
    count)]), the useful tokens and the prompt tokens computed more than once."""
    pairs = len(examples)
    segments = []
    useful = repeated = 0
    for index, example in enumerate(examples):
        prompt, replies = _truncated(example, max_length, answers)
        useful += len(prompt) + sum(len(answer) for answer in replies)
        padded_rows = range(index, len(replies) * pairs, pairs)
        if layout == "prefix_shared":
            repeated += len(prompt[-1:]) * (len(replies) - 1)
            segments.append(_prefix_shared_segment(index, prompt, replies, padded_rows, score_prompt))
            continue
        repeated += len(prompt) * (len(replies) - 1)
        for row, answer in zip(padded_rows, replies):
            sequence = prompt + answer
            start = 0 if score_prompt and row == index else max(0, len(prompt) - 1)
            labels = [-100] * start + sequence[start + 1:] + [-100]
            segments.append((sequence, list(range(len(sequence))), [SHARED] * len(sequence), labels[:len(sequence)],
                             [(row, start, start, len(sequence) - 1 - start)]))
    return segments, useful, repeated


def _prefix_shared_segment(index: int, prompt: list, replies: list[list], padded_rows, score_prompt: bool) -> tuple:
    """One prompt and its answers as one segment: the prompt but its last token once, then each answer's branch
    (that last prompt token, which predicts the answer's first, then the answer)."""
    shared, pivot = prompt[:-1], prompt[-1:]
    tokens, positions, branches, labels, targets = list(shared), list(range(len(shared))), \
        [SHARED] * len(shared), [-100] * len(shared), []
    if score_prompt and shared:  # shared[k] predicts prompt[k + 1], the chosen row's shifted position k
        labels = list(prompt[1:])
        targets.append((index, 0, 0, len(shared)))
    for branch, row, answer in zip((CHOSEN, REJECTED), padded_rows, replies):
        sequence = pivot + answer
        # sequence[k] predicts sequence[k + 1]; in TRL's padded row that is shifted position start + k
        targets.append((row, len(shared), len(tokens), len(sequence) - 1))
        tokens += sequence
        positions += range(len(shared), len(shared) + len(sequence))
        branches += [branch] * len(sequence)
        labels += sequence[1:] + [-100]
    return tokens, positions, branches, labels, targets


def _packed_rows(sizes: list[int], layout: str, attention_cost: float,
                 attention: AttentionPolicy | None) -> tuple[int, list[list[int]]]:
    """The row width and which segments each row holds."""
    if layout == "varlen":  # everything in one row: flash-attention's cost follows each sequence, not the row
        return sum(sizes), [list(range(len(sizes)))]
    width, rows = _rows(sizes, attention_cost)
    if attention is not None and attention.kind_for(width) == FLEX:
        width, rows = flex_rows(sizes)
    return width, rows


def _packed_tensors(segments: list[tuple], rows: list[list[int]], width: int, pad_token_id: int, padded_length: int,
                    layout: str) -> dict:
    """The segments laid into their rows, and each scored token's place in the packed and in TRL's padded output."""
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    shift_labels = torch.full(shape, -100, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)  # padding: its own segment, so it never reaches a token
    branch_ids = torch.zeros(shape, dtype=torch.long)
    source, target = [], []
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            tokens, positions, branches, labels, targets = segments[i]
            n = len(tokens)
            input_ids[r, at:at + n] = torch.tensor(tokens)
            position_ids[r, at:at + n] = torch.tensor(positions)
            shift_labels[r, at:at + n] = torch.tensor(labels)
            segment_ids[r, at:at + n] = i
            branch_ids[r, at:at + n] = torch.tensor(branches)
            for padded_row, padded_start, offset, count in targets:
                source.extend(range(r * width + at + offset, r * width + at + offset + count))
                target.extend(range(padded_row * (padded_length - 1) + padded_start,
                                    padded_row * (padded_length - 1) + padded_start + count))
            at += n
    if layout == "varlen":  # the row's trailing padding (none today) would join the last sequence: keep it out
        position_ids[segment_ids < 0] = 0
    return {"packed_input_ids": input_ids, "packed_position_ids": position_ids, "packed_shift_labels": shift_labels,
            "packed_segment_ids": segment_ids, "packed_branch_ids": branch_ids,
            "packed_source_index": torch.tensor(source, dtype=torch.long),
            "padded_target_index": torch.tensor(target, dtype=torch.long)}


def padded_counts(batch: dict, answers: int = 2) -> torch.Tensor:
    """computed, padding, repeated prompt, useful tokens of TRL's padded batch (rows [chosen; rejected]; with one
    answer per prompt, no prompt is repeated), on the batch's device: counted without a read (TokenCounts)."""
    computed = batch["input_ids"].new_full((), batch["input_ids"].numel())
    real = batch["attention_mask"].sum()
    pairs = batch["input_ids"].shape[0] // answers
    repeated = batch["attention_mask"][pairs:].sum() - batch["completion_mask"][pairs:].sum()
    return torch.stack([computed, computed - real, repeated, real - repeated]).long()


# --- the forward ------------------------------------------------------------------------------------------------

class TokenCounts:
    """Tokens the forward computed, and which of them were padding or a repeated prompt, over the batches this
    process ran (each rank counts its own; the shares are what to compare). A step's counts are added on the device
    they come from (no stall per step) and read when asked (`as_dict`, `totals`)."""

    def __init__(self):
        self.batches = 0
        self._host = [0, 0, 0, 0]
        self._device: torch.Tensor | None = None  # the running sum of counts that came as tensors

    def add(self, counts) -> None:
        self.batches += 1
        if torch.is_tensor(counts):
            self._device = counts.long() if self._device is None else self._device + counts.to(self._device.device)
        else:
            self._host = [total + int(value) for total, value in zip(self._host, counts)]

    def totals(self) -> list[int]:
        """computed, padding, repeated prompt, useful tokens."""
        device = self._device.tolist() if self._device is not None else [0, 0, 0, 0]
        return [host + on_device for host, on_device in zip(self._host, device)]

    def as_dict(self) -> dict:
        computed, padding, repeated, useful = self.totals()
        share = lambda part: round(part / computed, 4) if computed else None  # noqa: E731
        return {"batches": self.batches, "computed_tokens": computed, "padding_share": share(padding),
                "repeated_prompt_share": share(repeated), "useful_share": share(useful)}


@dataclass
class _Plan:
    batch: dict        # the packed tensors
    padded_shape: tuple
    verify: bool


class PackedDPOForward:
    """Decides whether the packed forward runs, redirects the fused forward while TRL's loss code runs, checks it
    once against the padded forward, and counts the tokens both ways."""

    def __init__(self, reason_off: str | None, layout: str = "prefix_shared", half_precision: bool = False,
                 attention: AttentionPolicy | None = None):
        self.enabled = reason_off is None
        self.attention = attention or AttentionPolicy(DENSE, why_not_flex="no attention policy given",
                                                      announce=False)
        self.padded_passes: tuple[str, ...] = ()  # its trainer's passes that stay padded while it packs (the summary)
        # bf16/fp16 mixed precision asked of the trainer: inside a training step accelerate's autocast is entered by
        # the model's own (wrapped) forward, below the check, so the ambient autocast state alone reads fp32 there
        self.half_precision = half_precision
        self.reason = reason_off
        self.layout = layout
        self.checked = False
        self.check_result: dict | None = None
        # policy: the forwards with gradients; kl: the policy's without (KTO's KL completions); reference
        self.counts = {kind: TokenCounts() for kind in PASSES}
        self.padded_equivalent = {kind: TokenCounts() for kind in PASSES}
        self.last_policy = None  # computed, padding, repeated, useful of the last training forward (a tensor)

    # Called by the trainer around TRL's loss / reference computation
    @contextlib.contextmanager
    def running(self, inputs: dict, forwards: tuple[str, ...], modules, padded=None):
        """`inputs` without the packed keys (TRL would hand them to the model), with the fused forward of `modules`
        redirected to the packed layout while the block runs. `padded`: what the trainer's own padded forward computes
        (computed, padding, repeated prompt, useful tokens) where that is not `inputs` as one padded batch (KTO's two
        padded passes)."""
        packed = {key: inputs[key] for key in PACKED_KEYS if key in inputs}
        inputs = {key: value for key, value in inputs.items() if key not in PACKED_KEYS}
        plan = None
        if self.enabled and packed:
            install(modules)
            plan = _Plan(packed, tuple(inputs["input_ids"].shape), verify=not self.checked)
        for kind in forwards:
            self.padded_equivalent[kind].add(padded if padded is not None else padded_counts(inputs))
        token = _ACTIVE.set((self, plan))
        try:
            yield inputs
        finally:
            _ACTIVE.reset(token)
        for kind in forwards:  # after the block: a failed first check falls back within it
            counts = packed["packed_counts"] if self.enabled and plan else \
                padded if padded is not None else padded_counts(inputs)
            self.counts[kind].add(counts)
            if kind == "policy":
                self.last_policy = counts

    def cache_tag(self) -> str:
        """Which forward computes the log-probs, for the reference cache key: a cache written by one forward (or an
        older packing code) is never reused by another."""
        if not self.enabled:
            return "padded"
        flex = f"-flex{self.attention.requested}" if self.attention.flex_possible and self.attention.requested != \
            "dense" else ""  # FlexAttention's sums round differently from the dense mask's
        return f"packed-{self.layout}-v{PACKED_FORMAT}{flex}"

    def computed_tokens(self) -> tuple | None:
        """(computed, padding) tokens of the last policy forward, once: the throughput meter's layout figures (0-d
        tensors, summed by the meter on the device until it logs)."""
        counts, self.last_policy = self.last_policy, None
        return (counts[0], counts[1]) if counts is not None else None

    def summary(self) -> dict:
        mask = {"dense": "4D mask", "flex": "FlexAttention BlockMask"}
        masks = " / ".join(mask[kind] for kind in sorted(self.attention.chosen)) or "4D mask"
        forward = (f"packed (prefix-shared: each prompt once, {masks})" if self.layout == "prefix_shared" else
                   "packed (varlen: no padding, prompt per answer)") if self.enabled else "padded (TRL)"
        if self.enabled and self.padded_passes:
            forward += f", TRL's padded forward for the {' and '.join(self.padded_passes)} pass"
        return {
            "forward": forward,
            "reason": self.reason,
            "first_batch_check": self.check_result,
            "attention": self.attention.summary() if self.enabled and self.layout == "prefix_shared" else None,
            "tokens": {kind: counts.as_dict() for kind, counts in self.counts.items() if counts.batches},
            "padded_forward_would_compute": {kind: counts.as_dict() for kind, counts in self.padded_equivalent.items()
                                             if counts.batches},
        }

    def _disable(self, reason: str) -> None:
        self.enabled = False
        self.reason = reason
        if _is_main_process():
            print(f"  warning: packed forward off, TRL's padded forward runs instead: {reason}", flush=True)

    def _forward(self, module, fused, plan: _Plan, kwargs: dict):
        input_ids = kwargs.pop("input_ids")
        if tuple(input_ids.shape) != plan.padded_shape:
            raise RuntimeError(f"packed DPO forward: expected TRL's padded batch {plan.padded_shape}, got "
                               f"{tuple(input_ids.shape)} (has TRL's DPO batch layout changed?)")
        padded_kwargs = dict(kwargs, input_ids=input_ids)
        if plan.verify:
            self.checked = True
            plan.verify = False
            mismatch = self._check(module, fused, plan, padded_kwargs)
            if mismatch:
                self._disable(mismatch)
        if not self.enabled:
            return fused(**padded_kwargs, fused_lm_head=True)
        return self._packed(module, fused, plan, kwargs, input_ids)

    def _packed(self, module, fused, plan: _Plan, kwargs: dict, input_ids):
        device = input_ids.device
        batch = {key: value.to(device) for key, value in plan.batch.items()}
        kwargs = {key: value for key, value in kwargs.items()
                  if key not in ("input_ids", "attention_mask", "labels", "position_ids", "shift_labels")}
        attend = contextlib.nullcontext()
        if self.layout == "prefix_shared":
            width = batch["packed_input_ids"].shape[1]
            kind = self.attention.kind_for(width)
            line = self.attention.note(kind, width)
            if line and _is_main_process():
                print(line, flush=True)
            eager = str(attention_implementation(module.config)) == "eager"  # eager adds the mask to the scores
            dtype = next(module.parameters()).dtype
            masks = {}
            for layer_kind, window in layer_windows(module.config).items():
                if kind == FLEX:
                    masks[layer_kind] = prefix_shared_block_mask(batch["packed_segment_ids"],
                                                                 batch["packed_branch_ids"],
                                                                 batch["packed_position_ids"], window)
                    continue
                mask = _prefix_shared_mask(batch["packed_segment_ids"], batch["packed_branch_ids"],
                                           batch["packed_position_ids"], window)
                if eager:
                    mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
                masks[layer_kind] = mask
            kwargs["attention_mask"] = masks.pop(ONE_MASK) if ONE_MASK in masks else masks
            if kind == FLEX:
                self.attention.compiles.watch()
                attend = flex_implementation(module)
        else:
            kwargs["attention_mask"] = None  # positions restarting at 0 → transformers' varlen path
        source, target = batch["packed_source_index"], batch["padded_target_index"]
        # The LM head only where a log-prob is read (answers, the prompt token before each, ORPO's prompt): TRL's
        # fused head projects the hidden states of those positions, in the order of `source`, not the whole prompt.
        with attend, _hidden_states_at(module, source):
            outputs = fused(input_ids=batch["packed_input_ids"], position_ids=batch["packed_position_ids"],
                            shift_labels=batch["packed_shift_labels"].reshape(-1)[source][None], fused_lm_head=True,
                            **kwargs)
        rows, length = plan.padded_shape

        def unpack(values):
            if values is None:
                return None
            picked = values.reshape(-1)
            return picked.new_zeros(rows * (length - 1)).index_put((target,), picked).view(rows, length - 1)

        fields = {name: unpack(getattr(outputs, name)) for name in
                  ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")}
        return type(outputs)(loss=outputs.loss, aux_loss=outputs.aux_loss, **fields)

    def _check(self, module, fused, plan: _Plan, padded_kwargs: dict) -> str | None:
        """Packed vs padded per-token log-probs of this batch, no grad, dropout off; agreed over all ranks. An error
        in the packed forward (a shape the model cannot take) is a failed check, not a crash."""
        was_training = module.training
        module.eval()
        error = None
        try:
            with torch.no_grad():
                padded = fused(**padded_kwargs, fused_lm_head=True).log_probs.float()
                try:
                    packed = self._packed(module, fused, plan, padded_kwargs,
                                          padded_kwargs["input_ids"]).log_probs.float()
                except Exception as raised:  # noqa: BLE001 - any failure of the packed layout means: do not pack
                    error = f"{type(raised).__name__}: {str(raised).splitlines()[0][:200] if str(raised) else ''}"
                    packed = padded
        finally:
            module.train(was_training)
        device_type = padded_kwargs["input_ids"].device.type
        half = (self.half_precision or torch.is_autocast_enabled(device_type)
                or next(module.parameters()).dtype != torch.float32)
        tolerance = HALF_TOLERANCE if half else FP32_TOLERANCE
        excess = (packed - padded).abs() - tolerance * padded.abs()
        worst = float((packed - padded).abs().max()) if packed.numel() else 0.0
        (failed,) = any_rank(error is not None or bool((excess > tolerance).any()))
        self.check_result = {"max_abs_difference": None if error else worst, "tolerance": tolerance,
                             "passed": not failed, "tokens": int((padded != 0).sum()), "error": error}
        if not failed:
            return None
        if error:
            return f"the packed forward raised {error} on its first batch"
        if worst <= tolerance:
            return "its first batch's log-probs differ from the padded forward's on another rank"
        return (f"its first batch's log-probs differ from the padded forward's (max |difference| {worst:.3g} on this "
                f"rank, tolerance {tolerance}); likely cause: {likely_cause(module.config)}")


@contextlib.contextmanager
def _hidden_states_at(module, positions: torch.Tensor):
    """While the block runs, the backbone of `module` (what TRL's fused forward calls before its LM head) returns its
    last hidden states at `positions` of the flattened `(rows, width)` output only, as one row `(1, positions, hidden)`:
    the LM head then runs over those positions alone."""

    def gather(backbone, args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)[None]
        return output

    handle = module.base_model.register_forward_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def _prefix_shared_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor, position_ids: torch.Tensor,
                        window: int | None = None) -> torch.Tensor:
    """(rows, 1, width, width) boolean, True = may attend: causal within a pair's segment, a rejected answer's token
    never sees the chosen answer, and with a window only keys fewer than `window` positions back (transformers'
    `kv_idx > q_idx - sliding_window`, counted in positions: the shared prompt's positions count for both answers)."""
    width = segment_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    leak = (branch_ids[:, :, None] == REJECTED) & (branch_ids[:, None, :] == CHOSEN)
    allowed = same & causal & ~leak
    if window is not None:
        allowed &= (position_ids[:, :, None] - position_ids[:, None, :]) < window
    return allowed[:, None]


def layer_windows(config) -> dict[str, int | None]:
    """The attention window, in positions, of each kind of layer the packed mask must reproduce (None: full causal).
    A model whose config lists `layer_types` takes one mask per kind (a dict keyed by kind, as its forward accepts);
    one without takes a single mask for every layer, windowed when the config has a `sliding_window` (Mistral, Phi-3,
    StarCoder2). Kinds a mask cannot express are refused before this is asked (src/packed_dpo_support.py)."""
    text = config.get_text_config()
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or []))
    if kinds and kinds != ["full_attention"]:
        return {kind: text.sliding_window if kind == "sliding_attention" else None for kind in kinds}
    return {ONE_MASK: None if kinds else getattr(text, "sliding_window", None)}


def _install(module) -> None:
    """Wrap `module`'s fused forward (TRL's, an instance attribute) once: while a plan is active, a
    `fused_lm_head=True` call runs the packed layout; while a tape is active (src/dpo_eval.py) its outputs are
    recorded, or replayed instead of computed. Called through `__call__` or, as PEFT does, `.forward`."""
    if getattr(module, "_packed_dpo_installed", False):
        return
    fused = module.forward

    @functools.wraps(fused)
    def forward(*args, fused_lm_head=False, **kwargs):
        tape = TAPE.get()
        if fused_lm_head and tape is not None and tape.replaying:
            return tape.replay()
        active = _ACTIVE.get()
        if not fused_lm_head or active is None or active[1] is None or args:
            outputs = fused(*args, fused_lm_head=fused_lm_head, **kwargs)
        else:
            owner, plan = active
            outputs = owner._forward(module, fused, plan, kwargs)
        if fused_lm_head and tape is not None:
            tape.record(outputs)
        return outputs

    module.forward = forward
    module._packed_dpo_installed = True


def install(modules) -> None:
    """The fused-forward wrapper on each module (what `running` does for the packed layout)."""
    for module in modules:
        _install(module)


def fused_modules(trainer) -> list:
    """The modules carrying TRL's fused forward: the policy (inside DDP and PEFT wrappers) and the reference."""
    found = []
    for model in (trainer.model, getattr(trainer, "ref_model", None)):  # reference-free trainers have none
        if model is None:
            continue
        model = trainer.accelerator.unwrap_model(model)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        found.append(model)
    return found


def _is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
