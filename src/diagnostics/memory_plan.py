"""Memory per device for each way to train a model, whether it fits, and the largest per-device batch that does.

Model state per device (P parameters, N devices, T LoRA parameters), mixed precision:
  full fine-tune (DDP)  18 B/param: fp32 weights 4 + 16-bit copy 2 + fp32 grads 4 + Adam moments 8 (16 in fp32)
  LoRA                  frozen 16-bit base 2P + adapters 16T (fp32 weight, grad and two Adam moments)
  QLoRA                 NF4 linear layers 0.55 B/param, embeddings and output layer 16-bit, adapters 16T
  ZeRO-2                2P + 18P/N
  ZeRO-3                18P/N + the largest layer gathered in 16-bit with its 16-bit gradient (4 B/param)
DPO reference model: none with LoRA/QLoRA (adapters disabled) or precomputed reference log-probs; otherwise a
16-bit copy per device, sharded only under ZeRO-3. SFT has no reference.

Activations are an estimate, per token per decoder layer of a Llama-style block with fused (SDPA/flash)
attention, which stores no seq x seq matrix: in 16-bit, 12*hidden + 4*kv + 8*intermediate bytes (norm inputs,
Q/K/V, attention output, MLP gate/up/product). Gradient checkpointing keeps only each layer's input (2*hidden
bytes) plus one layer recomputed in backward. The logits add vocab * (2 + 8) bytes per token (16-bit logits, fp32
upcast and fp32 log-probs). LoRA adds, per token of each adapted linear layer, its rank r of adapter output and,
with lora_dropout > 0 (PEFT's default 0.05), the dropped-out copy of its input the adapter's A matrix needs for its
gradient (16-bit, plus a 1-byte dropout mask): 3 * d_in bytes. Measured with torch's saved-tensor hooks on a
Llama block under bf16 autocast: 3.3 * d_in bytes with dropout, about nothing beyond full fine-tuning's without; on an
H200, a 12 x 1024 Llama at 8 pairs of 512 tokens peaked 1.40x the plan that left this term out. DPO runs chosen and rejected: twice the tokens. A reward model (stage reward) runs both
too, but scores each sequence with a one-number head: no vocabulary logits. The reference forward runs without
gradients and its activations are freed at once, so it is left out.

Tokens per sequence: --max_length, which every batch may reach; or, when the run's prepared data is in the cache
(src/diagnostics/data_lengths.py), its audited longest sequence as trained (reasoning included), cut to --max_length.

Margin: 10% for allocator fragmentation, plus 1 GiB per process for the CUDA context and cuBLAS/NCCL workspaces
(on CPU, for the Python/torch runtime).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from src.objectives import objective

from .data_lengths import DataLengths
from .inputs import ALL_LINEAR, TrainingSetup
from .model_shape import ModelShape
from .time_plan import StepTime

GIB = 1024**3
RUNTIME_OVERHEAD_BYTES = GIB
FRAGMENTATION_MARGIN = 0.10
MIXED_PRECISION_BYTES_PER_PARAM = 18
FP32_BYTES_PER_PARAM = 16
NF4_BYTES_PER_PARAM = 0.55
ADAPTER_BYTES_PER_PARAM = 16
LOGITS_FP32_BYTES = 8  # the fp32 upcast and the fp32 log-probs of each logit
METHODS = ("full", "lora", "qlora", "zero2", "zero3")
METHOD_LABELS = {"full": "full (DDP)", "lora": "LoRA", "qlora": "QLoRA", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


@dataclass
class MethodEstimate:
    method: str
    label: str
    model_state_bytes: int
    reference_bytes: int
    # A reference-free objective: the reference copy a preference objective (DPO) would keep with this method
    reference_saved_bytes: int
    activation_bytes: int  # at the configured per-device batch
    margin_bytes: int
    total_bytes: int
    runs_here: bool  # QLoRA needs CUDA GPUs
    fits: bool
    max_per_device_batch: int  # 0 when even the model state does not fit
    chosen: bool = False  # the method of the user's recipe
    note: str | None = None  # why it cannot run here, or a caveat


@dataclass
class MemoryPlan:
    model: ModelShape
    stage: str
    precision: str  # "bf16", "fp16" or "fp32"
    num_devices: int
    device_kind: str  # "gpu" or "cpu"
    budget_bytes: int
    budget_source: str
    per_device_batch_size: int
    batch_source: str
    max_length: int
    gradient_checkpointing: bool
    lora_r: int
    lora_target_modules: list[str] | str
    lora_trainable_params: int
    activation_bytes_per_sample: int
    estimates: list[MethodEstimate] = field(default_factory=list)
    # Tokens per sequence the activations are counted at, and why: --max_length, or the data audit's longest
    # sequence within it (src/diagnostics/data_lengths.py)
    sequence_tokens: int = 0
    data_lengths: DataLengths | None = None
    # The chosen method (else LoRA) at the --max_length the data audit suggests, when that differs from max_length
    at_suggested_max_length: MethodEstimate | None = None
    generation_bytes_per_sample: int = 0  # the KV cache of sampling, per sequence (GRPO); 0 for the others
    generation_tokens: int = 0
    step_time: StepTime | None = None  # a sampling objective's step time on the launch GPU (time_plan.py)

    def chosen(self) -> MethodEstimate | None:
        return next((estimate for estimate in self.estimates if estimate.chosen), None)


def _adapted(name: str, targets: list[str] | str) -> bool:
    # PEFT's matching: a module is adapted when its name equals a target or ends with "." + target.
    if targets == ALL_LINEAR:
        return True
    return any(name == target or name.endswith("." + target) for target in targets)


def lora_trainable_params(shape: ModelShape, targets: list[str] | str, rank: int) -> int:
    """Sum over the adapted linear layers of r * (d_in + d_out): the A and B matrices."""
    return sum(rank * (d_in + d_out) for name, d_in, d_out in shape.linear_layers if _adapted(name, targets))


def _quantized_params(shape: ModelShape) -> int:
    # bitsandbytes quantizes the linear layers; embeddings, norms and the output layer stay 16-bit.
    return min(shape.total_params, sum(d_in * d_out for _name, d_in, d_out in shape.linear_layers))


def model_state_bytes(method: str, shape: ModelShape, trainable: int, num_devices: int, weight_bytes: int) -> int:
    params = shape.total_params
    full_bytes = MIXED_PRECISION_BYTES_PER_PARAM if weight_bytes == 2 else FP32_BYTES_PER_PARAM
    if method == "full":
        return params * full_bytes
    if method == "lora":
        return params * weight_bytes + trainable * ADAPTER_BYTES_PER_PARAM
    if method == "qlora":
        quantized = _quantized_params(shape)
        return int(quantized * NF4_BYTES_PER_PARAM) + (params - quantized) * 2 + trainable * ADAPTER_BYTES_PER_PARAM
    if method == "zero2":
        return 2 * params + params * full_bytes // num_devices
    if method == "zero3":
        return params * full_bytes // num_devices + 4 * shape.largest_layer_params
    raise ValueError(f"unknown method {method}")


def reference_bytes(method: str, setup: TrainingSetup, shape: ModelShape, num_devices: int, weight_bytes: int,
                    kept: bool | None = None) -> int:
    """A reference model's copy per device, for an objective that keeps one (DPO, KTO; `kept` asks as if it did or
    did not): none with adapters (the base with adapters off) or cached log-probs."""
    if kept is None:
        kept = objective(setup.stage).training.needs_reference if setup.reference_kept is None else setup.reference_kept
    if not kept or method in ("lora", "qlora") or setup.precompute_ref_log_probs:
        return 0
    if method == "zero3":
        return shape.total_params * weight_bytes // num_devices
    return shape.total_params * weight_bytes


def activation_bytes_per_sample(shape: ModelShape, setup: TrainingSetup, activation_bytes: int) -> int:
    """Activations kept for backward for one sequence (one chosen+rejected pair for DPO and reward; one completion for
    KTO, whose KL sequence runs without gradients before the step: src/trainers/kto.py); see the module doc."""
    tokens = setup.sequence_tokens * objective(setup.stage).memory.sequences_with_grad
    scale = activation_bytes / 2  # the block formula is written for 16-bit activations
    block = scale * (12 * shape.hidden_size + 4 * shape.kv_size + 8 * shape.intermediate_size)
    if setup.gradient_checkpointing:
        layers = shape.num_layers * activation_bytes * shape.hidden_size + block
    else:
        layers = shape.num_layers * block
    logits = 0 if not objective(setup.stage).memory.scores_tokens else shape.vocab_size * (activation_bytes + LOGITS_FP32_BYTES)
    return int(tokens * (layers + logits))


def generation_bytes_per_sample(shape: ModelShape, setup: TrainingSetup, weight_bytes: int) -> int:
    """The KV cache of an objective that samples as it trains (GRPO), per sequence of the training micro-batch: TRL
    samples `generation_steps` micro-batches at once, each sequence keeping keys and values for every layer and token,
    with the last position's logits in fp32. Sampling runs before the step (no gradients), so the peak is the larger of
    this and the step's activations."""
    if not setup.generation_tokens:
        return 0
    cache = setup.generation_tokens * shape.num_layers * 2 * shape.kv_size * weight_bytes
    return int((setup.generation_steps or 1) * (cache + shape.vocab_size * LOGITS_FP32_BYTES))


def adapter_activation_bytes_per_sample(shape: ModelShape, setup: TrainingSetup, activation_bytes: int) -> int:
    """What LoRA adds to one sample's activations (see the module doc): each adapted linear layer keeps its rank-r
    adapter output and, with dropout on, its dropped-out input and the dropout mask. Gradient checkpointing keeps one
    layer's worth."""
    tokens = setup.sequence_tokens * objective(setup.stage).memory.sequences_with_grad
    adapted = [(d_in, d_out) for name, d_in, d_out in shape.linear_layers if _adapted(name, setup.lora_target_modules)]
    dropout_copy = activation_bytes + 1 if setup.lora_dropout > 0 else 0
    per_token = sum(d_in * dropout_copy + setup.lora_r * activation_bytes for d_in, _d_out in adapted)
    if setup.gradient_checkpointing:
        per_token //= max(1, shape.num_layers)
    return int(tokens * per_token)


def with_margin(bytes_needed: float) -> int:
    return int(bytes_needed * (1 + FRAGMENTATION_MARGIN) + RUNTIME_OVERHEAD_BYTES)


def largest_batch(static_bytes: int, per_sample_bytes: int, budget_bytes: int) -> int:
    """The largest batch whose total with margin fits the budget, 0 when none does."""
    if per_sample_bytes <= 0:
        return 0
    room = (budget_bytes - RUNTIME_OVERHEAD_BYTES) / (1 + FRAGMENTATION_MARGIN) - static_bytes
    batch = max(0, int(room // per_sample_bytes))
    # The division above rounds; settle the last sample against with_margin itself so the two always agree.
    while with_margin(static_bytes + (batch + 1) * per_sample_bytes) <= budget_bytes:
        batch += 1
    while batch and with_margin(static_bytes + batch * per_sample_bytes) > budget_bytes:
        batch -= 1
    return batch


def _note(method: str, device_kind: str, num_devices: int, deepspeed_installed: bool) -> str | None:
    """Why a method cannot run here, or a caveat about it."""
    if method == "qlora" and device_kind == "cpu":
        return "needs CUDA GPUs"
    if method in ("zero2", "zero3") and not deepspeed_installed:
        return "needs deepspeed (not installed)"
    if method in ("zero2", "zero3") and num_devices == 1:
        return "1 device: nothing to shard"
    return None


def plan_memory(
    shape: ModelShape,
    setup: TrainingSetup,
    *,
    num_devices: int,
    device_kind: str,
    budget_bytes: int,
    budget_source: str,
    deepspeed_installed: bool,
) -> MemoryPlan:
    precision = setup.precision  # resolved by the launcher's plan (src/config.py resolve_precision)
    weight_bytes = 4 if precision == "fp32" else 2
    batch, batch_source = setup.per_device_batch_size, setup.batch_source
    trainable = lora_trainable_params(shape, setup.lora_target_modules, setup.lora_r)
    per_sample = activation_bytes_per_sample(shape, setup, weight_bytes)
    plan = MemoryPlan(
        model=shape,
        stage=setup.stage,
        precision=precision,
        num_devices=num_devices,
        device_kind=device_kind,
        budget_bytes=budget_bytes,
        budget_source=budget_source,
        per_device_batch_size=batch,
        batch_source=batch_source,
        max_length=setup.max_length,
        gradient_checkpointing=setup.gradient_checkpointing,
        lora_r=setup.lora_r,
        lora_target_modules=setup.lora_target_modules,
        lora_trainable_params=trainable,
        activation_bytes_per_sample=per_sample,
        sequence_tokens=setup.sequence_tokens,
        data_lengths=setup.data_lengths,
        generation_bytes_per_sample=generation_bytes_per_sample(shape, setup, weight_bytes),
        generation_tokens=setup.generation_tokens,
    )
    adapter_per_sample = adapter_activation_bytes_per_sample(shape, setup, weight_bytes)
    for method in METHODS:
        adapters = method in ("lora", "qlora")
        state = model_state_bytes(method, shape, trainable if adapters else 0, num_devices, weight_bytes)
        reference = reference_bytes(method, setup, shape, num_devices, weight_bytes)
        # What a reference-free objective saves: the copy DPO keeps when it does not cache reference log-probs
        saved = reference_bytes(method, dataclasses.replace(setup, precompute_ref_log_probs=False), shape, num_devices,
                                weight_bytes, kept=True) if objective(setup.stage).memory.reference_free else 0
        # sampling (its KV cache) and training (its activations) come one after the other: the larger is the peak
        method_per_sample = max(per_sample + (adapter_per_sample if adapters else 0), plan.generation_bytes_per_sample)
        activations = batch * method_per_sample
        total = with_margin(state + reference + activations)
        # DeepSpeed runs on CPU processes too (src/engines.py); bitsandbytes' 4-bit training needs CUDA
        runs_here = not (device_kind == "cpu" and method == "qlora")
        plan.estimates.append(
            MethodEstimate(
                method=method,
                label=METHOD_LABELS[method] + (f" r={setup.lora_r}" if method in ("lora", "qlora") else ""),
                model_state_bytes=state,
                reference_bytes=reference,
                reference_saved_bytes=saved,
                activation_bytes=activations,
                margin_bytes=total - (state + reference + activations),
                total_bytes=total,
                runs_here=runs_here,
                fits=runs_here and total <= budget_bytes,
                max_per_device_batch=largest_batch(state + reference, method_per_sample, budget_bytes),
                chosen=setup.method_chosen and method == setup.method,
                note=_note(method, device_kind, num_devices, deepspeed_installed),
            )
        )
    suggested = setup.data_lengths.suggested_max_length if setup.data_lengths else None
    if suggested and suggested != setup.max_length and not setup.data_lengths.packed:
        at_suggested = plan_memory(shape, dataclasses.replace(setup, max_length=suggested, data_lengths=None),
                                   num_devices=num_devices, device_kind=device_kind, budget_bytes=budget_bytes,
                                   budget_source=budget_source, deepspeed_installed=deepspeed_installed)
        plan.at_suggested_max_length = at_suggested.chosen() or next(
            estimate for estimate in at_suggested.estimates if estimate.method == "lora")
    return plan
