"""Which models the packed DPO forward (src/packed_dpo.py) may run on: an allow-list proven in the suite, and the
cause for everything else. `python -m src.packed_dpo_support` prints the table docs/speed.md carries.

Trust is an allow-list. A model type is packed only if it is in VERIFIED, which tests/test_packed_support.py proves
for the pinned transformers: a tiny random model of the family (every window and chunk shorter than the test rows,
one layer of every kind its config lists) gives TRL's padded forward's per-token log-probs within 1e-5. Any other
type is refused with its cause, or as "not verified", so a transformers upgrade that adds or changes a family
cannot make the default forward silently wrong; the first-batch check (src/packed_forward.py) stays as a second guard.

Everything here reads the model's config only (no weights), so the launch decides before data preparation and the
dry run shows it."""

from __future__ import annotations

from src import vision
from src.distributed import print0
from src.models import ModelError
from src.private_api import attention_implementation

# Proven exact by tests/test_packed_support.py (sliding windows, where the family has them, are reproduced per
# layer kind by src/packed_attention.layer_windows).
VERIFIED = frozenset("""
afmoe apertus arcee aria_text axk1 beam biogpt bitnet codegen cohere cohere2 cohere2_moe ctrl cwm diffllama deepseek_v2 deepseek_v3 doge dots1 ernie4_5
ernie4_5_moe exaone4 exaone_moe falcon flex_olmo flint gemma gemma2 gemma3_text glm glm4 glm4_moe glm4_moe_lite gpt-sw3 gpt2
gpt_bigcode gpt_neox gpt_neox_japanese gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoeshared
helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax internlm3 iquestcoder jais2 jetmoe kolibri1 laguna
lfm2 lfm3 llama longcat_flash mellum mimo_v2_flash minicpm3 minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral modernbert-decoder nanochat
nemotron olmo olmo2 olmo3 olmoe opt persimmon phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_moe seed_oss smollm3
solar_open stablelm starcoder2 vaultgemma xglm youtu
""".split())

ENCODER = "an encoder family: its attention is bidirectional unless built as a decoder, so a mask cannot make it causal"
SEQ2SEQ = "the decoder half of an encoder-decoder family, not verified as a causal LM on its own"
ALIBI = "ALiBi position biases are built from the padded 2D mask, not from position ids"
STATEFUL = ("state-space, recurrent or convolution layers carry state along the row, so two answers cannot share a "
            "prompt through a mask")
MULTIMODAL = "a multimodal model: its positions are not plain token positions"
NOT_VERIFIED = "not verified for the packed forward (the suite has not compared it with the padded forward)"

# Refused with a known cause (what the registry test measured: a difference or an error under the packed layout).
REFUSED = {
    **dict.fromkeys("bert camembert data2vec-text electra ernie megatron-bert rembert roberta roberta-prelayernorm "
                    "roc_bert roformer xlm xlm-roberta xlm-roberta-xl xmod big_bird".split(), ENCODER),
    **dict.fromkeys("bart bigbird_pegasus blenderbot blenderbot-small marian mbart mvp pegasus plbart prophetnet "
                    "trocr whisper musicgen musicgen_melody bert-generation".split(), SEQ2SEQ),
    **dict.fromkeys("bloom mpt".split(), ALIBI),
    **dict.fromkeys("bamba falcon_h1 falcon_mamba granitemoehybrid jamba kimi_linear mamba mamba2 minimax nemotron_h "
                    "olmo_hybrid qwen3_next qwen3_5_text qwen3_5_moe_text recurrent_gemma rwkv xlstm zamba zamba2 "
                    "bailing_hybrid".split(), STATEFUL),
    "cpmant": "position biases computed from segment ids and the 2D mask, not from position ids",
    "reformer": "locality-sensitive hashing attention buckets tokens across the whole row",
    "xlnet": "permutation language model: no causal mask to share a prompt through",
    "openai-gpt": "its attention takes no 4D mask (its own causal buffer)",
    "deepseek_v4": "compressed and sparse attention layers select keys across the row",
    **dict.fromkeys("axk2 deepseek_v32 glm_moe_dsa".split(),
                    "sparse attention: an indexer picks the top keys over the whole row, which a mask cannot pin"),
    "moshi": "its sliding window is not the one transformers' masks build (measured: a 4D mask does not reproduce it)",
}
# Neither forward can run these with TRL 1.16: refused before training, as an error (not a fallback).
CANNOT_TRAIN = {
    "llama4_text": "TRL 1.16's fused LM head finds no backbone under its base_model_prefix (both DPO forwards fail)",
}
# Layer kinds a 4D mask can reproduce (src/packed_attention.layer_windows); any other kind is refused.
MASKABLE_LAYER_KINDS = ("full_attention", "sliding_attention")
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")
FLASH_PREFIX = "flash_attention"


def refusal(config, *, attn_implementation: str | None = None, router_aux_loss_coef: float | None = None,
            truncation_mode: str = "keep_start", prompt_learning: bool = False) -> str | None:
    """Why the packed forward cannot be trusted for a model of this config and these settings, or None.
    `router_aux_loss_coef`: TRL's DPOConfig field (None: the model config's own coefficient)."""
    model_type = getattr(config, "model_type", "?")
    if model_type in CANNOT_TRAIN:
        return CANNOT_TRAIN[model_type]
    if vision.is_vision_config(config):  # its images in the packed layout (src/vision.py), then its language model
        return vision.packed_refusal(config) or refusal(
            config.get_text_config(), attn_implementation=attn_implementation or attention_implementation(config),
            router_aux_loss_coef=router_aux_loss_coef, truncation_mode=truncation_mode, prompt_learning=prompt_learning)
    if _text_config(config) is not config:
        return f"{model_type} is {MULTIMODAL}"
    text = _text_config(config)
    if model_type not in VERIFIED:
        return f"{model_type}: {REFUSED.get(model_type, NOT_VERIFIED)}"
    implementation = str(attn_implementation or attention_implementation(config) or "sdpa")
    if implementation not in MASKED_IMPLEMENTATIONS and FLASH_PREFIX not in implementation:
        return f"{model_type} with attention implementation {implementation!r}: not known to honour a custom mask (sdpa, eager, flash)"
    other_kinds = sorted(set(getattr(text, "layer_types", None) or []) - set(MASKABLE_LAYER_KINDS))
    if other_kinds:
        return f"{model_type} has {', '.join(other_kinds)} layers: {STATEFUL}"
    if getattr(config, "alibi", False):
        return f"{model_type} with alibi: {ALIBI}"
    if router_aux_enabled(text, router_aux_loss_coef):
        coefficient = text.router_aux_loss_coef if router_aux_loss_coef is None else router_aux_loss_coef
        return (f"{model_type}: the MoE router auxiliary loss is on (coefficient {coefficient}) and averages over the padded batch's "
                "tokens; --router_aux_loss_coef 0 packs")
    if truncation_mode != "keep_start":
        return f"{model_type} with truncation_mode {truncation_mode!r}: only keep_start is packed"
    if prompt_learning:
        return f"{model_type} with prompt-learning PEFT: it adds virtual tokens before every sequence"
    return None


def cannot_train(config) -> str | None:
    """Why neither DPO forward (packed or TRL's padded) can run this model, or None."""
    return CANNOT_TRAIN.get(getattr(config, "model_type", None))


def router_aux_enabled(text_config, router_aux_loss_coef: float | None) -> bool:
    """TRL 1.16's rule (DPOTrainer.__init__): the load-balancing loss is on whenever the config has the
    `output_router_logits` field, whatever its value, and the coefficient is not 0."""
    coefficient = getattr(text_config, "router_aux_loss_coef", 0.0) if router_aux_loss_coef is None else \
        router_aux_loss_coef
    return hasattr(text_config, "output_router_logits") and coefficient != 0.0


def padding_free_requested(trl_overrides: dict) -> bool:
    """The packed forward is on unless `--padding_free false` (TRL's own flag name) asks for TRL's padded one."""
    return bool(trl_overrides.get("padding_free", True))


def preflight(model_path: str, model_args, trl_overrides: dict, title: str) -> str | None:
    """The forward this launch of the objective `title` (its row's display name) will use, decided from the model's
    config.json before data preparation: None (packed), or why TRL's padded forward runs instead. A model neither
    forward can run stops the launch here (one line), not on every rank after the data was prepared."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError):  # the model loader names the problem, with its flag, when it loads the weights
        return None
    blocked = cannot_train(config)
    if blocked:
        raise ModelError(f"--model_name_or_path {model_path}: {config.model_type} cannot be trained with {title} here: "
                         f"{blocked}")
    if not padding_free_requested(trl_overrides):
        return "--padding_free false"
    return refusal(config, attn_implementation=model_args.attn_implementation,
                   router_aux_loss_coef=trl_overrides.get("router_aux_loss_coef"),
                   truncation_mode=trl_overrides.get("truncation_mode", "keep_start"),
                   prompt_learning=False)


_ANNOUNCED: set[str] = set()


def announce_padded(reason: str) -> None:
    """One warning line per reason and process: the launch's preflight and the trainer come to the same reason."""
    if reason not in _ANNOUNCED:
        _ANNOUNCED.add(reason)
        print0(f"  warning: packed forward off, TRL's padded forward runs instead: {reason}")


def _text_config(config):
    try:
        return config.get_text_config()
    except ValueError:  # several text configs (MusicGen's encoder and decoder)
        return None


def support_table() -> list[tuple[str, str]]:
    """(model type, "packed" or the cause) for every causal LM of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in VERIFIED:
            rows.append((model_type, "packed (exact)"))
        else:
            rows.append((model_type, CANNOT_TRAIN.get(model_type) or REFUSED.get(model_type) or NOT_VERIFIED))
    return rows


def markdown_table() -> str:
    """docs/speed.md's table: packed types on a few lines, then each refused type with its cause."""
    rows = support_table()
    packed = [name for name, status in rows if status.startswith("packed")]
    lines = [f"Packed, proven exact ({len(packed)}): " + ", ".join(f"`{name}`" for name in packed) + ".", "",
             "| model type | why the padded forward runs instead |", "|---|---|"]
    lines += [f"| `{name}` | {status} |" for name, status in rows if not status.startswith("packed")]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
