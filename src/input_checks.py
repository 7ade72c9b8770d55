"""The model-side mistakes a user can make, refused in the preflight before any data is tokenized or GPU is taken.

Owns the checks that need only the model's config.json, its module names and the tokenizer, never its weights:

- a model that is not a causal LM for a stage that trains one (its objective's `causal_lm`: SFT, DPO, KTO, ...): an
  encoder-only checkpoint (BERT, RoBERTa, ...) loads through its LM-head class and trains to the end with meaningless
  log-probs (each position sees the token it predicts); an encoder-decoder (T5, BART) or a type transformers has no
  causal-LM class for;
- a tokenizer with more token ids than the model's embeddings (tokens added without resizing the model, or a tokenizer
  from another model): an `IndexError` deep in the first forward otherwise;
- LoRA target modules that match no module, or match modules LoRA cannot adapt: PEFT's traceback at trainer creation
  otherwise, after the data was prepared;
- a --max_length past a model's learned position table (GPT-2, OPT): an `IndexError` in the first long batch;
  past a rotary model's context (max_position_embeddings, or what its rope scaling extends it to) it runs, on
  positions it never trained at: a warning line at the stage's start (`position_warnings`), not an error;
- a chat template that does not compile;
- a vision-language model (src/vision.py) outside the families proven here, or given a stage, engine or option that
  cannot train it yet (`check_vision_model`: what works is named);
- a --judge reward model that is not there (it is loaded only after training).

src/pipeline/preflight.py (`check_sources`) calls `check_judge` as soon as the data sources are checked (before any
heavy import) and `check_model_inputs` once, right after the tokenizer is loaded, so `--dry_run` (run_distributed.sh's
preflight) shows them. The module names come from the model built on the meta device:
no weights are read and no memory is allocated, even for a 70B model.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from src import vision
from src.config import EMBEDDED, Config, ModelArguments
from src.engines import requested as requested_engine
from src.judges import FUNCTION_JUDGE, load_function
from src.models import ModelError, first_line, is_jinja_file
from src.objectives import OBJECTIVES, SEQUENCES, objective
from src.private_api import compile_jinja_template
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head


def check_model_inputs(path: str, run_config: Config, tokenizer, stages: list) -> dict[str, list[str]]:
    """Refuse, with one line naming the flag and what to do, a model, tokenizer, length, LoRA setting or judge that
    cannot work. `stages`: the run's planned stages (src/pipeline/stages.Stage: a name and its config). Returns the
    warnings for what runs but silently worse, by stage name (a --max_length past a rotary model's context)."""
    model = run_config.model
    config = load_config(path, model.trust_remote_code)
    # a reward model is a sequence classifier
    causal_stages = list(dict.fromkeys(stage.name for stage in stages if objective(stage.name).causal_lm))
    causal = bool(causal_stages)
    if vision.is_vision_config(config):
        check_vision_model(path, config, run_config, stages)
    elif causal:
        check_causal(path, config, [f"--stage {name}" if len(stages) == 1 else name.upper() for name in causal_stages])
    check_vocabulary(path, config, tokenizer, model.chat_template_path)
    check_chat_template(path, tokenizer, model.chat_template_path)
    max_length = max(stage.config.data.max_length for stage in stages)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    past_positions = isinstance(positions, int) and max_length > positions
    targets = model.lora_target_modules if model.use_peft else None
    if not past_positions and not model.attn_implementation and (
            targets is None or (isinstance(targets, str) and targets.lower() == ALL_LINEAR)):
        return position_warnings(path, config, stages)  # nothing left that needs the model built
    built = meta_model(config, causal, model.trust_remote_code, path, model.attn_implementation)
    if past_positions:
        check_positions(path, built, positions, max_length)
    if targets is not None:
        check_lora_targets(path, built, model, causal)
    return position_warnings(path, config, stages)


# Rope types that stretch the positions a model was trained on (transformers' ROPE_INIT_FUNCTIONS): the context they
# make is factor x the original table.
CONTEXT_EXTENDING_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")


def rotary_context(config) -> tuple[int, str] | None:
    """(the longest context a rotary model's positions are made for, how it was read from config.json), or None for a
    model without rotary positions (learned tables: check_positions; ALiBi). Rope scaling counts: YaRN, linear,
    dynamic, LongRoPE and Llama 3's scaling reach factor x original_max_position_embeddings."""
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    rotary = rope is not None or any(getattr(text, name, None) is not None for name in (
        "rope_theta", "rotary_dim", "rotary_pct", "partial_rotary_factor", "rotary_emb_base"))
    if not isinstance(positions, int) or not rotary or getattr(text, "alibi", False):  # Falcon's ALiBi variant
        return None
    if isinstance(rope, dict) and rope and all(isinstance(value, dict) for value in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))  # per layer type (Gemma 3)
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if kind in CONTEXT_EXTENDING_ROPE and isinstance(factor, (int, float)) and factor > 1:
        original = rope.get("original_max_position_embeddings") or getattr(
            text, "original_max_position_embeddings", None) or positions
        extended = int(original * factor)
        if extended > positions:
            return extended, (f"max_position_embeddings {positions}, {kind} rope scaling x{factor:g} of "
                              f"{original} → {extended}")
    return positions, f"max_position_embeddings {positions}" + (f", {kind} rope" if kind != "default" else "")


def position_warnings(path: str, config, stages: list) -> dict[str, list[str]]:
    """A --max_length past a rotary model's context: it runs (rotary positions have no table to run out of), but
    on positions the model never saw, which degrades what it learns and answers without any error."""
    found = rotary_context(config)
    warnings: dict[str, list[str]] = {}
    if found is None:
        return warnings
    context, how = found
    for stage in stages:
        max_length = stage.config.data.max_length
        if max_length > context:
            warnings[stage.name] = [
                f"--max_length {max_length} is past {path}'s context of {context} tokens ({how} in config.json): "
                f"rows longer than {context} train on positions the model never saw; lower --max_length to "
                f"{context}, or use a model (or rope scaling) made for longer context"]
    return warnings


def check_judge(judge: str) -> None:
    """--judge as a local reward model or a module:function: either is used only after training (or in a round), so a
    wrong path or name would cost the whole run. Checked before the tokenizer loads (src/pipeline/preflight.py
    check_sources): a typo is one line in well under a second, not after the training stack's imports."""
    if judge in ("auto", "none", EMBEDDED):
        return
    if FUNCTION_JUDGE.match(judge):  # the user's own function: imported now, so a typo costs no training
        load_function(judge)
        return
    path = Path(judge).expanduser()
    if not path.exists():
        if judge.startswith((".", "/", "~")) or judge.count("/") > 1:
            raise ModelError(f"--judge {judge}: no such directory (a reward model's directory or Hub id; or auto, "
                             f"none, {EMBEDDED})")
        return  # a Hub id
    if not any((path / name).exists() for name in ("config.json", "adapter_config.json")):
        raise ModelError(f"--judge {judge}: not a saved reward model (no config.json); pass the model directory a "
                         "reward stage saved (its model/final or model/merged)")


def load_config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as error:  # missing, not JSON, unknown model type, remote code refused
        raise ModelError(f"--model_name_or_path {path}: could not read its config.json ({first_line(error)}); "
                         "check the model type, or pass --trust_remote_code for a model that ships its own code"
                         ) from None


def check_causal(path: str, config, causal_stages: list[str]) -> None:
    """Refuse a model that is not a decoder-only causal LM for the stages that train one (`causal_stages`: their
    names, as the message says them)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", "?")
    classifiers = " or ".join(f"--stage {name}" for name, row in OBJECTIVES.items() if not row.causal_lm)
    advice = (f"{' and '.join(causal_stages)} {'trains' if len(causal_stages) == 1 else 'train'} a decoder-only causal "
              f"LM (Llama, Qwen, Mistral, ...): pass one, or train this model as a reward model with {classifiers}")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"--model_name_or_path {path}: a {model_type} model is an encoder-decoder; {advice}")
    # BERT-like types have a causal-LM class too (BertLMHeadModel) that is only causal with is_decoder=True; a masked-LM
    # checkpoint loaded through it attends to the tokens it predicts, so every log-prob and DPO number is meaningless.
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not (getattr(config, "is_decoder", False)
                                                                or getattr(config, "causal", False)):  # XLM's CLM
        raise ModelError(f"--model_name_or_path {path}: a {model_type} model is encoder-only (it sees the tokens it "
                         f"would predict); {advice}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and \
            "AutoModelForCausalLM" not in (getattr(config, "auto_map", None) or {}):
        raise ModelError(f"--model_name_or_path {path}: transformers has no causal language model class for model "
                         f"type {model_type!r}; {advice}")


def check_vocabulary(path: str, config, tokenizer, chat_template_path: str | None) -> None:
    if chat_template_path and not is_jinja_file(chat_template_path):
        return  # TRL's clone_chat_template resizes the embeddings to the tokenizer (src/models.py)
    embeddings = getattr(config.get_text_config(), "vocab_size", None)
    token_ids = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if embeddings is not None and token_ids > embeddings:
        raise ModelError(
            f"--model_name_or_path {path}: its tokenizer has {token_ids} token ids but the model's embeddings hold "
            f"{embeddings} (vocab_size in config.json): tokens were added to the tokenizer without resizing the model "
            "(model.resize_token_embeddings(len(tokenizer)), then save both), or the tokenizer belongs to another model"
        )


def check_chat_template(path: str, tokenizer, chat_template_path: str | None) -> None:
    """A template that does not compile fails at the first chat row; name where it came from instead."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return
    from jinja2 import TemplateError
    # transformers' own environment: its extensions ({% generation %}, loop controls) are part of the language.
    _compile_jinja_template = compile_jinja_template()

    where = f"--chat_template_path {chat_template_path}" if chat_template_path else \
        f"--model_name_or_path {path}: its chat template"
    for text in template.values() if isinstance(template, dict) else [template]:
        try:
            _compile_jinja_template(text)
        except TemplateError as error:
            line = f" at template line {error.lineno}" if getattr(error, "lineno", None) else ""
            raise ModelError(f"{where} is not valid Jinja ({first_line(error)}{line}); fix the template") from None


def check_vision_model(path: str, config, run_config: Config, stages: list) -> None:
    """A vision-language model: a family proven here (src/vision.py FAMILIES), for stages whose objective takes images
    (its row's `takes_images`: SFT and DPO) on DDP or one process, without the options not yet proven with images.
    Each refusal is one line naming what works instead."""
    reason = vision.refusal(config)
    if reason:
        raise ModelError(f"--model_name_or_path {path}: a vision-language model, {reason}")
    takes = [name for name, row in OBJECTIVES.items() if row.training.takes_images]
    for stage in stages:
        if not objective(stage.name).training.takes_images:
            raise ModelError(f"--model_name_or_path {path} is a vision-language model ({config.model_type}), and "
                             f"{objective(stage.name).display_name} does not train one yet: use --stage "
                             f"{' or '.join(takes)} (sft_then_dpo), or a text model")
    engine = requested_engine()
    # SFT's packing and padding-free forwards (TRL's: refused for image data); DPO's packed forward is its own default
    sft = any(objective(stage.name).data_shape == SEQUENCES for stage in stages)
    options = [("--rounds", run_config.dpo.rounds), ("--load_in_4bit", run_config.model.load_in_4bit),
               ("--chat_template_path", run_config.model.chat_template_path),
               ("--tools", getattr(run_config.training, "tools", None)),
               ("--packing", sft and run_config.trl_overrides.get("packing")),
               ("--padding_free", sft and run_config.trl_overrides.get("padding_free")),
               (f"{engine.title} (STRATEGY={engine.key})" if engine else "", engine is not None),
               (f"--judge {run_config.training.judge} (a reward model reads the answers' text, not the images)",
                run_config.training.judge not in ("auto", "none", EMBEDDED)
                and not FUNCTION_JUDGE.match(run_config.training.judge))]
    for flag, value in options:
        if value:
            raise ModelError(f"{flag} with a vision-language model ({config.model_type}): not verified with images "
                             "yet; what trains one: --stage sft, dpo or sft_then_dpo on DDP (or one process), full or "
                             "LoRA, padded")


def meta_model(config, causal: bool, trust_remote_code: bool, path: str = "", attn_implementation: str | None = None):
    """The model as the stage loads it, built on the meta device: its modules without weights or memory. Building it
    runs transformers' own checks of --attn_implementation (a name it knows, its package installed, a GPU for
    FlashAttention), which otherwise fail after the data is prepared, as an ImportError traceback for FlashAttention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model_class = vision.model_class(config) or (AutoModelForCausalLM if causal else AutoModelForSequenceClassification)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        with torch.device("meta"):
            return model_class.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    except (ValueError, ImportError) as error:
        if attn_implementation and any(word in str(error).lower() for word in ("attn", "attention")):
            reason = first_line(error).rstrip(".")
            raise ModelError(f"--attn_implementation {attn_implementation}: {reason}; use sdpa (the default) or "
                             "eager") from None
        if not causal and isinstance(error, ValueError):  # a type with no sequence-classification head
            raise ModelError(f"--model_name_or_path {path}: transformers has no sequence-classification (reward "
                             f"model) class for model type {getattr(config, 'model_type', '?')!r}: pick another "
                             "model") from None
        raise


def check_positions(path: str, built, positions: int, max_length: int) -> None:
    """A model with learned absolute positions (GPT-2, OPT, ...) has no embedding for a position past its table: an
    `IndexError` in the first batch that long. Rotary models run past max_position_embeddings: position_warnings."""
    import torch

    tokens = built.get_input_embeddings()
    # OPT's table has 2 extra rows (its positions start at 2).
    learned = [name for name, module in built.named_modules() if isinstance(module, torch.nn.Embedding)
               and module is not tokens and positions <= module.num_embeddings <= positions + 2]
    if learned:
        raise ModelError(f"--max_length {max_length}: {path} has learned positions for {positions} tokens only "
                         f"(max_position_embeddings in config.json); lower --max_length to {positions} or less")


def module_names(built, causal: bool) -> dict[str, str]:
    """{module name: class name} of a (meta) model, without its output head."""
    # PEFT never adapts the output head under all-linear; listing it as a choice would invite a 100M-parameter adapter.
    head = built.get_output_embeddings() if causal else None
    return {name: type(module).__name__ for name, module in built.named_modules()
            if name and module is not head}


# What LoRA can adapt: peft 0.21's LoraModel._create_new_module dispatch (4-bit layers are nn.Linear before loading).
LORA_LAYER_TYPES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention")


def check_lora_targets(path: str, built, model: ModelArguments, causal: bool) -> None:
    """--lora_target_modules against the (meta) model's module names, with PEFT's matching rule: a string is a regular
    expression over the whole module name, each name of a list matches a module of that name or ending in '.name'."""
    targets = model.lora_target_modules
    if targets is None or (isinstance(targets, str) and targets.lower() == ALL_LINEAR):
        return
    modules = module_names(built, causal)
    linear = sorted({name.rsplit(".", 1)[-1] for name, kind in modules.items() if kind in ("Linear", "Conv1D")})
    choices = f"its linear layers are {', '.join(linear)}: use those names, or {ALL_LINEAR}"
    if isinstance(targets, str):
        try:
            matched = [name for name in modules if re.fullmatch(targets, name)]
        except re.error as error:
            raise ModelError(f"--lora_target_modules {targets}: not a valid regular expression ({error}); "
                             f"{choices}") from None
        unmatched = [] if matched else [targets]
    else:
        matched, unmatched = [], []
        for target in targets:
            found = [name for name in modules if name == target or name.endswith(f".{target}")]
            matched += found
            if not found:
                unmatched.append(target)
    if unmatched:
        close = difflib.get_close_matches(unmatched[0], linear, n=1, cutoff=0.85)  # v_pro, not nope_proj
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ModelError(f"--lora_target_modules {' '.join(unmatched)}: matches no module of {path}{hint}; {choices}")
    unsupported = [name for name in matched if modules[name] not in LORA_LAYER_TYPES]
    if unsupported:
        raise ModelError(f"--lora_target_modules: {unsupported[0]} is a {modules[unsupported[0]]}, which LoRA cannot "
                         f"adapt; {choices}")
