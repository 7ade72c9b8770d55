"""The private names of TRL and transformers that the toolkit reads outside its trainers' overrides: one file, so a TRL
or transformers upgrade starts here (docs/development.md lists every other place: the objectives' trainer modules and
the Trainer internals in src/trainers/base.py and checkpointing.py; tests/test_private_api.py checks the list against
the code). Each is imported when first asked for: both libraries cost seconds to import, and the preflight needs
neither."""

from __future__ import annotations


def trl_tokenize():
    """`trl.data_utils._tokenize` (TRL 1.16): how TRL's trainers tokenize a prompt or a prompt + answer (chat template
    or plain text), which src/data/ reproduces id for id (tests/prepared_digests.json)."""
    from trl.data_utils import _tokenize

    return _tokenize


def attention_implementation(config) -> str | None:
    """`PretrainedConfig._attn_implementation` (transformers 5.23, no public accessor): the attention a model config
    runs with ("sdpa", "eager", "flash_attention_2", a Hub kernel; None before one is set), which the packed DPO
    forward's layout and allow-list (src/packed_dpo.py, packed_dpo_support.py) and the SFT forward depend on."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(config, implementation: str | None) -> None:
    """Sets `PretrainedConfig._attn_implementation` (its setter carries it into the sub-configs); every attention
    layer of transformers 5.23 looks its function up from it at each call: src/packed_attention.py runs the packed
    forward on `flex_attention` this way and restores the model's own afterwards."""
    config._attn_implementation = implementation


def compile_jinja_template():
    """`transformers.utils.chat_template_utils._compile_jinja_template` (transformers 5.23): the Jinja environment
    transformers renders chat templates in ({% generation %} and loop controls are part of it)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template


def hf_deepspeed_config():
    """The HfDeepSpeedConfig that makes `from_pretrained` load inside `deepspeed.zero.Init` (transformers 5.23 keeps it
    in `transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref`, with public set and unset but no getter),
    or None: src/engines.py `loading_whole` steps out of it for a model one rank loads alone and puts it back."""
    from transformers.integrations import deepspeed

    reference = deepspeed._hf_deepspeed_config_weak_ref
    return reference() if reference is not None else None


def init_weights(model, module) -> None:
    """`PreTrainedModel._init_weights` (transformers 5.23, no public per-module form): the model's own initializer on
    one module, which src/sharded_weights.py runs on a whole copy of a module whose weights the checkpoint lacks (a
    reward model's new score head), to draw them as a whole load draws them."""
    model._init_weights(module)

