"""The packed forward inside TRL's loss call: TRL's fused LM-head forward wrapped once per module, redirected to the
packed layout (src/packed_layout.py) while TRL's loss or reference code runs, checked once against the padded forward,
and the tokens counted both ways.

This module owns the toolkit's coupling to TRL 1.16's DPOTrainer internals for that forward, so a TRL upgrade that
changes them is this file's work (with the batch layout of src/packed_layout.py):
- TRL's batch layout (`DataCollatorForPreference`: rows `[prompt+chosen; prompt+rejected]`, right-padded, with
  `completion_mask`), which `DPOTrainer._compute_loss` / `compute_ref_log_probs` read;
- TRL's fused LM head (`add_fused_lm_head`: `model(..., labels=..., fused_lm_head=True)` → `FusedCausalLMOutput` with
  per-token `log_probs`, `entropy`, `mean_logits`, `is_top1`, `log_sum_sq_probs`, `label_mask`, each `(rows, len-1)`),
  including its `shift_labels=` argument (labels already aligned with the positions that predict them), and that it
  calls the model's `base_model` (the backbone) before projecting its `last_hidden_state`: a hook there hands the
  head only the positions whose log-prob is read (`_hidden_states_at`), so the LM head never runs over the prompt.

How: during TRL's loss / reference computation the model's fused forward is redirected: it runs the packed tokens
instead and scatters the per-token outputs back into the padded `(2 * pairs, len - 1)` layout TRL expects. Only those
per-token scalars are ever padded, never a token's computation. The eval tape (src/dpo_eval.py, `TAPE`) records and
replays the same wrapper's outputs.

Never silently wrong: the first packed forward of a run is checked against the padded one (same model, same batch, no
grad); a mismatch, or an error, on any rank turns packing off for the run with one warning line naming the difference
and the likely cause (`likely_cause`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch

from src.distributed import any_rank
from src.packed_attention import DENSE, FLEX, AttentionPolicy, attention_masks, flex_implementation, layer_windows
from src.packed_layout import PACKED_KEYS, padded_counts
from src.vision import PACKED_PREFIX

PASSES = ("policy", "kl", "reference")          # the forwards counted apart (PackedDPOForward.counts)
PACKED_FORMAT = 2        # in the reference cache key: bump when the layout or masks change (2: per-layer windows)
FP32_TOLERANCE = 1e-4    # per-token log-prob, absolute + relative: fp32 packed vs padded differ by ~1e-6
HALF_TOLERANCE = 1e-1    # bf16 / fp16: rounding differs with the shapes; a leak through the mask shifts far more

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("packed_dpo_plan", default=None)
TAPE: contextvars.ContextVar = contextvars.ContextVar("fused_forward_tape", default=None)  # src/dpo_eval.py


def likely_cause(config) -> str:
    """What most often makes a model's packed log-probs differ, for the first-batch check's warning."""
    windows = {kind: window for kind, window in layer_windows(config).items() if window}
    if windows:
        return f"its attention window ({', '.join(f'{k} {w}' for k, w in windows.items())} positions) is applied " \
               "differently from transformers' masks"
    return "the model or attention implementation does not honour the packed mask or positions"


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
        packed = {key: value for key, value in inputs.items() if key in PACKED_KEYS or key.startswith(PACKED_PREFIX)}
        inputs = {key: value for key, value in inputs.items() if key not in packed}
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
        # A vision model's images: each prompt's once, in the packed order (src/vision.py ImageCollator), in place of
        # TRL's batch's (every prompt's repeated for its chosen and its rejected row).
        kwargs.update({key[len(PACKED_PREFIX):]: value for key, value in batch.items() if key.startswith(PACKED_PREFIX)})
        attend = contextlib.nullcontext()
        if self.layout == "prefix_shared":
            width = batch["packed_input_ids"].shape[1]
            kind = self.attention.kind_for(width)
            line = self.attention.note(kind, width)
            if line and _is_main_process():
                print(line, flush=True)
            kwargs["attention_mask"] = attention_masks(module, batch, kind)
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
        # Each value's (row, column) in TRL's padded layout. Scattered straight into 2-D tensors, not into a flat one
        # then viewed: FSDP2 hooks every output of the model for its backward, and warns (at every step) that a view
        # changed in place would lose the hook; fresh tensors give it nothing to warn about.
        at = (target.div(length - 1, rounding_mode="floor"), target.remainder(length - 1))

        def unpack(values):
            if values is None:
                return None
            return values.new_zeros(rows, length - 1).index_put(at, values.reshape(-1))

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
