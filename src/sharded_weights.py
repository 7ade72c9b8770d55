"""A model's weights read and written a share or a tensor at a time under the engines that shard them (FSDP2, ZeRO-3),
so that no rank holds the whole model on its host at any moment.

Loading (`load_sharded`): the model is built with no weights (on the meta device for FSDP2, then wrapped and each
rank's shards allocated; inside `deepspeed.zero.Init` for ZeRO-3, each module partitioned as it is built), and each
rank reads from the checkpoint's safetensors files only its share of each weight (safetensors' `get_slice`, one tensor
at a time). Under FSDP2 a LoRA stage's adapters are added before the wrap (`with_adapters`), as TRL adds them. Weights
the checkpoint lacks (a reward model's new score head) are drawn as a whole load draws them: the model's own
initializer, from the random state the load started with, on a whole copy of the module, then shared out. A
checkpoint whose tensors are not named as the model's (a conversion transformers applies on load, such as fused
experts) or that has no safetensors files loads whole instead, as before, with one line saying why.

Saving (`save_whole`, `save_adapter`): the final model is written whole into ordinary safetensors files by rank 0 one
tensor at a time, each gathered whole, written and let go (a LoRA model merged layer by layer); an adapter gathered
tensor by tensor. The engine-specific parts (how a rank's share is laid out, the FSDP2 wrap, the gathers) are
src/engines.py's; src/models.py asks for these where `engines.loads_sharded` says so, or the trained model is sharded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from src.engines import (FSDP, Engine, forward_through_root, fsdp2_sharded, loading_whole, partitioned_loading, resharded, share,
                         whole_module, whole_value)
from src.private_api import init_weights

SAFE_INDEX, SAFE_WEIGHTS = "model.safetensors.index.json", "model.safetensors"


class Checkpoint:
    """A saved model's safetensors files: which file holds each tensor; a part of one tensor read at a time."""

    def __init__(self, directory: Path, files: dict[str, Path]):
        self.directory, self.files = directory, files

    @classmethod
    def find(cls, path: str) -> Checkpoint | None:
        """The checkpoint of a local directory or a Hub id (its files fetched into the Hub cache, as from_pretrained
        would: every rank asks, the cache's locks let one download); None without safetensors weights."""
        directory = Path(path)
        if not directory.is_dir():
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(path, allow_patterns=["*.safetensors", "*.json"]))
        if (directory / SAFE_INDEX).exists():
            weight_map = json.loads((directory / SAFE_INDEX).read_text())["weight_map"]
            return cls(directory, {key: directory / file for key, file in weight_map.items()})
        if not (directory / SAFE_WEIGHTS).exists():
            return None
        from safetensors import safe_open

        with safe_open(directory / SAFE_WEIGHTS, framework="pt") as handle:
            return cls(directory, dict.fromkeys(handle.keys(), directory / SAFE_WEIGHTS))

    def read(self, key: str, block: tuple):
        """`block` (a tuple of slices) of tensor `key`: only those bytes are read. The file is opened for this one read,
        so its mapped pages are let go with it."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as handle:
            part = handle.get_slice(key)
            return part[block] if block else part[:] if part.get_shape() else handle.get_tensor(key)

    def names_for(self, model) -> tuple[dict[str, str], list[str]]:
        """The checkpoint's name of each of the model's weights ({model name: checkpoint name}), and the weights it
        lacks. A checkpoint of the bare base model (no `model.` prefix) is read as transformers reads it."""
        prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
        names, missing = {}, []
        for name in weight_names(model):
            bare = name[len(prefix):] if prefix and name.startswith(prefix) else None
            if name in self.files or bare in self.files:
                names[name] = name if name in self.files else bare
            else:
                missing.append(name)
        return names, missing


def weight_names(model) -> list[str]:
    """What a checkpoint holds of a model: its parameters (a tied one once) and persistent buffers."""
    persistent = set(model.state_dict(keep_vars=True))
    return [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()
                                                              if name in persistent]


def load_sharded(path: str, model_class, kwargs: dict, precision: str, device, engine: Engine, adapters=None):
    """(the model, each rank holding only its share, read as its share; None where it loads whole instead, and the
    reason to say, None where there is nothing to say: ZeRO-3 with zero3_init_flag off). `kwargs`: from_pretrained's
    (dtype, trust_remote_code, attn_implementation; a reward model's num_labels and pad_token_id). `adapters`: (a peft
    config, the run's seed): under FSDP2 the LoRA adapters are added before the model is sharded, as TRL adds them
    (`with_adapters`), so that they are sharded with it; TRL is then given the model with them."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    checkpoint = Checkpoint.find(path)
    if checkpoint is None:
        return None, "its weights are not in safetensors files, which are read a share at a time"
    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs["trust_remote_code"], **{
        key: kwargs[key] for key in ("num_labels", "pad_token_id") if key in kwargs})
    build = {key: kwargs[key] for key in ("dtype", "trust_remote_code", "attn_implementation") if key in kwargs}
    random_state = torch.get_rng_state()  # where a whole load draws the weights the checkpoint lacks from
    with loading_whole(), init_empty_weights():  # on the meta device, not inside a ZeRO-3 config that lives already
        meta = model_class.from_config(config, **build)
    meta.tie_weights()  # from_config ties them only later (a tied head is the embeddings, read once)
    names, missing = checkpoint.names_for(meta)
    base = f"{meta.base_model_prefix}."
    renamed = [name for name in missing if name.startswith(base)]
    if renamed:
        return None, f"its checkpoint names its weights otherwise than the model ({renamed[0]} is not among them)"
    drawn = drawn_whole(meta, missing, random_state)  # before the wrap: on the model as transformers builds it
    if engine.name == FSDP:
        # the modules that hold each weight, which the wrap keeps (and peft keeps as each adapted layer's base layer)
        holders = {name: (meta.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                   for name in [*names, *drawn]}
        model = fsdp2_sharded(with_adapters(meta, adapters), precision, device)
        tensor_of = lambda name: getattr(*holders[name])  # noqa: E731
    else:
        model = zero3_built(meta, precision)
        tensors = dict(model.named_parameters()) | dict(model.named_buffers()) if model is not None else {}
        tensor_of = tensors.__getitem__
    if model is None:
        return None, None
    read_shares(tensor_of, names, checkpoint.read, drawn)
    copy_saved_modules(model)
    model = finished(model, checkpoint.directory)
    if hasattr(model, "get_base_model"):  # peft's wrapper, LoRA added as it loaded under FSDP2
        forward_through_root(model, device)
    return model, None


def with_adapters(meta, adapters):
    """The model with LoRA adapters added as TRL adds them (its seed set, then peft's `get_peft_model`), drawn as TRL
    draws them beside real weights: peft places a new adapter on its base weight's device, so for the time of
    `get_peft_model` the base weights are allocations on the CPU that are never written (untouched pages: no host
    memory is used), then back on the meta device; the adapters and buffers kept, for the wrap to shard."""
    if adapters is None:
        return meta
    import torch
    from peft import get_peft_model
    from transformers import set_seed

    peft_config, seed = adapters
    buffers = {name: buffer.clone() for name, buffer in meta.named_buffers()}
    persistent = {f"base_model.model.{name}" for name in meta.state_dict(keep_vars=True)}
    meta.to_empty(device="cpu")
    set_seed(seed)
    model = get_peft_model(meta, peft_config)
    drawn = {name: parameter.detach().clone() for name, parameter in model.named_parameters()
             if parameter.requires_grad}
    model.to("meta")
    with torch.no_grad():
        for name, value in [*drawn.items(), *((f"base_model.model.{name}", value) for name, value in buffers.items())]:
            holder, _, attribute = name.rpartition(".")
            module = model.get_submodule(holder)
            tensor = getattr(module, attribute)
            if isinstance(tensor, torch.nn.Parameter):
                setattr(module, attribute, torch.nn.Parameter(value, requires_grad=tensor.requires_grad))
            else:
                module.register_buffer(attribute, value, persistent=name in persistent)
    return model


def copy_saved_modules(model) -> None:
    """peft's trained copy of a module (a reward model's score head under LoRA: `modules_to_save`) starts as the
    module's own values, which peft copied while they were still on the meta device: copied again, share by share."""
    import torch

    for module in model.modules():
        if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            for copied in module.modules_to_save.values():
                with torch.no_grad():
                    for source, target in zip(module.original_module.parameters(), copied.parameters()):
                        share(target)[0].copy_(share(source)[0])


def zero3_built(meta, precision: str):
    """The model built inside `deepspeed.zero.Init` as from_pretrained builds it under ZeRO-3 (transformers' own
    init contexts: each module partitioned as soon as it is built, no weights drawn), not read yet; None where the
    launch config keeps zero3_init_flag off."""
    from transformers.utils import ContextManagers

    with partitioned_loading(precision) as partitioning:
        if not partitioning:
            return None
        with ContextManagers(type(meta).get_init_context(meta.dtype, False, False, None)):
            model = type(meta)(copy.deepcopy(meta.config))
        model.tie_weights()
    return model


def read_shares(tensor_of, names: dict[str, str], read, drawn: dict) -> None:
    """Each of the model's weights (`tensor_of(name)`) filled with this rank's share of it, cast to the weight's own
    dtype (fp32 master weights from a bf16 checkpoint, as from_pretrained casts them): read from the checkpoint
    (`read(key, block)`), or cut from its whole drawn value."""
    import torch

    with torch.no_grad():
        for name in [*names, *drawn]:
            target, block, flat = share(tensor_of(name))
            if target.numel() == 0:
                continue
            piece = read(names[name], block) if name in names else drawn[name][block]
            target.copy_((piece.reshape(-1)[flat] if flat is not None else piece).reshape(target.shape))


def drawn_whole(meta, missing: list[str], random_state) -> dict:
    """The whole values of the weights the checkpoint lacks (a reward model's new score head: small), drawn by the
    model's own initializer on a whole copy of each module that holds them, from the random state the load started
    with: as a whole load draws them."""
    import torch

    owners = {name.rpartition(".")[0] for name in missing}
    drawn = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(random_state)
        for module_name, module in meta.named_modules():
            if module_name in owners:
                whole = copy.deepcopy(module).to_empty(device="cpu")
                init_weights(meta, whole)
                drawn.update({f"{module_name}.{name}" if module_name else name: value for name, value in
                              [*whole.named_parameters(recurse=False), *whole.named_buffers(recurse=False)]})
    return {name: value for name, value in drawn.items() if name in missing}


def finished(model, directory: Path):
    """What from_pretrained does after the weights: the generation config saved beside them, evaluation mode."""
    from transformers import GenerationConfig

    if model.can_generate() and (directory / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


# The final model -----------------------------------------------------------------------------------------------------

# transformers' save_pretrained default: one file up to 50 GB, then shards with an index
MAX_SHARD_SIZE = "50GB"
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class StreamedSafetensors:
    """A safetensors file written a tensor at a time, in the order its header lists them: the format (an 8-byte
    little-endian header length, a JSON header of each tensor's dtype, shape and byte offsets, padded to 8 bytes, then
    the data) is written as safetensors writes it, but safetensors 0.8's writers (`save_file`, `serialize_file`) take
    every tensor at once. Read back by safetensors and from_pretrained as any other file."""

    def __init__(self, path: Path, tensors: list[tuple[str, object, tuple]], metadata: dict[str, str]):
        header, offset = {}, 0
        for name, dtype, shape in tensors:
            size = dtype.itemsize
            for length in shape:
                size *= length
            header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.handle = path.open("wb")
        self.handle.write(len(encoded).to_bytes(8, "little") + encoded)

    def write(self, tensor) -> None:
        import torch

        self.handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(dtype=torch.uint8).numpy())

    def close(self) -> None:
        self.handle.close()


def saved_tensors(model) -> list[tuple[str, object, tuple, object]]:
    """What a whole save of the model holds, in order: (name, dtype, shape, a function giving its whole value, which
    every rank calls together). A model with LoRA adapters is saved merged, as peft's merge_and_unload then
    save_pretrained saves it: each adapted layer's weight plus its adapter's delta (peft's `get_delta_weight`), a
    reward model's trained head copy under the head's own name; the names its base model's."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    adapter = model.active_adapter if isinstance(model, PeftModel) else None
    persistent, seen, done, tensors = set(base.state_dict(keep_vars=True)), set(), [], []
    for name, module in base.named_modules():
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(outer) for outer in done):
            continue
        if isinstance(module, LoraLayer):
            done.append(prefix)
            weight = module.base_layer.weight
            tensors.append((prefix + "weight", weight.dtype, shape_of(weight),
                            lambda layer=module: merged_weight(layer, adapter, model)))
            module = module.base_layer
            tensors += [(prefix + "bias", module.bias.dtype, shape_of(module.bias),
                         lambda bias=module.bias: whole_value(bias))] if module.bias is not None else []
            continue
        if isinstance(module, ModulesToSaveWrapper):
            done.append(prefix)
            module = module.modules_to_save[adapter]
        for local, tensor in [*module.named_parameters(), *module.named_buffers()] if prefix in done else [
                *module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) not in seen and (prefix + local in persistent or isinstance(tensor, torch.nn.Parameter)):
                seen.add(id(tensor))
                tensors.append((prefix + local, tensor.dtype, shape_of(tensor), lambda tensor=tensor: whole_value(
                    tensor)))
    return tensors


def shape_of(tensor) -> tuple:
    """A weight's whole shape (ZeRO-3's, where the tensor itself is an empty placeholder)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def merged_weight(layer, adapter: str, model):
    """A LoRA layer's weight with its adapter merged in, as peft's safe merge computes it (the base weight plus
    `get_delta_weight` in the base's dtype), from the layer made whole for the moment (engines.whole_module)."""
    if layer.use_dora.get(adapter):
        raise ValueError("merging a DoRA adapter into a sharded model is not supported: save it unmerged "
                         "(--merge_adapter false) and merge it with peft on one process")
    with whole_module(layer, model):
        weight = layer.base_layer.weight.detach()
        return (weight + layer.get_delta_weight(adapter).to(weight.dtype)).clone()


def save_whole(model, directory: Path, is_main: bool) -> None:
    """Every rank: the model (a LoRA model merged: `saved_tensors`) written whole into ordinary safetensors files, as
    save_pretrained writes them (one file up to 50 GB, then shards with an index; its config and generation config by
    save_pretrained itself), by rank 0 one tensor at a time: each gathered whole (a collective every rank joins),
    written and let go, so no process holds more than one tensor (a LoRA layer: its base weight and adapter) of it.
    A failed write on rank 0 stops its writing, not the gathers the other ranks are in; it is raised after them."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from peft import PeftModel

    resharded(model)
    tensors = saved_tensors(model)
    plan = split_torch_state_dict_into_shards({name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype,
                                               shape, _ in tensors}, max_shard_size=MAX_SHARD_SIZE)
    described = {name: (name, dtype, shape) for name, dtype, shape, _ in tensors}
    value_of = {name: value for name, _, _, value in tensors}
    failure = None
    if is_main:
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        base.save_pretrained(directory, state_dict={})  # its config and generation config; earlier shards removed
    for file, names in plan.filename_to_tensors.items():
        writer = None
        if is_main and failure is None:
            writer, failure = _opened(directory / file, [described[name] for name in names])
        for name in names:
            value = value_of[name]()
            if writer is not None:
                try:
                    writer.write(value)
                except OSError as error:
                    writer, failure = None, error
            del value
        if writer is not None:
            writer.close()
    if is_main and plan.is_sharded and failure is None:
        (directory / SAFE_INDEX).write_text(json.dumps({"metadata": plan.metadata, "weight_map": {
            name: file for file, names in plan.filename_to_tensors.items() for name in names}}, indent=2) + "\n")
    if failure is not None:
        raise failure


def _opened(path: Path, tensors: list) -> tuple:
    """(a writer, None), or (None, the error) where the file cannot be opened."""
    try:
        return StreamedSafetensors(path, tensors, {"format": "pt"}), None
    except OSError as error:
        return None, error


def save_adapter(model, directory: Path, is_main: bool) -> None:
    """Every rank: a LoRA model's adapter (its trained weights: the adapter and a reward model's head copy) gathered a
    tensor at a time into rank 0's memory, the base never, and saved by peft as save_pretrained saves it."""
    adapter = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            value = whole_value(parameter)
            if is_main:
                adapter[name] = value.cpu()
    if is_main:
        model.save_pretrained(directory, state_dict=adapter)
