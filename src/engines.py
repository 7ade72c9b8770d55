"""The engine that spreads a job over its processes: plain data parallelism (DDP), DeepSpeed ZeRO stage 1, 2 or 3, or
FSDP2. This module owns which engine a launch asked for (`requested`: accelerate's launch environment, or the
launcher's STRATEGY in its preflight), the refusals of what cannot work with it (`check_engine`, before any process
group), what the process group and TRL's config need so that the engine runs on CPU processes too (`accelerate_cpu`;
FSDP2: `adopt_fsdp_on_cpu`, `trainer_accelerator_config`), what training_info.json records of the engine that
actually ran (`engine_record`, read from the trainer's accelerator, never assumed), DeepSpeed's buffers sized by the
model (`size_buffers_by_model`), ZeRO-3's weights partitioned as they load (`partitioned_loading`; `load_warning` where
they load whole), what each rank holds of a weight under FSDP2 and ZeRO-3 as the model loads (`loads_sharded`, `share`,
`fsdp2_sharded`, `keep_sharding_from_load`) and answers prompts before training (`generating`), and whole weights or
this rank's shard for code that reads them under ZeRO-3 (`gathered`, `whole_numel`, `whole_value`, `whole_module`)
and FSDP2 (`whole`, `local_shard`).

    STRATEGY=zero3 ./run_distributed.sh 2 --config configs/<recipe>.yaml

Why `accelerate_cpu` exists: accelerate 1.15 runs DeepSpeed only when it is not told to use the CPU; told so (what
TRL's `use_cpu=True` does), it silently trains plain DDP (`MULTI_CPU`) and reports success. Without it, on a machine
without CUDA, DeepSpeed picks its CPU accelerator and trains with gloo on the process group the toolkit started.
FSDP is the other way round: accelerate 1.15 keeps it only on GPU-like devices, so on CPU processes the toolkit marks
accelerate's state FSDP itself (`adopt_fsdp_on_cpu`), and accelerate's own FSDP2 path does the rest.

Light: no torch, no deepspeed (the preflight reads it).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from src.config_error import ConfigError
from src.private_api import hf_deepspeed_config

DEEPSPEED, FSDP, DDP = "deepspeed", "fsdp", "ddp"
# run_distributed.sh's STRATEGY values that shard (configs/accelerate/<STRATEGY>.yaml): the engine and ZeRO stage.
STRATEGIES = {"zero1": (DEEPSPEED, 1), "zero2": (DEEPSPEED, 2), "zero3": (DEEPSPEED, 3), "fsdp": (FSDP, None)}


@dataclass(frozen=True)
class Engine:
    """A sharding engine: DeepSpeed with its ZeRO stage, or FSDP."""

    name: str
    zero_stage: int | None = None

    @property
    def title(self) -> str:
        return f"DeepSpeed ZeRO-{self.zero_stage}" if self.name == DEEPSPEED else "FSDP"

    @property
    def key(self) -> str:
        """run_distributed.sh's STRATEGY for this engine (zero1-3, fsdp)."""
        return f"zero{self.zero_stage}" if self.name == DEEPSPEED else "fsdp"


# What each engine spreads over the processes instead of copying it to each (ZeRO-1 the optimizer states, ZeRO-2 the
# gradients too, ZeRO-3 and FSDP2 the weights too).
SHARDED = {"zero1": "optimizer states", "zero2": "gradients, optimizer states",
           "zero3": "weights, gradients, optimizer states", "fsdp": "weights, gradients, optimizer states"}


def describe(key: str, world_size: int) -> str:
    """The plan's engine row: the engine (`key`: a STRATEGY, or "ddp"), its version, and what it shards over how many
    processes."""
    if key not in SHARDED:
        if world_size == 1:
            return "none: one process, the whole model on it"
        return f"DDP: the whole model on each of {world_size} processes, gradients all-reduced"
    name, library = ("FSDP2", "torch") if key == "fsdp" else (f"DeepSpeed ZeRO-{key[-1]}", "deepspeed")
    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    return f"{name} ({library} {_version(library)}): {SHARDED[key]} over {processes}"


def requested_source(environ: Mapping[str, str] | None = None) -> str:
    """Where the launch's engine was asked for: run_distributed.sh's STRATEGY, or an accelerate launch config."""
    environ = os.environ if environ is None else environ
    if environ.get("STRATEGY") in STRATEGIES or environ.get("STRATEGY") == DDP:
        return f"STRATEGY={environ['STRATEGY']}"
    return "accelerate launch config" if launched(environ) else ""


def _version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def launched(environ: Mapping[str, str] | None = None) -> Engine | None:
    """The sharding engine accelerate launch set up for this process (a config with `distributed_type: DEEPSPEED` or
    `FSDP`: its environment variables); None for plain DDP."""
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
        return Engine(DEEPSPEED, int(stage) if stage.isdigit() else None)
    if environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return Engine(FSDP)
    return None


def requested(environ: Mapping[str, str] | None = None) -> Engine | None:
    """The sharding engine this launch asks for: accelerate launch's in the workers, run_distributed.sh's STRATEGY in
    its preflight (which runs before accelerate launch); None for plain DDP."""
    environ = os.environ if environ is None else environ
    strategy = STRATEGIES.get(environ.get("STRATEGY", ""))
    return launched(environ) or (Engine(*strategy) if strategy else None)


def check_engine(engine: Engine | None, device_kind: str, ddp_comm_hook: str = "none",
                 load_in_4bit: bool = False) -> None:
    """Combinations that cannot work, refused in one line before any process starts."""
    if engine is None:
        return
    if load_in_4bit and (engine.name == FSDP or engine.zero_stage == 3):
        # The toolkit loads a 4-bit base as bitsandbytes stores it by default (uint8 blocks) with a device_map: FSDP
        # shards only float storage, and transformers 5.23 refuses any device_map under ZeRO-3 (integrations/
        # accelerate.py: "DeepSpeed Zero-3 is not compatible with passing a `device_map`").
        raise ConfigError(f"--load_in_4bit (QLoRA) under {engine.title}: the 4-bit base as bitsandbytes stores it "
                          "cannot be sharded; launch QLoRA with plain DDP or STRATEGY=zero2 (each GPU keeps the 4-bit "
                          "base whole, about 0.55 B per parameter), or drop --load_in_4bit for LoRA under it")
    if ddp_comm_hook != "none":
        raise ConfigError(f"--ddp_comm_hook {ddp_comm_hook} compresses DDP's all-reduce, and {engine.title} reduces "
                          "gradients its own way: drop the flag (DeepSpeed: set communication_data_type in its "
                          "config), or launch plain DDP")
    if engine.name == DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"{engine.title} needs DeepSpeed: pip install -r requirements.txt (deepspeed)")


def accelerate_cpu(device_kind: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether accelerate and TRL are told to use the CPU (`use_cpu`): on a machine without CUDA, except under
    DeepSpeed, which accelerate would then silently replace by plain DDP."""
    engine = launched(environ)
    return device_kind == "cpu" and not (engine is not None and engine.name == DEEPSPEED)


def fsdp_on_cpu(device_kind: str, world_size: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this job runs FSDP on CPU processes: an accelerate FSDP launch on a machine without CUDA, on any
    number of processes (one as well, as accelerate keeps FSDP on one GPU: a sharded checkpoint resumed by the
    processes that are left is read by FSDP, which reshards it)."""
    engine = launched(environ)
    return device_kind == "cpu" and engine is not None and engine.name == FSDP


def adopt_fsdp_on_cpu(device_kind: str, world_size: int) -> None:
    """FSDP2 on CPU processes through accelerate's own FSDP path, the one place the toolkit steps in: accelerate 1.15
    chooses FSDP only for GPU-like distributed types (`AcceleratorState.__init__`) and on CPU processes (`MULTI_CPU`,
    gloo) drops the plugin, so each rank would train plain DDP. Here its state is built once with the launch config's
    FSDP plugin and marked FSDP; everything after that choice (`fully_shard` per decoder layer, the optimizer over the
    shards, sharded checkpoints, the full state dict of the final save) is accelerate's, transformers' and torch's,
    and device-agnostic. The Trainer adopts this state (`trainer_accelerator_config`) instead of building its own."""
    if not fsdp_on_cpu(device_kind, world_size):
        return
    from accelerate.state import AcceleratorState, PartialState  # FSDP on CPU only: accelerate is imported by then
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launch config's FSDP_* environment, as Accelerator builds it
    state = AcceleratorState(cpu=True, fsdp_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
    # where accelerate itself keeps the chosen type (the end of AcceleratorState.__init__): each later
    # AcceleratorState() copies the partial state's values over its own
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def trainer_accelerator_config(device_kind: str, world_size: int) -> dict | None:
    """TrainingArguments' `accelerator_config`: under FSDP on CPU processes, keep the state `adopt_fsdp_on_cpu` built
    (TrainingArguments otherwise resets accelerate's state and rebuilds it without FSDP); None: its default."""
    return {"use_configured_state": True} if fsdp_on_cpu(device_kind, world_size) else None


def engine_record(accelerator) -> dict:
    """What training_info.json says of the engine that ran, read from the trainer's accelerator: `engine` (ddp,
    deepspeed, fsdp, or none on one process) and `zero_stage` / `fsdp_version` where they apply."""
    kind = str(accelerator.distributed_type.value)
    if kind == "DEEPSPEED":
        return {"engine": DEEPSPEED, "zero_stage": accelerator.state.deepspeed_plugin.zero_stage}
    if kind == "FSDP":
        return {"engine": FSDP, "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version}
    return {"engine": DDP if accelerator.num_processes > 1 else "none"}


ACCELERATE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


@contextlib.contextmanager
def partitioned_loading(precision: str):
    """A block in which `from_pretrained` partitions the weights across the ranks as it reads them, under a ZeRO-3
    launch whose config keeps `zero3_init_flag` (configs/accelerate/zero3.yaml): transformers loads inside
    `deepspeed.zero.Init` while `is_deepspeed_zero3_enabled()`, which holds while an HfDeepSpeedConfig of the launch
    config lives. TrainingArguments makes one (accelerate's DeepSpeedPlugin from the launch environment, its mixed
    precision set), but the policy loads before the stage's TRL config exists: here the same plugin is built the same
    way and kept alive for the block, then let go, so nothing after (answers before training: no trainer's engine yet)
    sees ZeRO-3 before the trainer does. Yields whether the block partitions; a TRL config alive already (the
    reference loaded beside the trainer) partitions with its own."""
    engine = launched()
    # a stage of None: the launch names a DeepSpeed config file, whose stage accelerate's plugin reads below
    if engine is None or engine.name != DEEPSPEED or engine.zero_stage not in (3, None):
        yield False
        return
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    if is_deepspeed_zero3_enabled():
        yield True
        return
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # from the launch environment, as TrainingArguments builds it
    if not plugin.is_zero3_init_enabled():  # ZeRO-1/2, or ZeRO-3 with zero3_init_flag off
        yield False
        return
    plugin.set_mixed_precision(ACCELERATE_PRECISION[precision])
    plugin.set_deepspeed_weakref()
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del plugin


@contextlib.contextmanager
def loading_whole():
    """A block in which `from_pretrained` loads whole weights on this rank, not inside ZeRO-3's `deepspeed.zero.Init`:
    for a model a rank loads on its own (the reward-model judge, rank 0 after training), whose partitioned load would
    wait in collectives the other ranks never join. Measured before: a ZeRO-3 DPO run with a reward-model judge
    trained its steps, then hung in the judge's load until killed."""
    config = hf_deepspeed_config()
    if config is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(config)


def partitioned(parameters) -> bool:
    """Whether ZeRO-3 partitioned these weights (each rank holds its share in `ds_tensor`)."""
    return any(hasattr(parameter, "ds_id") for parameter in parameters)


def sharded(parameters) -> bool:
    """Whether an engine holds these weights in shares across the ranks: ZeRO-3's partitions or FSDP2's DTensors."""
    return any(hasattr(parameter, "ds_id") or hasattr(parameter, "to_local") for parameter in parameters)


def loads_sharded(world_size: int, environ: Mapping[str, str] | None = None) -> Engine | None:
    """The engine under which each rank reads only its share of the model's weights as it loads them (src/
    sharded_weights.py): FSDP2, and ZeRO-3 where its launch config keeps zero3_init_flag (`partitioned_loading` says
    so); None for plain DDP, ZeRO-1/2, FSDP1 and one process, which load whole."""
    environ = os.environ if environ is None else environ
    engine = launched(environ)
    if engine is None or world_size < 2:
        return None
    if engine.name == FSDP:
        return engine if environ.get("FSDP_VERSION", "1") == "2" else None
    return engine if engine.zero_stage in (3, None) else None


def fsdp2_plugin(precision: str):
    """accelerate's FSDP plugin as the trainer's Accelerator builds it from the launch config (its FSDP_* environment)
    with the run's mixed precision: the wrap, resharding and precision policy the trainer would apply."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if ACCELERATE_PRECISION[precision] != "no":  # as AcceleratorState sets it
        plugin.set_mixed_precision(ACCELERATE_PRECISION[precision])
    return plugin


def fsdp2_sharded(model, precision: str, device):
    """A model built on the meta device, wrapped as the trainer's accelerate wraps it under FSDP2 (`fsdp2_prepare_model`:
    `fully_shard` per decoder layer, the embeddings and head, then the whole), and each rank's shards allocated on
    `device`, empty: the caller fills them. The trainer's `prepare` later finds an FSDP module and keeps it as it is.
    A model with peft's adapters: its base model wrapped so (its final norm found where accelerate looks for it), then
    the adapters' wrapper as the root.
    The buffers (rotary frequencies, built real on the CPU) and any parameter already real are kept across the
    allocation; tied weights are tied again, as accelerate does after its own load. accelerate's rank-0 broadcast
    (`cpu_ram_efficient_loading`) is off here: no rank holds more than its shards."""
    from types import SimpleNamespace

    from accelerate.utils import fsdp2_prepare_model

    plugin = fsdp2_plugin(precision)
    plugin.cpu_ram_efficient_loading = False  # the attribute, not the constructor's argument: that sets the environment
    # the Accelerator as fsdp2_prepare_model reads it: its plugin, precision and rank
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision=ACCELERATE_PRECISION[
        precision], is_main_process=int(os.environ.get("RANK", "0")) == 0, device=device)
    real = {name: tensor.detach().clone() for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if not tensor.is_meta}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    fsdp2_prepare_model(accelerator, inner)
    if inner is not model:  # peft's wrapper: the root around its base model, as accelerate wraps the root
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fully_shard(model, offload_policy=plugin.cpu_offload, mp_policy=plugin.mixed_precision_policy or
                    MixedPrecisionPolicy())
    model.to_empty(device=device)
    parameters = dict(model.named_parameters())
    for name, value in real.items():  # buffers are not sharded; a parameter that was real keeps its share
        local, block, _ = share(parameters[name] if name in parameters else model.get_buffer(name))
        local.data.copy_(value[block])
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def forward_through_root(model, device) -> None:
    """FSDP2 takes the unit whose forward runs first as the root of all the others, and refuses another root later
    ("already lazily initialized"). peft's `generate` calls its base model's, so the held-out answers would make that
    the root and the trainer's first forward, through peft's wrapper, would fail: one token runs through the wrapper
    first."""
    import torch

    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))


def resharded_after_forward(model):
    """A model sharded as it loaded that only runs forwards (a reference): every FSDP unit lets its gathered weights go
    after its forward. The trainer's wrap keeps the head's and the root's gathered from the forward to the backward,
    which a model without a backward would keep for good (each rank holding the whole embeddings and head)."""
    for module in model.modules():
        if hasattr(module, "set_reshard_after_forward"):  # an FSDP2 unit
            module.set_reshard_after_forward(True, recurse=False)
    return model


def keep_sharding_from_load(trainer) -> None:
    """Under FSDP2, a model sharded as it loaded (`fsdp2_sharded`, LoRA's adapters in it) handed to TRL's trainer:
    accelerate's `prepare` keeps an FSDP module as it is, but first builds its auto-wrap policy by looking the decoder
    layers' classes up by name, which FSDP renamed (FSDPLlamaDecoderLayer): that policy, which would wrap nothing more,
    is dropped. Every unit holds its shards again (the head's, kept whole after the held-out answers' forwards)."""
    if getattr(trainer, "is_fsdp_enabled", False) and any(hasattr(p, "to_local") for p in trainer.model.parameters()):
        trainer.accelerator.state.fsdp_plugin.auto_wrap_policy = None
        resharded(trainer.model)


def share(tensor) -> tuple:
    """Where this rank keeps its part of a weight, and which part of the whole weight that is: (the tensor to fill,
    the block of the whole tensor to read as an index of slices, and for ZeRO-3 the elements of that block, flattened,
    that the partition holds); a weight no engine shares: itself, whole."""
    if hasattr(tensor, "ds_id"):
        return _zero3_share(tensor)
    if hasattr(tensor, "to_local"):
        return _fsdp2_share(tensor)
    return tensor, (), None


def _zero3_share(parameter) -> tuple:
    """DeepSpeed's flat partition `ds_tensor`: rank r holds elements [r p, (r + 1) p) of the flattened weight,
    p = ceil(n / ranks), the padding past n left as it is; the rows that cover them are read (a rank past the end: an
    empty share)."""
    import torch.distributed as dist

    size = parameter.ds_tensor.ds_numel
    start = dist.get_rank(group=parameter.ds_process_group) * size
    end = min(start + size, parameter.ds_numel)
    shape = tuple(parameter.ds_shape)
    if not shape:  # a scalar: rank 0's
        return parameter.ds_tensor.data[:max(0, end - start)], (), slice(0, max(0, end - start))
    if end <= start:
        return parameter.ds_tensor.data[:0], (slice(0, 0),), slice(0, 0)
    width = 1
    for size_of_dimension in shape[1:]:
        width *= size_of_dimension
    first, last = start // width, -(-end // width)
    return parameter.ds_tensor.data[:end - start], (slice(first, last),), slice(start - first * width,
                                                                                  end - first * width)


def _fsdp2_share(parameter) -> tuple:
    """A DTensor's local shard and its block of the whole: its offset on each sharded dimension from its placements
    (torch's `Shard.local_shard_size_and_offset`, what DTensor itself computes it with)."""
    from torch.distributed.tensor.placement_types import Shard

    block = [slice(0, size) for size in parameter.shape]
    coordinate = parameter.device_mesh.get_coordinate()
    for mesh_dimension, placement in enumerate(parameter.placements):
        if isinstance(placement, Shard):
            current = block[placement.dim]
            length, offset = Shard.local_shard_size_and_offset(
                current.stop - current.start, parameter.device_mesh.size(mesh_dimension), coordinate[mesh_dimension])
            block[placement.dim] = slice(current.start + offset, current.start + offset + length)
    return parameter.to_local(), tuple(block), None


def whole_numel(parameter) -> int:
    """A parameter's elements, all of them: ZeRO-3's whole count where it partitioned the parameter."""
    return getattr(parameter, "ds_numel", None) or parameter.numel()


def load_warning(engine: Engine | None, loaded_partitioned: bool) -> str | None:
    """The line a ZeRO-3 stage says when its model loaded whole on every rank (DeepSpeed partitions it only later)."""
    if engine is None or engine.zero_stage != 3 or loaded_partitioned:
        return None
    return ("ZeRO-3 with zero3_init_flag off in the launch config: every rank loads the whole model into host memory "
            "before DeepSpeed partitions it; set zero3_init_flag: true (configs/accelerate/zero3.yaml) to load each "
            "rank's share only")


def gathered(parameters):
    """A block in which `parameters` are whole on every rank: DeepSpeed's own gather where ZeRO-3 partitioned them
    (each rank otherwise holds an empty tensor and its share in `ds_tensor`), nothing to do elsewhere."""
    parameters = [parameter for parameter in parameters if hasattr(parameter, "ds_id")]
    if not parameters:
        return contextlib.nullcontext()
    import deepspeed  # only where ZeRO-3 partitioned the weights: deepspeed is imported already

    return deepspeed.zero.GatheredParameters(parameters)


@contextlib.contextmanager
def generating(model, precision: str):
    """A block in which a model no trainer has wrapped yet answers prompts (the held-out answers before training, a
    round's sampling) with no rank holding the whole of it. Under ZeRO-3: DeepSpeed's own parameter fetching, an
    inference engine over the model as TRL builds one for its reference pass (`prepare_deepspeed`: each module's
    weights gathered for its forward and released after it), destroyed at the end of the block, as the toolkit
    releases TRL's (the trainer's engine adds its own hooks). Under FSDP2 (sharded as it loaded) FSDP's own hooks do
    it; elsewhere there is nothing to do."""
    if not partitioned(model.parameters()):
        yield
        return
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin
    from trl.models import prepare_deepspeed  # ZeRO-3 only: TRL is imported by then

    plugin = DeepSpeedPlugin()  # the launch config's, as partitioned_loading builds it
    plugin.set_mixed_precision(ACCELERATE_PRECISION[precision])
    # what TrainingArguments would fill in for "auto": one sequence per forward, no accumulation (no optimizer here)
    config = {key: value for key, value in plugin.deepspeed_config.items() if key != "train_batch_size"} | {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    engine = prepare_deepspeed(model, SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
        deepspeed_config=config))))
    try:
        yield
    finally:
        engine.destroy()


def whole_value(parameter):
    """A weight's whole value as a plain tensor of its own, the same on every rank: where an engine shards it, a
    collective every rank joins (ZeRO-3's gather, FSDP2's all-gather) for this one weight."""
    if hasattr(parameter, "ds_id"):
        with gathered([parameter]):
            return parameter.data.detach().clone()
    return whole(parameter.detach())


@contextlib.contextmanager
def whole_module(module, root):
    """A block in which `module`'s weights (a LoRA layer: its base weight and adapter) are whole on every rank as
    plain tensors in place: ZeRO-3's gather; FSDP2: the units that hold them (found up from each submodule in `root`)
    unsharded, as for a forward (at most a layer whole), sharded again after."""
    parameters = list(module.parameters())
    if partitioned(parameters):
        with gathered(parameters):
            yield
        return
    from torch.distributed.fsdp import FSDPModule

    parents = {child: parent for parent in root.modules() for child in parent.children()}
    units = []
    for submodule in module.modules():
        owner = submodule if list(submodule.parameters(recurse=False)) else None
        while owner is not None and not isinstance(owner, FSDPModule):
            owner = parents.get(owner)
        if owner is not None and owner not in units:
            units.append(owner)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def resharded(model) -> None:
    """FSDP2: every unit holding its shards again (a unit the trainer keeps gathered from a forward to its backward,
    the head's, stays gathered after a forward without one)."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):  # an FSDP2 unit
            module.reshard()


def local_shard(tensor):
    """The part of a tensor this rank holds and may change in place: FSDP2's shard of a DTensor (its local tensor,
    same storage), the tensor itself elsewhere."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def whole(tensor):
    """A DTensor's value as a plain tensor, the same on every rank (FSDP2: a collective every rank must join; the
    total norm of sharded gradients, for one), the tensor itself elsewhere."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# DeepSpeed's communication buffers, sized by accelerate from the model's hidden size where the config says "auto"
# (hidden^2, 0.9 hidden^2, 10 hidden: accelerate's Accelerator._prepare_deepspeed).
BUFFERS_SIZED_BY_MODEL = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def size_buffers_by_model(trl_config) -> None:
    """The DeepSpeed config accelerate builds from a launch config without a DeepSpeed JSON (configs/accelerate/
    zero*.yaml) leaves the buffer sizes to DeepSpeed's defaults: a ZeRO-3 rank then allocates a 500M-element fp32
    reduce bucket (2 GB, measured on a 33k-parameter model) whatever the model. Marked "auto" where unset, accelerate
    sizes them by the model, as with TRL's and the Hub's example DeepSpeed configs."""
    plugin = getattr(trl_config, "deepspeed_plugin", None)
    if plugin is None:
        return
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    for key in BUFFERS_SIZED_BY_MODEL:
        zero.setdefault(key, "auto")
