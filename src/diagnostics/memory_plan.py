"""Memory per device for each way to train a model, whether it fits, and the largest per-device batch that does.

Model state per device (P parameters, N devices, T LoRA parameters, h the hidden size), as weights + gradients +
optimizer states (`ENGINE_STATE`), each part at its largest of two moments: after the backward and as the optimizer
steps. Measured per rank on 2 and 4 CPU processes (tests/test_memory_plan_engines.py): every engine in fp32, DeepSpeed's
stages also in bf16; DDP's and FSDP2's mixed precision is their fp32 state (see below) plus autocast's 16-bit copy:
                        fp32                                 mixed precision (bf16/fp16)
  full fine-tune (DDP)  4P + 8P + 8P = 20P                   6P + 8P + 8P = 22P
  ZeRO-1, ZeRO-2        4P + 4P/N + 12P/N                    2P + 4P/N + 12P/N
  ZeRO-3                4P/N + 8P/N + 12P/N                  2P/N + 6P/N + 12P/N
  FSDP2                 4P/N + 4P/N + 8P/N                   the same: the toolkit's shards stay fp32
  LoRA                  frozen 16-bit base 2P + adapters 16T (fp32 weight, grad and two Adam moments)
  QLoRA                 NF4 linear layers 0.55 B/param, embeddings and output layer 16-bit, adapters 16T
DDP's gradients are counted twice: each parameter's and DDP's all-reduce buckets, a copy of them (torch's default
`gradient_as_bucket_view=False`). The toolkit keeps fp32 weights under mixed precision (autocast adds the 16-bit copy
it computes with), so DDP's and FSDP's state is the fp32 one. DeepSpeed keeps an fp32 copy of its share of the weights
to step even in fp32 (the optimizer's 12P/N: that copy and Adam's two moments) and steps on an fp32 copy of its
gradient partition (ZeRO-3 holds it next to the partition it reduced into: 8P/N in fp32, 2 + 4 in bf16); ZeRO-1 holds
what ZeRO-2 does (DeepSpeed's stage 1 keeps only its partition of the reduced gradients as well); each DeepSpeed stage
adds its reduce bucket, h^2 gradient elements (the size accelerate gives "auto", src/engines.py). ZeRO-1/2 keep a
parameter's gradient whole where the parameter crosses the edge of a rank's partition: up to two parameters more on a
rank. ZeRO-3 and FSDP gather the largest layer whole with its gradient while it runs (2 x its weight bytes per
parameter, the working set).
DPO reference model: none with LoRA/QLoRA (adapters disabled) or precomputed reference log-probs; otherwise a
16-bit copy per device, sharded only under ZeRO-3. SFT has no reference.

Activations are an estimate, per token per decoder layer of a Llama-style block with fused (SDPA/flash)
attention, which stores no seq x seq matrix: in 16-bit, 12*hidden + 4*kv + 8*intermediate bytes (norm inputs,
Q/K/V, attention output, MLP gate/up/product). Gradient checkpointing keeps only each layer's input (2*hidden
bytes) plus one layer recomputed in backward. The logits add vocab * (2 + 8) bytes per token (16-bit logits, fp32
upcast and fp32 log-probs). LoRA adds, per token of each adapted linear layer, its rank r of adapter output and,
with lora_dropout > 0 (TRL's default 0.05; the toolkit's is 0), the dropped-out copy of its input the adapter's A matrix needs for its
gradient (16-bit, plus a 1-byte dropout mask): 3 * d_in bytes. Measured with torch's saved-tensor hooks on a
Llama block under bf16 autocast: 3.3 * d_in bytes with dropout, about nothing beyond full fine-tuning's without; on an
H200, a 12 x 1024 Llama at 8 pairs of 512 tokens peaked 1.40x the plan that left this term out. DPO runs chosen and rejected: twice the tokens. A reward model (stage reward) runs both
too, but scores each sequence with a one-number head: no vocabulary logits. The reference forward runs without
gradients and its activations are freed at once, so it is left out.

Tokens per sequence: --max_length, which every batch may reach; or, when the run's prepared data is in the cache
(src/diagnostics/data_lengths.py), its audited longest sequence as trained (reasoning included), cut to --max_length.

Margin: 10% for allocator fragmentation, plus 1 GiB per process for the CUDA context and cuBLAS/NCCL workspaces
(on CPU, for the Python/torch runtime).

Host memory per rank while the model loads (`host_load_bytes`, the peak above what the process held before; a 16-bit
checkpoint, as the Hub ships them): loading whole (DDP, ZeRO-1/2, LoRA) builds the fp32 weights on the host and maps
the checkpoint's pages as it reads them, 4P + 2P; QLoRA places each tensor on its GPU as it reads it, one tensor; under
ZeRO-3 and FSDP2 each rank reads only its share of each tensor (src/sharded_weights.py), one tensor's share of the
checkpoint at a time, 2 T/N for the largest tensor T, and on CPU processes, whose device is the host, it also holds
its share of the weights, 4P/N, and under ZeRO-3 the largest tensor built whole once (4T) before DeepSpeed partitions
it. Measured by bench/load_memory.py (docs/configuration.md: within the plan at two sizes and 2 and 4 processes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from src.config_error import ConfigError
from src.engines import FSDP, Engine, check_engine
from src.objectives import objective

from .data_lengths import DataLengths
from .inputs import ALL_LINEAR, TrainingSetup
from .model_shape import ModelShape
from .time_plan import StepTime

GIB = 1024**3
RUNTIME_OVERHEAD_BYTES = GIB
FRAGMENTATION_MARGIN = 0.10
NF4_BYTES_PER_PARAM = 0.55
ADAPTER_BYTES_PER_PARAM = 16
LOGITS_FP32_BYTES = 8  # the fp32 upcast and the fp32 log-probs of each logit
CHECKPOINT_BYTES = 2  # a checkpoint's bytes per parameter as the Hub ships them (bf16)
METHODS = ("full", "lora", "qlora", "zero1", "zero2", "zero3", "fsdp")
METHOD_LABELS = {"full": "full (DDP)", "lora": "LoRA", "qlora": "QLoRA", "zero1": "ZeRO-1", "zero2": "ZeRO-2",
                 "zero3": "ZeRO-3", "fsdp": "FSDP2"}
SHARDED_ENGINES = ("zero1", "zero2", "zero3", "fsdp")
DEEPSPEED_METHODS = ("zero1", "zero2", "zero3")
# Per engine and precision ("fp32", or "mixed" for bf16/fp16), what a rank holds of weights, gradients and optimizer
# states: (bytes per parameter, divided over the N processes or not). See the module doc.
ENGINE_STATE = {
    "full": {"fp32": ((4, False), (8, False), (8, False)), "mixed": ((6, False), (8, False), (8, False))},
    "zero1": {"fp32": ((4, False), (4, True), (12, True)), "mixed": ((2, False), (4, True), (12, True))},
    "zero2": {"fp32": ((4, False), (4, True), (12, True)), "mixed": ((2, False), (4, True), (12, True))},
    "zero3": {"fp32": ((4, True), (8, True), (12, True)), "mixed": ((2, True), (6, True), (12, True))},
    "fsdp": {"fp32": ((4, True), (4, True), (8, True)), "mixed": ((4, True), (4, True), (8, True))},
}


@dataclass(frozen=True)
class EngineState:
    """What one rank holds of the model's state under an engine, in bytes."""

    weights: int
    gradients: int
    optimizer: int
    working_set: int = 0  # ZeRO-3 / FSDP: the largest layer gathered whole with its gradient while it runs

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.working_set


def engine_state(method: str, shape: ModelShape, num_devices: int, weight_bytes: int) -> EngineState:
    """Weights, gradients and optimizer states per rank for full fine-tuning under DDP, ZeRO-1/2/3 or FSDP2
    (`ENGINE_STATE`), with DeepSpeed's reduce bucket and the gathered working set."""
    params = shape.total_params
    parts = [bytes_per_param * params // (num_devices if sharded else 1)
             for bytes_per_param, sharded in ENGINE_STATE[method]["fp32" if weight_bytes == 4 else "mixed"]]
    if method in DEEPSPEED_METHODS:
        parts[1] += shape.hidden_size ** 2 * weight_bytes  # the reduce bucket, h^2 elements of gradient
    gathered = 2 * weight_bytes * shape.largest_layer_params if method in ("zero3", "fsdp") else 0
    return EngineState(*parts, working_set=gathered)


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
    # Full fine-tuning under an engine: its model state split into weights, gradients and optimizer states per rank
    engine_state: EngineState | None = None
    host_load_bytes: int = 0  # host memory per rank while the model loads (see the module doc)


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
    if method in ENGINE_STATE:
        return engine_state(method, shape, num_devices, weight_bytes).total
    if method == "lora":
        return params * weight_bytes + trainable * ADAPTER_BYTES_PER_PARAM
    if method == "qlora":
        quantized = _quantized_params(shape)
        return int(quantized * NF4_BYTES_PER_PARAM) + (params - quantized) * 2 + trainable * ADAPTER_BYTES_PER_PARAM
    raise ValueError(f"unknown method {method}")


def reference_bytes(method: str, setup: TrainingSetup, shape: ModelShape, num_devices: int, weight_bytes: int,
                    kept: bool | None = None) -> int:
    """A reference model's copy per device, for an objective that keeps one (DPO, KTO; `kept` asks as if it did or
    did not): none with adapters (the base with adapters off) or cached log-probs."""
    if kept is None:
        kept = objective(setup.stage).training.needs_reference if setup.reference_kept is None else setup.reference_kept
    if not kept or method in ("lora", "qlora") or setup.precompute_ref_log_probs:
        return 0
    if method in ("zero3", "fsdp"):  # the reference sharded like the policy (TRL prepares it with the engine)
        return shape.total_params * weight_bytes // num_devices
    return shape.total_params * weight_bytes


def largest_tensor_params(shape: ModelShape) -> int:
    """The largest single weight: the embeddings (or untied output layer), or the widest linear layer."""
    return max([shape.vocab_size * shape.hidden_size] + [d_in * d_out for _name, d_in, d_out in shape.linear_layers])


def host_load_bytes(method: str, shape: ModelShape, num_devices: int, device_kind: str) -> int:
    """Host memory one rank holds at the peak of the model's load (see the module doc)."""
    params, largest = shape.total_params, largest_tensor_params(shape)
    if method == "qlora":
        return largest * CHECKPOINT_BYTES
    if method not in ("zero3", "fsdp"):
        return params * (4 + CHECKPOINT_BYTES)
    read = largest * CHECKPOINT_BYTES // num_devices
    if device_kind == "gpu":
        return read
    return params * 4 // num_devices + read + (largest * 4 if method == "zero3" else 0)


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


def _runs_here(method: str, device_kind: str) -> bool:
    """bitsandbytes' 4-bit training needs CUDA; DeepSpeed runs on CPU processes too, FSDP where src/engines.py lets it."""
    if method == "qlora":
        return device_kind != "cpu"
    if method == "fsdp":
        try:
            check_engine(Engine(FSDP), "cuda" if device_kind == "gpu" else "cpu")
        except ConfigError:
            return False
    return True


def _note(method: str, device_kind: str, num_devices: int, deepspeed_installed: bool) -> str | None:
    """Why a method cannot run here, or a caveat about it."""
    if not _runs_here(method, device_kind):
        return "needs CUDA GPUs"
    if method in DEEPSPEED_METHODS and not deepspeed_installed:
        return "needs deepspeed (not installed)"
    if method in SHARDED_ENGINES and num_devices == 1:
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
    plan.estimates += [_method_estimate(method, plan, setup, weight_bytes, adapter_per_sample, deepspeed_installed)
                       for method in METHODS]
    suggested = setup.data_lengths.suggested_max_length if setup.data_lengths else None
    if suggested and suggested != setup.max_length and not setup.data_lengths.packed:
        at_suggested = plan_memory(shape, dataclasses.replace(setup, max_length=suggested, data_lengths=None),
                                   num_devices=num_devices, device_kind=device_kind, budget_bytes=budget_bytes,
                                   budget_source=budget_source, deepspeed_installed=deepspeed_installed)
        plan.at_suggested_max_length = at_suggested.chosen() or next(
            estimate for estimate in at_suggested.estimates if estimate.method == "lora")
    return plan


def _method_estimate(method: str, plan: MemoryPlan, setup: TrainingSetup, weight_bytes: int, adapter_per_sample: int,
                     deepspeed_installed: bool) -> MethodEstimate:
    """One method's row of the plan (full fine-tune, an engine, LoRA, QLoRA): its model state, reference, activations
    and whether it fits the budget."""
    shape, num_devices, device_kind, budget_bytes = plan.model, plan.num_devices, plan.device_kind, plan.budget_bytes
    adapters = method in ("lora", "qlora")
    state = model_state_bytes(method, shape, plan.lora_trainable_params if adapters else 0, num_devices, weight_bytes)
    reference = reference_bytes(method, setup, shape, num_devices, weight_bytes)
    # What a reference-free objective saves: the copy DPO keeps when it does not cache reference log-probs
    saved = reference_bytes(method, dataclasses.replace(setup, precompute_ref_log_probs=False), shape, num_devices,
                            weight_bytes, kept=True) if objective(setup.stage).memory.reference_free else 0
    # sampling (its KV cache) and training (its activations) come one after the other: the larger is the peak
    method_per_sample = max(plan.activation_bytes_per_sample + (adapter_per_sample if adapters else 0),
                            plan.generation_bytes_per_sample)
    activations = plan.per_device_batch_size * method_per_sample
    total = with_margin(state + reference + activations)
    runs_here = _runs_here(method, device_kind)
    return MethodEstimate(
        method=method,
        label=METHOD_LABELS[method] + (f" r={setup.lora_r}" if adapters else ""),
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
        engine_state=engine_state(method, shape, num_devices, weight_bytes) if method in ENGINE_STATE else None,
        host_load_bytes=host_load_bytes(method, shape, num_devices, device_kind),
    )
