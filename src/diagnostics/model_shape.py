"""A model's sizes for the memory plan: parameters, layers, hidden and vocabulary sizes, its linear layers (for
LoRA) and its largest layer (for ZeRO-3).

From a local directory with config.json, or a Hub id already in the cache (or reachable), the model is built on
the meta device (no weights, no download but config.json) and measured. From a bare parameter count, a
Llama-style shape is assumed from the nearest well-known model and the report says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from src.embedded.model import ensure_embedded_model
from src.hub_access import hub_reachable, is_offline

from .inputs import InputError


@dataclass
class ModelShape:
    name: str
    source: str  # how the numbers were obtained
    exact: bool  # measured from the model's config, not assumed from a parameter count
    total_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    kv_size: int  # key/value projection width (num_key_value_heads * head_dim)
    vocab_size: int
    embedding_params: int  # input embeddings plus an untied output layer: kept 16-bit under QLoRA
    largest_layer_params: int  # the biggest unit ZeRO-3 gathers at once: a decoder block or the embeddings
    linear_layers: list[tuple[str, int, int]] = field(default_factory=list)  # (name, in, out), no output layer
    # A rotary model's context (src/input_checks.rotary_context: max_position_embeddings or what its rope scaling
    # reaches) and how it was read; None for other position schemes and for a shape assumed from a parameter count
    context_tokens: int | None = None
    context_source: str | None = None


# Well-known decoder shapes (hidden, layers, intermediate, vocab) to assume from a bare parameter count.
REFERENCE_SHAPES = {
    "GPT-2 small": (768, 12, 3072, 50257),
    "Qwen2.5-0.5B": (896, 24, 4864, 151936),
    "TinyLlama-1.1B": (2048, 22, 5632, 32000),
    "Llama-3.2-3B": (3072, 28, 8192, 128256),
    "Llama-2-7B": (4096, 32, 11008, 32000),
    "Llama-2-13B": (5120, 40, 13824, 32000),
    "CodeLlama-34B": (8192, 48, 22016, 32000),
    "Llama-2-70B": (8192, 80, 28672, 32000),
}
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama_linear_layers(layers: int, hidden: int, intermediate: int) -> list[tuple[str, int, int]]:
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, hidden),
        "v_proj": (hidden, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    return [
        (f"model.layers.{layer}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}", *shapes[name])
        for layer in range(layers)
        for name in LLAMA_PROJECTIONS
    ]


def shape_from_param_count(param_count: int) -> ModelShape:
    """A Llama-style shape with `param_count` parameters, scaled from the nearest well-known model."""
    reference = min(
        REFERENCE_SHAPES,
        key=lambda name: abs(math.log(param_count) - math.log(_llama_params(*REFERENCE_SHAPES[name]))),
    )
    hidden, _layers, intermediate, vocab = REFERENCE_SHAPES[reference]
    block = 4 * hidden * hidden + 3 * hidden * intermediate
    embeddings = 2 * vocab * hidden
    layers = max(1, round((param_count - embeddings) / block))
    return ModelShape(
        name="assumed Llama-style model",
        source=f"--params: Llama-style shape assumed (hidden {hidden}, vocab {vocab}, like {reference}); "
        "name the model with --model_name_or_path for exact numbers",
        exact=False,
        total_params=param_count,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        kv_size=hidden,
        vocab_size=vocab,
        embedding_params=embeddings,
        largest_layer_params=max(block, vocab * hidden),
        linear_layers=_llama_linear_layers(layers, hidden, intermediate),
    )


def _llama_params(hidden: int, layers: int, intermediate: int, vocab: int) -> int:
    return layers * (4 * hidden * hidden + 3 * hidden * intermediate) + 2 * vocab * hidden


def _read_config(name_or_path: str, subject: str, **options):
    """AutoConfig.from_pretrained, with a config transformers cannot read (custom code, unknown model type)
    reported as bad input; OSError (not found) is left to the caller."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, **options)
    except ValueError as error:
        raise InputError(f"{subject}: transformers cannot read its config ({str(error).splitlines()[0]}); use --params") from None


def _load_config(name_or_path: str, environ: Mapping[str, str], subject: str):
    if name_or_path == "embedded":  # the toolkit's offline default model, built once on first use
        name_or_path = str(ensure_embedded_model())
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise InputError(f"{subject}: the directory has no config.json; point at a model directory or use --params")
    if not path.is_dir() and (path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1):
        raise InputError(f"{subject}: no such model directory; pass a directory with config.json, a Hub id, or --params 7e9")
    from transformers.utils import logging as transformers_logging  # imported only now: transformers takes seconds

    transformers_logging.set_verbosity_error()  # its warnings about configs are noise in this report
    if path.is_dir():
        return _read_config(str(path), subject), f"config.json in {path}"
    try:
        return _read_config(name_or_path, subject, local_files_only=True), f"Hub id {name_or_path} (cached config)"
    except OSError:
        pass
    # Checked first because the Hub client retries an unreachable host for about half a minute.
    if is_offline(environ) or not hub_reachable(environ):
        raise InputError(
            f"{subject}: not in the local Hugging Face cache and the Hub is unreachable; "
            "pass a local directory with config.json, or the size with --params (e.g. --params 7e9)"
        )
    try:
        return _read_config(name_or_path, subject), f"Hub id {name_or_path}"
    except OSError as error:
        raise InputError(f"{subject}: {str(error).splitlines()[0]} (or use --params)") from None


def _build_on_meta_device(config):
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    with init_empty_weights():
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM architecture; the plain model still has the sizes
            model = AutoModel.from_config(config)
    # Under init_empty_weights (transformers 5) the output layer comes out untied from the embeddings even when the
    # config ties them, which would count the vocabulary matrix twice; tie_weights() follows the config.
    model.tie_weights()
    return model


def _linear_layers(model) -> list[tuple[str, int, int]]:
    import torch

    output_layer = model.get_output_embeddings()
    layers = []
    for name, module in model.named_modules():
        if module is output_layer:
            continue
        if isinstance(module, torch.nn.Linear):
            layers.append((name, module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":  # GPT-2's linear layer stores its weight as (in, out)
            layers.append((name, module.weight.shape[0], module.weight.shape[1]))
    return layers


def _decoder_blocks(model) -> list:
    """The repeated blocks: the ModuleList holding the most parameters."""
    import torch

    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList) and len(module)]
    if not lists:
        return []
    return list(max(lists, key=lambda blocks: sum(parameter.numel() for parameter in blocks.parameters())))


def _config_value(config, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def shape_from_model(name_or_path: str, environ: Mapping[str, str] | None = None, subject: str | None = None) -> ModelShape:
    """The model's sizes; `subject` names where the name came from in messages (default "--model_name_or_path NAME")."""
    environ = os.environ if environ is None else environ
    subject = subject or f"--model_name_or_path {name_or_path}"
    config, source = _load_config(name_or_path, environ, subject)
    try:
        model = _build_on_meta_device(config)
        return _measure(model, config, name_or_path, source)
    except InputError:
        raise
    except Exception as error:  # custom architectures and models without the usual embeddings/decoder layout
        raise InputError(f"{subject}: cannot measure it from its config ({type(error).__name__}: {error}); use --params") from None


def _measure(model, config, name: str, source: str) -> ModelShape:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _config_value(text_config, "hidden_size", "n_embd", "d_model")
    heads = _config_value(text_config, "num_attention_heads", "n_head")
    head_dim = _config_value(text_config, "head_dim", default=hidden // heads if hidden and heads else None)
    kv_heads = _config_value(text_config, "num_key_value_heads", default=heads)
    input_embeddings = model.get_input_embeddings()
    output_embeddings = model.get_output_embeddings()
    embedding_params = input_embeddings.weight.numel()
    if output_embeddings is not None and output_embeddings.weight is not input_embeddings.weight:
        embedding_params += output_embeddings.weight.numel()
    # the preflight's rule (~0.2 s of imports, next to building the model): check_gpu warns as the launcher does
    from src.input_checks import rotary_context

    blocks = _decoder_blocks(model)
    block_params = max((sum(parameter.numel() for parameter in block.parameters()) for block in blocks), default=0)
    context = rotary_context(config) if hasattr(config, "get_text_config") else None
    return ModelShape(
        name=name,
        source=source,
        exact=True,
        total_params=sum(parameter.numel() for parameter in model.parameters()),
        num_layers=len(blocks) or _config_value(text_config, "num_hidden_layers", "n_layer", default=1),
        hidden_size=hidden,
        intermediate_size=_config_value(text_config, "intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden,
        kv_size=kv_heads * head_dim if kv_heads and head_dim else hidden,
        vocab_size=input_embeddings.weight.shape[0],
        embedding_params=embedding_params,
        largest_layer_params=max(block_params, input_embeddings.weight.numel()),
        linear_layers=_linear_layers(model),
        context_tokens=context[0] if context else None,
        context_source=context[1] if context else None,
    )
