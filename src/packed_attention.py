"""Which attention the packed, prefix-shared forward (src/packed_forward.py) runs on a row, and the masks it hands the
model: this module owns the choice (dense mask through sdpa/eager, or FlexAttention with a BlockMask), the row widths
FlexAttention sees (bucketed, so a run compiles a bounded number of times), both masks built from the packed layout's
segments and branches (src/packed_layout.py) with each layer kind's window (`attention_masks`), and the count of
compiles.

Sliding windows: a model whose config lists `layer_types` takes one mask per layer kind (a dict keyed by kind), each
with its window counted in positions; one without (Mistral, Phi-3, StarCoder2) one mask with its `sliding_window`.

Why two: sdpa with an arbitrary 4D mask cannot skip masked blocks (for grouped-query models transformers' sdpa path
even falls back to the math kernel), so a packed row costs width² in attention whatever its segments. FlexAttention
(`torch.nn.attention.flex_attention`, which transformers 5 calls under `attn_implementation="flex_attention"` and to
which it passes a prepared BlockMask unchanged) computes only the blocks the mask keeps. On short rows the dense mask
is faster, on long rows the block-sparse one. The width where they cross is CROSSOVER_WIDTH: until measured on this
toolkit's forward on a GPU (bench/bench_packed_attention.py writes that table), it is a published measure (one H200,
a 125M model, 8 documents a row: FlexAttention 0.72x a dense-mask sdpa at width 512, 1.31x at 2,048, 2.34x at 8,192;
the log-linear interpolation crosses 1.0x near 1,100, rounded down to 1,024).

Rules (the collator and the forward apply the same one, so the forward knows the choice from the row's width alone):
- `dense`: always the 4D mask (today's forward).
- `flex`: always FlexAttention; a CUDA GPU only (FlexAttention has no backward on CPU: refused in the config).
- `auto`: FlexAttention where the dense layout's row would be at least CROSSOVER_WIDTH wide, on a CUDA GPU, for a
  family whose flex forward is proven exact (FLEX_UNVERIFIED are not); the dense mask otherwise, with the reason.
A row given to FlexAttention holds the whole micro-batch (its attention cost follows the segments, not the row), its
width rounded up to a bucket (bucket_width); the padding is counted like any other.

Model families: transformers runs a family under flex_attention when its class says `_supports_flex_attn`;
tests/test_packed_support.py proves, for every such family of the packed allow-list, that the flex forward's per-token
log-probs equal TRL's padded forward's within 1e-5 in fp32 (CPU, forward only). The families it cannot prove are
FLEX_UNVERIFIED, with the cause.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from src import seams
from src.plan import FLEX_ATTENTION
from src.private_api import attention_implementation, set_attention_implementation

DENSE, FLEX = "dense", "flex"
CHOICES = ("auto", DENSE, FLEX)
CROSSOVER_WIDTH = 1024
CROSSOVER_SOURCE = ("published H200 measure (FlexAttention 0.72x a dense mask at width 512, 1.31x at 2,048, 2.34x at "
                    "8,192), not yet measured on this forward on a GPU")
BLOCK = 128                # FlexAttention's block: rows are whole blocks, so no block is partly outside the row
OCTAVE_STEPS = 8           # width buckets per doubling above 1,024: at most 1/8 of a row is bucket padding
SHARED, CHOSEN, REJECTED = 0, 1, 2  # the packed layout's branch ids (src/packed_layout.py), which the masks read
ONE_MASK = "*"           # layer_windows' key when every layer takes the same mask
# Families of the packed allow-list whose flex forward the suite cannot prove on CPU, with the cause.
SINKS = ("attention sinks: transformers' flex path cannot run them on CPU, so the suite cannot prove the family "
         "exact under FlexAttention")
FLEX_UNVERIFIED: dict[str, str] = {
    **dict.fromkeys("flint gpt_oss granite_swa granitemoe_swa".split(), SINKS),
    "doge": "its dynamic mask is added to the attention mask, which a BlockMask does not carry (measured: log-probs "
            "off by 6 under flex)",
    "hrm_text": "its flex forward differs from the padded one by 1.6e-4 per token (measured), above the suite's 1e-5",
}


def bucket_width(width: int) -> int:
    """The width FlexAttention gets for a row of `width` tokens: a multiple of BLOCK up to 1,024, then one of
    OCTAVE_STEPS steps per doubling (1,152, 1,280, ..., 2,048, 2,304, ...). Each bucket is a shape that may compile:
    widths up to 16,384 give at most 8 + 4 x 8 = 40 of them, whatever the data."""
    step = BLOCK
    if width > 1024:
        step = max(BLOCK, (1 << ((width - 1).bit_length() - 1)) // OCTAVE_STEPS)
    return -(-width // step) * step


def flex_refusal(model) -> str | None:
    """Why this model cannot run the packed forward on FlexAttention, or None."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type in FLEX_UNVERIFIED:
        return f"{model_type}: {FLEX_UNVERIFIED[model_type]}"
    if not getattr(model, "_supports_flex_attn", False):
        return f"{model_type}: transformers does not run this family under flex_attention"
    return None


@dataclass
class AttentionPolicy:
    """The rule that picks the attention of a packed row (see the module docstring), and what it picked."""

    requested: str = "auto"
    flex_possible: bool = False       # a CUDA GPU and a family proven exact under flex
    why_not_flex: str | None = None   # when it is not possible
    crossover_width: int = CROSSOVER_WIDTH
    chosen: dict = field(default_factory=dict)    # kind -> batches
    widths: set = field(default_factory=set)      # distinct flex row widths (each a shape that may compile)
    compiles: "CompileCounter | None" = None
    announce: bool = True  # the console line; a forward built without a policy (varlen, a bench's own) prints none

    def kind_for(self, width: int) -> str:
        """DENSE or FLEX for a row of the dense layout `width` tokens wide (the collator), or a packed row of that
        width (the forward: a flex row is at least as wide as the dense row it replaces, so both read the same)."""
        if not self.flex_possible or self.requested == DENSE:
            return DENSE
        if self.requested == FLEX:
            return FLEX
        return FLEX if width >= self.crossover_width else DENSE

    def reason(self, kind: str, width: int) -> str:
        if self.requested != "auto":
            return f"--packed_attention {self.requested}"
        if not self.flex_possible:
            return f"--packed_attention auto, FlexAttention not possible: {self.why_not_flex}"
        side = "at least" if kind == FLEX else "under"
        return (f"--packed_attention auto: a row of {width} tokens is {side} {self.crossover_width}, the width where "
                f"FlexAttention overtakes a dense mask ({CROSSOVER_SOURCE})")

    def note(self, kind: str, width: int) -> str | None:
        """Counts a forward of `kind`; the console line (with the reason) the first time a kind runs, else None."""
        first = kind not in self.chosen
        self.chosen[kind] = self.chosen.get(kind, 0) + 1
        if kind == FLEX:
            self.widths.add(width)
        if not first or not self.announce:
            return None
        name = "block-sparse (FlexAttention, BlockMask)" if kind == FLEX else "dense mask (4D, " \
            "sdpa/eager)"
        return f"  packed attention: {name} for rows of {width} tokens: {self.reason(kind, width)}"

    def summary(self) -> dict:
        return {"requested": self.requested, "flex_possible": self.flex_possible, "why_not_flex": self.why_not_flex,
                "crossover_width": self.crossover_width, "crossover_source": CROSSOVER_SOURCE,
                "batches": dict(self.chosen), "flex_widths": sorted(self.widths),
                "compiles": self.compiles.as_dict() if self.compiles else None}


def policy_for(model, requested: str, on_cuda: bool) -> AttentionPolicy:
    """The policy of a packed forward of `model` (`requested`: --packed_attention)."""
    why = None if on_cuda else "no CUDA GPU (FlexAttention has no backward on CPU)"
    why = why or flex_refusal(model)
    return AttentionPolicy(requested, flex_possible=why is None, why_not_flex=why,
                           compiles=CompileCounter() if why is None else None)


def flex_rows(sizes: list[int]) -> tuple[int, list[list[int]]]:
    """FlexAttention's row layout: every segment in one row (its attention cost follows the segments, so a wider row
    costs no attention), the width bucketed."""
    return bucket_width(sum(sizes)), [list(range(len(sizes)))]


def prefix_shared_block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor, position_ids: torch.Tensor,
                             window: int | None = None):
    """The BlockMask of the packed layout (the dense mask's rule, prefix_shared_mask): causal within a
    pair's segment, a rejected answer never sees the chosen one, and with a window only keys fewer than `window`
    positions back. Padding (segment -1) attends to nothing: FlexAttention gives such a row zeros, and skips its
    blocks. Compiled on CUDA (create_block_mask's own default), evaluated eagerly elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    leak = bool(seams.get("packed_mask_leak"))  # a test plants a mask that lets the rejected answer see the chosen one

    def keep(batch, head, query, key):
        allowed = ((segment_ids[batch, query] == segment_ids[batch, key]) & (segment_ids[batch, query] >= 0)
                   & (key <= query))
        if not leak:
            allowed = allowed & ~((branch_ids[batch, query] == REJECTED) & (branch_ids[batch, key] == CHOSEN))
        if window is not None:
            allowed = allowed & (position_ids[batch, query] - position_ids[batch, key] < window)
        return allowed

    rows, width = segment_ids.shape
    return create_block_mask(keep, B=rows, H=None, Q_LEN=width, KV_LEN=width, device=segment_ids.device,
                             BLOCK_SIZE=BLOCK, _compile=segment_ids.device.type == "cuda")


def prefix_shared_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor, position_ids: torch.Tensor,
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


def attention_masks(module, batch: dict, kind: str):
    """The `attention_mask` `module`'s forward takes for a packed, prefix-shared batch (its packed tensors, on the
    model's device): FlexAttention's BlockMask where `kind` is FLEX, else the dense boolean mask (additive for eager,
    which adds the mask to the scores); one per layer kind (a dict keyed by kind, as the forward accepts), or one for
    every layer (layer_windows)."""
    eager = str(attention_implementation(module.config)) == "eager"  # eager adds the mask to the scores
    dtype = next(module.parameters()).dtype
    masks = {}
    for layer_kind, window in layer_windows(module.config).items():
        if kind == FLEX:
            masks[layer_kind] = prefix_shared_block_mask(batch["packed_segment_ids"], batch["packed_branch_ids"],
                                                         batch["packed_position_ids"], window)
            continue
        mask = prefix_shared_mask(batch["packed_segment_ids"], batch["packed_branch_ids"],
                                  batch["packed_position_ids"], window)
        if eager:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[layer_kind] = mask
    return masks.pop(ONE_MASK) if ONE_MASK in masks else masks


def computed_block_share(block_mask) -> float:
    """The share of the row's width² / BLOCK² blocks FlexAttention computes (a dense mask computes them all)."""
    kept = block_mask.kv_num_blocks.sum() + (block_mask.full_kv_num_blocks.sum()
                                            if block_mask.full_kv_num_blocks is not None else 0)
    rows, heads = block_mask.kv_num_blocks.shape[:2]
    query_length, key_length = block_mask.shape[-2:]
    query_block, key_block = block_mask.BLOCK_SIZE
    return float(kept) / (rows * heads * -(-query_length // query_block) * -(-key_length // key_block))


@contextlib.contextmanager
def flex_implementation(model):
    """`model` attends through FlexAttention while the block runs: transformers looks up a layer's attention function
    from the config's attention implementation at every call (src/private_api.py)."""
    before = attention_implementation(model.config)
    set_attention_implementation(model.config, FLEX_ATTENTION)
    try:
        yield
    finally:
        set_attention_implementation(model.config, before)


class CompileCounter:
    """torch.compile's compilations in this process from the first flex forward on (FlexAttention's kernel, the
    BlockMask's builder, a recompile on a new width or a train/eval switch), and the seconds they took: TorchDynamo's
    own start and end callbacks."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._started: float | None = None
        self._registered = False

    def watch(self) -> None:
        if self._registered:
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._registered = True

    def _start(self, _args=None) -> None:
        self.count += 1
        self._started = time.perf_counter()

    def _end(self, _args=None) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def as_dict(self) -> dict:
        return {"count": self.count, "seconds": round(self.seconds, 2)}
