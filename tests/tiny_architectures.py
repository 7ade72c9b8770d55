"""Tiny random configs for every causal LM of the installed transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), for the
packed-forward registry test (tests/test_packed_support.py): 2 layers (or one per kind of layer the family has),
hidden 64, every window / chunk set to WINDOW positions so that test rows are longer than it."""

from __future__ import annotations

WINDOW = 8
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             n_shared_experts=1, shared_expert_intermediate_size=64, first_k_dense_replace=1, moe_topk=2,
             kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             rotary_dim=8, n_group=1, topk_group=1, initializer_range=0.2, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# Families whose defaults do not fit SMALL (or that need a switch turned on to show their window).
FIXES = {
    "dbrx": {"tie_word_embeddings": False},
    "falcon": {"new_decoder_architecture": True},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1},
    # their defaults are attention only (or none); checkpoints have convolution layers
    "lfm2": {"layer_types": ["full_attention", "conv"]},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"]},
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, **extra):
    """The family's config with SMALL's sizes where it has the field, every window at WINDOW, and one layer of each
    kind its default config lists (so a 2-layer model still has its sliding and its full layers)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    aliases = getattr(config_class, "attribute_map", {})
    kwargs = {key: value for key, value in SMALL.items() if hasattr(default, key) or key in aliases}
    if hasattr(default, "head_dim") and not isinstance(getattr(config_class, "head_dim", None), property):
        kwargs["head_dim"] = 16  # families that read it instead of hidden_size / heads
        if "qk_rope_head_dim" in kwargs:  # multi-head latent attention (DeepSeek): rotary sizes come from head_dim
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # latent keys and values: one per head
    text = default.get_text_config() if _single_text_config(default) else default
    for window in ("sliding_window", "attention_chunk_size"):
        if hasattr(text, window) or hasattr(default, window):
            kwargs[window] = WINDOW
    kinds = list(dict.fromkeys(getattr(text, "layer_types", None) or []))
    if len(kinds) > 1:
        kwargs["layer_types"] = kinds
        kwargs["num_hidden_layers"] = len(kinds)
    kwargs.update(FIXES.get(model_type, {}))
    kwargs.update(extra)
    return config_class(**kwargs)


def _single_text_config(config) -> bool:
    try:
        config.get_text_config()
        return True
    except ValueError:  # several text configs (MusicGen): not a plain causal LM
        return False
