"""Models and tokenizers: where they come from, how each rank loads them, and how the result is saved.

- A Hub id or a local directory; `trust_remote_code` only when asked.
- LoRA through peft (TRL wraps the model from `peft_config`; the DPO reference is the base with adapters disabled).
- A reward model is the same checkpoint with a one-output score head (AutoModelForSequenceClassification); under
  LoRA the head is trained and saved in full beside the adapters (peft's SEQ_CLS task).
- 4-bit NF4 (QLoRA) through bitsandbytes, each rank loading onto its own device: `device_map={"": local device}`,
  never "auto", which would spread one copy over every GPU and fight DDP.
- A vision-language model (src/vision.py says which) loads through its image-text-to-text class with its processor
  (`load_processing`), its vision tower frozen unless --train_vision_tower, and is saved with its processor.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from src import vision
from src.config import EMBEDDED, ModelArguments
from src.config_error import ConfigError
from src.plan import Plan
from src.world import World
from src.distributed import barrier, manifest_across_ranks, print0
from src.embedded.model import ensure_embedded_model
from src.engines import FSDP, loads_sharded, partitioned_loading, sharded
from src.sharded_weights import load_sharded, resize_draws, save_adapter, save_whole
from src.run_safety import hang_watch
from src.run_files import MODEL_CARD, PLOTS_DIR
from src.run_safety.checkpoint_manifest import remove_marker, write_marker
from src.run_safety.disk_space import WriteFailed, fail_write_if_injected, noticed_write_failure, write_failures_noted


class ModelError(ValueError):
    """A model that cannot be found, read or run as asked: one line, no traceback."""


def resolve_model_path(model: ModelArguments, embedded_reasoning: bool = False) -> str:
    """A local directory or Hub id to load from; the embedded default (its reasoning variant) is built (once) on
    first use."""
    name = model.model_name_or_path
    if name == EMBEDDED:
        return str(ensure_embedded_model(embedded_reasoning))
    path = Path(name).expanduser()
    if path.exists():
        if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
            base = _adapter_base(path)
            raise ModelError(f"--model_name_or_path {name} is a LoRA adapter, not a model: pass its merged model "
                             f"(model/merged/, --merge_adapter), or merge it into its base{base} with peft's "
                             "merge_and_unload and pass that")
        if not (path / "config.json").exists():
            raise ModelError(f"--model_name_or_path {name}: the directory has no config.json (not a saved model)")
        check_weight_files(path)
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelError(f"--model_name_or_path {name}: no such directory")
    return name


def _adapter_base(path: Path) -> str:
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return ""
    return f" ({base})" if base else ""


def check_weight_files(path: Path) -> None:
    """A local model's weight files are there and whole, checked before any process group or load: every shard an
    index names exists, and each safetensors file's header parses and accounts for the file's exact size (a copy
    cut short, or a git-lfs pointer in place of the weights, fails here in milliseconds, not on every rank later)."""
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    if (path / "adapter_config.json").exists() and not files:
        files = sorted(path.glob("adapter_model.*"))
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            raise ModelError(f"--model_name_or_path {path}: {index.name} is not a valid shard index") from None
        missing = sorted(shard for shard in shards if not (path / shard).exists())
        if missing:
            raise ModelError(f"--model_name_or_path {path}: {index.name} names shards that are missing: "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (an incomplete download?)")
    if not files:
        raise ModelError(f"--model_name_or_path {path}: no weights (*.safetensors or pytorch_model*.bin) in the "
                         "directory")
    for file in files:
        if file.suffix == ".safetensors":
            problem = _safetensors_problem(file)
            if problem:
                raise ModelError(f"--model_name_or_path {path}: {file.name} is corrupt ({problem}); download or save "
                                 "the model again")


def _safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be whole, or None. The format: 8-byte little-endian header length, a JSON
    header of tensor offsets, then the data, which ends exactly at the largest offset."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than a header"
        header_length = int.from_bytes(prefix, "little")
        if header_length > size - 8:
            return "its header runs past the end of the file"
        try:
            header = json.loads(handle.read(header_length))
        except (ValueError, UnicodeDecodeError):
            return "its header is not valid JSON"
    if not isinstance(header, dict):
        return "its header is not a table of tensors"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + header_length + max(ends, default=0)
    if size != expected:
        return f"{size} bytes where its header describes {expected}: truncated" if size < expected else \
            f"{size - expected} bytes more than its header describes"
    return None


def load_tokenizer(path: str, trust_remote_code: bool = False, local_files_only: bool = False):
    """The model's tokenizer as every stage uses it (`local_files_only`: from a directory or the Hub cache, no
    download)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                  local_files_only=local_files_only)
    except (OSError, ValueError) as error:  # ValueError: no tokenizer file it can build a fast tokenizer from
        if Path(path).is_dir() and not any((Path(path) / name).exists()
                                           for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ModelError(f"--model_name_or_path {path}: no tokenizer files (tokenizer.json, tokenizer.model or "
                             "vocab.json) in the directory; save the tokenizer beside the model "
                             "(tokenizer.save_pretrained)") from None
        raise ModelError(f"--model_name_or_path {path}: could not load its tokenizer ({first_line(error)})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # what TRL does too; padded positions are masked out
    return tokenizer


def load_processing(path: str, model: ModelArguments, local_files_only: bool = False):
    """A vision-language model's processing (src/vision.py ImageProcessing: its processor, whose tokenizer every stage
    tokenizes with), or None for a text model; a vision family not proven here is refused before its processor is
    built (one line: its cause, the families that work)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code,
                                            local_files_only=local_files_only)
    except (OSError, ValueError, KeyError):
        return None  # the model-side checks name what is wrong with its config.json
    if not vision.is_vision_config(config):
        return None
    reason = vision.refusal(config)
    if reason:
        raise ModelError(f"--model_name_or_path {path}: a vision-language model, {reason}")
    return vision.ImageProcessing(vision.load_processor(path, model.trust_remote_code, local_files_only))


def is_jinja_file(path: str) -> bool:
    return Path(path).is_file() and path.endswith((".jinja", ".j2"))  # TRL's own test (SFTTrainer)


def apply_chat_template_path(tokenizer, path: str | None):
    """The tokenizer half of --chat_template_path, before any data is tokenized: a Jinja file's template, or a source
    tokenizer's template, its added (special) tokens and its EOS, as TRL's clone_chat_template sets them."""
    if not path:
        return tokenizer
    if is_jinja_file(path):
        tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
        return tokenizer
    from transformers import AutoTokenizer

    try:
        source = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelError(f"--chat_template_path {path}: neither a .jinja/.j2 file nor a tokenizer directory or Hub id "
                         f"({first_line(error)})") from None
    if not source.chat_template:
        raise ModelError(f"--chat_template_path {path}: that tokenizer has no chat template to copy")
    tokenizer.chat_template = source.get_chat_template()
    vocabulary = tokenizer.get_vocab()
    tokenizer.add_tokens([token for token in source.added_tokens_decoder.values() if token.content not in vocabulary])
    tokenizer.eos_token = source.eos_token
    return tokenizer


def apply_chat_template_to_model(model, tokenizer, path: str | None, precision: str, seed: int):
    """The model half of --chat_template_path (every stage, DPO included, whose TRL trainer has no such option):
    TRL's clone_chat_template resizes the embeddings for the tokens the template brought and sets the EOS id (under
    ZeRO-3 transformers resizes the partitioned embeddings as such while it sees the launch's config; a model sharded
    as it loaded under FSDP2 has its new size already: `load_model`'s `resize`). The rows the resize adds are drawn
    from `seed` (`resize_draws`): the same on every rank and engine, and for a reference as for its policy."""
    if not path or is_jinja_file(path):
        return model
    from trl import clone_chat_template

    with partitioned_loading(precision), resize_draws(seed, next(model.parameters()).device):
        model, _, _ = clone_chat_template(model, tokenizer, path)
    return model


def resized_vocabulary(tokenizer, path: str | None) -> int | None:
    """The embeddings' rows --chat_template_path gives the model (TRL's clone_chat_template: the tokenizer's
    vocabulary with the template's tokens added, rounded up to its multiple, 64); None without one or for a Jinja
    file, which adds no tokens."""
    if not path or is_jinja_file(path):
        return None
    import inspect

    from trl import clone_chat_template

    multiple = inspect.signature(clone_chat_template).parameters["resize_to_multiple_of"].default
    return -(-len(tokenizer.vocab) // multiple) * multiple


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def quantization_config(model: ModelArguments, plan: Plan):
    """NF4 with double quantization for QLoRA; compute in the run's precision."""
    if not model.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model.use_bnb_nested_quant,
        bnb_4bit_compute_dtype=torch_dtype(plan.precision),
    )


def check_4bit_supported(plan: Plan) -> None:
    """bitsandbytes' 4-bit kernels: CUDA, or its CPU backend. Fail before loading anything if neither can run."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as error:  # a broken native library raises more than ImportError
        raise ConfigError(f"--load_in_4bit: bitsandbytes cannot be imported here ({first_line(error)})") from None


def load_model_for_audit(path: str, model: ModelArguments):
    """The model in 16-bit on a GPU where there is one (fp32 on CPU), for scoring pairs only (`python -m src.audit`)."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=model.trust_remote_code,
                                                      dtype=torch.bfloat16 if cuda else torch.float32)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as error:
        raise ModelError(f"--model_name_or_path {path}: could not load the model ({first_line(error)})") from None
    return loaded.to("cuda" if cuda else "cpu").eval()


def load_model(path: str, model: ModelArguments, plan: Plan, world: World, reward_pad_token_id: int | None = None,
               adapters=None, resize=None):
    """The policy for this rank, on this rank's device. Full fine-tuning keeps fp32 master weights (mixed precision
    autocasts the compute); a 4-bit base is quantized on load.

    With `reward_pad_token_id`, a reward model instead: the checkpoint (a causal LM, or a reward model) with a score
    head of one output, new and randomly initialised where the checkpoint has none. It scores the last token that is
    not padding, so it is told the padding id.

    `adapters` (a peft config, the run's seed): where the model loads sharded under FSDP2, its LoRA adapters are added
    as it loads, before it is sharded (src/sharded_weights.py `with_adapters`); the model returned has them then, and
    TRL must not add them again. Elsewhere TRL adds them. `resize` ((rows, seed): --chat_template_path's vocabulary,
    src/pipeline/training.py `stage_resize`): where the model loads sharded under FSDP2, it is built with that many
    token rows, the new ones drawn as transformers' resize draws them (src/sharded_weights.py `resized_reader`);
    elsewhere `apply_chat_template_to_model` resizes it after the load."""
    from contextlib import nullcontext

    import torch
    from transformers import AutoModelForSequenceClassification
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    kwargs = {"trust_remote_code": model.trust_remote_code, "dtype": torch.float32}
    model_class = _model_class(path, model, reward_pad_token_id, kwargs)
    if model.attn_implementation:
        kwargs["attn_implementation"] = model.attn_implementation
    quantization = quantization_config(model, plan)
    if quantization is not None:
        check_4bit_supported(plan)
        kwargs["quantization_config"] = quantization
        kwargs["dtype"] = torch_dtype(plan.precision)
        kwargs["device_map"] = {"": world.local_rank if plan.device == "cuda" else "cpu"}
    # Loading a causal LM as a classifier reports its new score head and unused LM head: expected, TRL hides it too.
    loading = suppress_seqcls_warning() if model_class is AutoModelForSequenceClassification else nullcontext()
    engine = loads_sharded(world.world_size) if quantization is None else None
    partitioning = engine is not None and engine.name != FSDP  # ZeRO-3 builds the model inside deepspeed.zero.Init
    try:
        # A download takes what it takes; under FSDP2 and ZeRO-3 each rank reads only its share of the weights.
        with loading, hang_watch.phase("model", str(path), hang_watch.UNWATCHED):
            loaded = load_shares(path, model_class, kwargs, plan, world, engine, adapters, resize) if engine else None
            if loaded is None:
                with partitioned_loading(plan.precision) as partitioning:
                    loaded = model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as error:
        fix = "; its code may not build under deepspeed.zero.Init: set zero3_init_flag: false in the launch config " \
              "(every rank then loads it whole)" if partitioning and isinstance(error, RuntimeError) else ""
        raise ModelError(f"--model_name_or_path {path}: could not load the model ({first_line(error)}){fix}") from None
    if quantization is not None:
        check_4bit_runs(loaded, path, plan)
    if plan.device == "cuda" and quantization is None and not sharded(loaded.parameters()):
        loaded.to(torch.device("cuda", world.local_rank))  # ZeRO-3's and FSDP2's shares are on the device already
    if vision.is_vision_config(loaded.config) and not model.train_vision_tower:
        vision.freeze_vision_tower(loaded)  # the language model learns; the tower and projector stay as they are
    return loaded


def _model_class(path: str, model: ModelArguments, reward_pad_token_id: int | None, kwargs: dict):
    """The class the model loads with: a reward model's sequence classifier (told the padding id, one output), a
    vision-language model's image-text-to-text class (src/vision.py), else a causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if reward_pad_token_id is not None:
        kwargs.update(num_labels=1, pad_token_id=reward_pad_token_id)
        return AutoModelForSequenceClassification
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return AutoModelForCausalLM  # from_pretrained names what is wrong
    return vision.model_class(config) or AutoModelForCausalLM


def load_shares(path: str, model_class, kwargs: dict, plan: Plan, world: World, engine, adapters=None, resize=None):
    """Under FSDP2 and ZeRO-3 (`engines.loads_sharded`): the model with each rank holding, and having read, only its
    share of the weights (src/sharded_weights.py); None where it loads whole instead (said in one line where the
    checkpoint is why)."""
    import torch

    device = torch.device("cuda", world.local_rank) if plan.device == "cuda" else torch.device("cpu")
    fsdp = engine.name == FSDP  # under ZeRO-3 TRL adds the adapters, and transformers resizes the embeddings
    loaded, why_not = load_sharded(path, model_class, kwargs, plan.precision, device, engine,
                                   adapters if fsdp else None, resize if fsdp else None)
    if why_not:
        print0(f"  warning: {path} loads whole on every rank under {engine.title}: {why_not}")
    return loaded


def check_4bit_runs(loaded, path: str, plan: Plan) -> None:
    """bitsandbytes packs 4-bit weights lazily, at the first forward: one runs now so an unsupported layout fails
    here with a clear message instead of inside generation or the first training step."""
    import torch

    keep_4bit_layers_trainable(loaded)
    try:
        with torch.no_grad():
            loaded(input_ids=torch.zeros((1, 1), dtype=torch.long, device=loaded.device))
    except (RuntimeError, ValueError) as error:
        hint = "its CPU kernels need layer widths that are multiples of 64 — use a GPU, or drop --load_in_4bit" \
            if plan.device == "cpu" else "check the bitsandbytes install (python -m bitsandbytes)"
        raise ModelError(f"--load_in_4bit: bitsandbytes could not run {path} in 4 bits ({first_line(error)}); "
                         f"{hint}") from None


def keep_4bit_layers_trainable(model) -> None:
    """Keep every 4-bit layer on bitsandbytes' trainable path (dequantize, then a differentiable matmul).

    On a CPU with AVX512-BF16, bitsandbytes 0.50 converts a 4-bit layer's weights, at its first forward in eval mode
    without gradients (the load check below, the held-out answers before training), to an inference-only layout for
    its `gemv_4bit` kernel, and keeps using that layout once training starts. That kernel has no backward: gradients
    reaching the adapters below a 4-bit layer are wrong (torch warns "an autograd kernel was not registered"), and
    where the layer has a bias (the Qwen2 family's q/k/v projections) under gradient checkpointing, training stops in
    `matmul_4bit` at `result += bias` ("a view of a leaf Variable that requires grad is being used in an in-place
    operation"). Both forwards (padded and packed DPO, SFT) go through these layers, so the fix is here, once."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # bitsandbytes.nn.Linear4bit
            module.support_avx512bf16_for_cpu = False


def peft_config(model: ModelArguments, reward_model: bool = False):
    """TRL's own LoRA config from the model arguments (None without --use_lora). For a reward model the task is
    SEQ_CLS, which makes peft train and save the new score head in full (modules_to_save), not leave it random."""
    from trl import get_peft_config

    config = get_peft_config(model)
    if config is not None and reward_model:
        config.task_type = "SEQ_CLS"
    return config


def verify_adapter(adapter_dir: Path, model) -> None:
    """Read a saved LoRA adapter back and check every tensor has the shape the model's adapter has. Under DeepSpeed
    ZeRO-3 adapters have been saved as empty shards (a known TRL/peft failure); this catches that at save time, not
    when someone loads the model."""
    from peft.utils import load_peft_weights

    try:
        saved = load_peft_weights(str(adapter_dir))
    except Exception as error:  # a file that does not parse is the failure being looked for
        raise ModelError(f"{adapter_dir}: the saved LoRA adapter does not load ({first_line(error)})") from None
    expected = {name: tuple(getattr(param, "ds_shape", param.shape)) for name, param in model.named_parameters()
                if "lora_" in name}
    if not saved:
        raise ModelError(f"{adapter_dir}: the LoRA adapter was saved with no tensors")
    for key, tensor in saved.items():
        want = next((shape for name, shape in expected.items() if name.replace(".default", "").endswith(key.replace(
            "base_model.model.", ""))), None)
        if tensor.numel() == 0 or (want is not None and tuple(tensor.shape) != want):
            raise ModelError(f"{adapter_dir}: LoRA tensor {key} was saved as {tuple(tensor.shape)}"
                             f"{f', expected {want}' if want else ''} (empty shards: under ZeRO-3 set "
                             "zero3_save_16bit_model: true in the accelerate config)")


# A dropout probability, whatever the family calls it: dropout, attention_dropout, resid_pdrop, hidden_dropout_prob,
# layerdrop, drop_path_rate, ...
DROPOUT_FIELD = re.compile("drop", re.IGNORECASE)


class DropoutOff:
    """Every dropout a model applies, at 0 for DPO (TRL's `disable_dropout`, the default): TRL zeroes `nn.Dropout`
    modules only, but many families pass a probability to a functional dropout at run time: stored on a module
    (OPT's `self.dropout`, every attention module's `attention_dropout`) or read from the config (Persimmon's
    `self.config.attention_dropout`). Both are set to 0 here. The config's own values are what a saved model must keep,
    so `restored()` puts them back around every save, and `restore()` for good when training ends."""

    def __init__(self, model):
        from transformers import PreTrainedConfig

        self.config_fields: list[tuple[object, str, float]] = []
        configs = {id(module.config): module.config for module in model.modules()
                   if isinstance(getattr(module, "config", None), PreTrainedConfig)}
        for config in list(configs.values()):  # and their sub-configs (text_config, ...)
            for value in vars(config).values():
                if isinstance(value, PreTrainedConfig):
                    configs.setdefault(id(value), value)
        for config in configs.values():
            for name, value in vars(config).items():
                if _is_probability(name, value):
                    self.config_fields.append((config, name, value))
        self.module_fields = 0
        for module in model.modules():
            if isinstance(getattr(module, "p", None), float) and "Dropout" in type(module).__name__:
                module.p = 0.0
            for name, value in list(vars(module).items()):
                if _is_probability(name, value):
                    setattr(module, name, 0.0)
                    self.module_fields += 1
        self._zero()

    def _zero(self) -> None:
        for config, name, _ in self.config_fields:
            setattr(config, name, 0.0)

    def restore(self) -> None:
        for config, name, value in self.config_fields:
            setattr(config, name, value)

    @contextlib.contextmanager
    def restored(self):
        self.restore()
        try:
            yield
        finally:
            self._zero()


def _is_probability(name: str, value) -> bool:
    return isinstance(value, float) and not isinstance(value, bool) and 0.0 < value < 1.0 and \
        DROPOUT_FIELD.search(name) is not None


def write_trained(trainer, model, directory: Path, is_main: bool) -> None:
    """Every rank: the trained model (its adapter only under LoRA) into `directory`. Where an engine shards it (FSDP2,
    ZeRO-3) no process gathers it whole: rank 0 writes it a tensor at a time (src/sharded_weights.py `save_whole`,
    `save_adapter`), its config and dropout as the Trainer's save writes them; elsewhere the Trainer's own save."""
    from peft import PeftModel

    if not sharded(model.parameters()):
        trainer.save_model(str(directory))
        return
    with dropouts_restored(trainer):
        (save_adapter if isinstance(model, PeftModel) else save_whole)(model, directory, is_main)
    if is_main:
        import torch

        torch.save(trainer.args, directory / "training_args.bin")  # the Trainer's save writes it beside the model


@contextlib.contextmanager
def dropouts_restored(trainer):
    """The model's own dropout values in its config while it is saved (DPO's trainers zero them: `DropoutOff`)."""
    with contextlib.ExitStack() as stack:
        for dropout in getattr(trainer, "dropout_off", []):
            stack.enter_context(dropout.restored())
        yield


def save_final_model(trainer, tokenizer, output_dir: Path, merge_adapter: bool, is_main: bool) -> dict[str, str]:
    """Save the trained model (adapter only under LoRA) with its tokenizer, and a merged copy on request; return
    where each went. Each directory gets a `.complete` marker with its manifest, as a checkpoint does, which guards
    its copy and push (src/publish.py). Every rank must call this (saving can gather sharded weights, every rank
    hashes its share of what was saved); rank 0 writes."""
    from peft import PeftModel

    final_dir, merged_dir = output_dir / "final", output_dir / "merged"
    model = trainer.accelerator.unwrap_model(trainer.model)
    merge = merge_adapter and isinstance(model, PeftModel)
    saved = [final_dir, merged_dir] if merge else [final_dir]
    paths = {"final_model": str(final_dir)} | ({"merged_model": str(merged_dir)} if merge else {})
    # Rank 0's failed write is noted, not raised alone: every rank stops together at the barrier below.
    with write_failures_noted(final_dir):
        if is_main:
            for directory in saved:  # saved again after a resumed end: the old manifest would not describe it
                if directory.is_dir():
                    remove_marker(directory)
            fail_write_if_injected(final_dir / "model.safetensors")
        write_trained(trainer, model, final_dir, is_main)
    streamed_merge = merge and sharded(model.parameters())
    # A vision-language model's processor (its trainer's processing class) is saved whole: image settings, chat
    # template and tokenizer.
    saved_with = trainer.processing_class if hasattr(trainer.processing_class, "image_processor") else tokenizer
    if is_main and noticed_write_failure() is None:
        with write_failures_noted(final_dir):
            saved_with.save_pretrained(final_dir)
            if isinstance(model, PeftModel):
                verify_adapter(final_dir, model)
            if merge and not streamed_merge:
                model.merge_and_unload(safe_merge=True).save_pretrained(merged_dir)
                saved_with.save_pretrained(merged_dir)
    barrier()
    if streamed_merge:  # every rank: each adapted weight gathered and merged in turn, rank 0 writing it
        with write_failures_noted(merged_dir), dropouts_restored(trainer):
            save_whole(model, merged_dir, is_main)
            if is_main:
                saved_with.save_pretrained(merged_dir)
        barrier()
    for directory in saved:
        # Not its card and plots (PEFT writes a card of its own here): the run's card replaces it, and is rewritten
        # at each relaunch and publish (src/reporting/model_card.py).
        manifest, unreadable = manifest_across_ranks(directory, World.from_environment(), (MODEL_CARD, PLOTS_DIR))
        if unreadable:
            raise WriteFailed(f"reading back {directory} to record its checksums failed ({unreadable}): check the "
                              "storage, then relaunch the same command")
        if is_main:
            with write_failures_noted(directory):
                write_marker(directory, manifest)
    barrier()
    return paths
