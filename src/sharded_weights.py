"""A model's weights read a share at a time under the engines that shard them (FSDP2, ZeRO-3): the model is built
with no weights (on the meta device for FSDP2, inside `deepspeed.zero.Init` for ZeRO-3, each module partitioned as it
is built), and each rank reads from the checkpoint's safetensors files only its share of each weight (safetensors'
`get_slice`, one tensor at a time), so that no rank holds the whole model on its host at any moment of the load. Its
engine-specific parts (how a rank's share is laid out, the FSDP2 wrap) are src/engines.py's; src/models.py
`load_model` asks for it where `engines.loads_sharded` says so.

A checkpoint whose tensors are not named as the model's (a conversion transformers applies on load, such as fused
experts) or that has no safetensors files loads whole instead, as before, with one line saying why. Parameters the
checkpoint lacks (a reward model's new score head) are drawn as a whole load draws them: the model's own initializer,
from the random state the load started with, on a whole copy of the module, then shared out.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from src.engines import FSDP, Engine, fsdp2_sharded, loading_whole, partitioned_loading, share
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


def load_sharded(path: str, model_class, kwargs: dict, precision: str, device, engine: Engine):
    """(the model, each rank holding only its share, read as its share; None where it loads whole instead, and the
    reason to say, None where there is nothing to say: ZeRO-3 with zero3_init_flag off). `kwargs`: from_pretrained's
    (dtype, trust_remote_code, attn_implementation; a reward model's num_labels and pad_token_id)."""
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
    names, missing = checkpoint.names_for(meta)
    base = f"{meta.base_model_prefix}."
    renamed = [name for name in missing if name.startswith(base)]
    if renamed:
        return None, f"its checkpoint names its weights otherwise than the model ({renamed[0]} is not among them)"
    drawn = drawn_whole(meta, missing, random_state)  # before the wrap: on the model as transformers builds it
    model = fsdp2_sharded(meta, precision, device) if engine.name == FSDP else zero3_built(meta, precision)
    if model is None:
        return None, None
    read_shares(model, names, checkpoint.read, drawn)
    return finished(model, checkpoint.directory), None


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


def read_shares(model, names: dict[str, str], read, drawn: dict) -> None:
    """Each of the model's weights filled with this rank's share of it, cast to the weight's own dtype (fp32 master
    weights from a bf16 checkpoint, as from_pretrained casts them): read from the checkpoint (`read(key, block)`), or
    cut from its whole drawn value."""
    import torch

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name not in names and name not in drawn:
                continue
            target, block, flat = share(tensor)
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
