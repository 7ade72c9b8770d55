"""Vision-language models: what differs between their families, in one place; the rest of the toolkit asks it.

    processing = ImageProcessing(load_processor(path))   # a VLM's processor (None: a text model, no images)
    processing.prompt_ids(rendered_prompt, images)        # the prompt's ids, each image placeholder expanded
    processing.image_inputs([images of each row])         # pixel_values (+ pixel_attention_mask, image_grid_thw, ...)
    processing.token_inputs(input_ids)                    # per-token inputs the family reads (Gemma 3's token_type_ids)

Images are a property of the data and the model, not a branch through the pipeline: data preparation, the collators,
generation and saving ask this module, never a family's name. The processor does each family's own work (how many
tokens an image becomes, how it is cut into tiles, which tensors its model reads); what the processor cannot say is
here:
- which model types are vision-language (transformers' image-text-to-text mapping) and which of them the toolkit has
  proven (FAMILIES: tests/test_vision.py trains each, tiny, built offline); any other is refused with its cause;
- the processor loaded beside the model, its chat template (the one that places image parts) given to its tokenizer;
- the vision tower: the weights outside the language model and its output head (`vision_modules`), frozen unless
  --train_vision_tower (`freeze_vision_tower`) and left out of LoRA (`lora_for`);
- `ImageCollator`: a trainer's padded batch with its examples' images processed, as TRL's vision collators add them.

Light at import: torch, PIL and transformers are imported inside the functions that use them.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

from src.config_error import ConfigError

# The prepared data's column of a row's images, each the bytes of an image file (PNG, JPEG, ...), in the order their
# placeholders appear in the prompt. Not "images": TRL 1.16 reads that name as "process the images yourself" and then
# refuses the reference log-probs cache (src/trainers/dpo.py keeps it for image pairs too).
IMAGE_COLUMN = "image_bytes"

# Families proven by tests/test_vision.py (a tiny model of each, built offline: the prompt ids equal TRL's processor
# path, SFT and DPO train, the same numbers on 1 and 2 processes), with what their processor does with an image.
FAMILIES = {
    "llava": "LLaVA (a CLIP or SigLIP tower and a language model): an <image> becomes its patch tokens",
    "idefics3": "Idefics3 and SmolVLM v1: an <image> becomes its tiles' tokens between <fake_token_around_image>",
    "gemma3": "Gemma 3: <start_of_image> becomes the image's soft tokens; token_type_ids mark them",
}
# Known causes for families that cannot run here.
REFUSED = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "smolvlm", "glm4v"),
                    "its processor has a video processor, which transformers 5.23 cannot build without torchvision "
                    "(VIDEO_PROCESSOR_MAPPING has no attribute _extra_content), and PyPI's torchvision 0.28.0 for "
                    "torch 2.13 is the CUDA build (its ops do not load beside the CPU torch): not verified here"),
}
NOT_VERIFIED = "not verified for training here (tests/test_vision.py has no tiny model of it)"
# Families of FAMILIES the packed, prefix-shared DPO forward (src/packed_dpo.py) does not run, with why; the others
# are proven exact against the padded forward in tests/test_vision.py (each prompt's images encoded once).
NOT_PACKED = {
    "gemma3": "its token_type_ids let an image's tokens attend to each other both ways, which the packed causal mask "
              "does not reproduce",
}
PACKED_PREFIX = "packed_image_"  # a packed batch's image tensors (ImageCollator), swapped in by src/packed_forward.py
# What a model's processor may return per token (the same length as input_ids): rebuilt from the ids for a padded
# batch (ImageProcessing.token_inputs); every other key it returns beside the ids is an image tensor.
TEXT_KEYS = ("input_ids", "attention_mask")
PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
# Where the processor's files are, any one of them (transformers' names; chat_template.* alone is not a processor).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def is_vision_config(config) -> bool:
    """A vision-language model: a model type of transformers' image-text-to-text mapping with a vision sub-config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and \
        getattr(config, "vision_config", None) is not None


def refusal(config) -> str | None:
    """Why the toolkit cannot train this vision-language model, or None (a family of FAMILIES)."""
    model_type = getattr(config, "model_type", "?")
    if model_type in FAMILIES:
        return None
    return f"{model_type}: {REFUSED.get(model_type, NOT_VERIFIED)}; verified: {', '.join(sorted(FAMILIES))}"


def packed_refusal(config) -> str | None:
    """Why the packed DPO forward cannot run this vision-language model, or None (its language model is then checked
    as any text model: src/packed_dpo_support.py)."""
    model_type = getattr(config, "model_type", "?")
    if model_type not in FAMILIES:
        return f"{model_type}: a vision-language model not verified here"
    if model_type in NOT_PACKED:
        return f"{model_type}: {NOT_PACKED[model_type]}"
    return None


def model_class(config):
    """The class a vision-language model loads with (its image-text-to-text head), else None (a text model)."""
    if not is_vision_config(config):
        return None
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def load_processor(path: str, trust_remote_code: bool = False, local_files_only: bool = False):
    """The processor saved beside a vision-language model, its chat template also its tokenizer's (the template that
    places image parts is the one every prompt renders with). One line when it is missing or cannot be built."""
    from transformers import AutoProcessor, ProcessorMixin

    where = Path(path)
    if where.is_dir() and not any((where / name).exists() for name in PROCESSOR_FILES):
        raise ConfigError(f"--model_name_or_path {path}: a vision-language model without its processor (no "
                          f"{' or '.join(PROCESSOR_FILES)}): save it beside the model (processor.save_pretrained), "
                          "as a stage here saves it")
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                  local_files_only=local_files_only)
    except (OSError, ValueError, AttributeError, KeyError) as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--model_name_or_path {path}: its processor cannot be built here ({text})") from None
    if not isinstance(processor, ProcessorMixin) or getattr(processor, "image_token", None) is None:
        raise ConfigError(f"--model_name_or_path {path}: its processor ({type(processor).__name__}) has no image "
                          "token: not a vision-language processor")
    if processor.chat_template:
        processor.tokenizer.chat_template = processor.chat_template
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token  # what TRL does too
    return processor


def thumbnail(data: bytes, longest: int = 256) -> bytes:
    """An image file's bytes → a PNG of it at most `longest` pixels a side (a report's picture of what was asked)."""
    image = decode(data).convert("RGB")
    image.thumbnail((longest, longest))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decode(data: bytes):
    """An image file's bytes → a PIL image, read whole (a truncated file fails here, not inside a collator)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


class ImageProcessing:
    """What the toolkit asks of a vision-language model's processor, one per process (built from the processor)."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder = processor.image_token  # what the chat template writes for an image part
        self._per_token_keys: tuple[str, ...] | None = None
        self._span_ids: set[int] | None = None  # an image's expansion's special tokens (last_image_position)
        self._image_ids: set[int] = set()

    def __getstate__(self):  # sent to datasets.map's workers: the processor pickles, the cached probe need not
        return {"processor": self.processor}

    def __setstate__(self, state):
        self.__init__(state["processor"])

    def fingerprint(self) -> str:
        """What decides the ids and tensors besides the tokenizer: the processor's class and settings."""
        settings = self.processor.to_dict() if hasattr(self.processor, "to_dict") else {}
        settings.pop("tokenizer", None)
        settings.pop("chat_template", None)
        return hashlib.sha256(json.dumps([type(self.processor).__name__, settings], sort_keys=True,
                                         default=str).encode()).hexdigest()[:16]

    def prompt_ids(self, text: str, images: list) -> list[int]:
        """A rendered prompt's ids with each image placeholder expanded to its image's tokens, as TRL's vision
        collators tokenize it (the processor on the template's text, no special tokens added)."""
        if not images:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(self.processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0])

    def image_inputs(self, images_per_row: list[list]) -> dict:
        """The image tensors of a batch whose rows hold these images (PIL), as the processor makes them for the model:
        the rows without images left out (the models read the images in order of their tokens); {} when none has any."""
        rows = [images for images in images_per_row if images]
        if not rows:
            return {}
        out = self.processor(text=[self.placeholder * len(images) for images in rows], images=rows,
                             padding=True, return_tensors="pt")
        return {key: value for key, value in out.items() if key not in TEXT_KEYS + PER_TOKEN_KEYS}

    def per_token_keys(self) -> tuple[str, ...]:
        """The per-token inputs this processor returns (Gemma 3's token_type_ids), each checked once to be what
        `create_mm_token_type_ids` rebuilds from the ids, so a padded batch can carry it exactly; refused otherwise."""
        if self._per_token_keys is None:
            from PIL import Image

            out = self.processor(text=[f"a{self.placeholder}b"], images=[[Image.new("RGB", (32, 32))]])
            keys = tuple(key for key in PER_TOKEN_KEYS if key in out)
            for key in keys:
                if list(out[key][0]) != self.processor.create_mm_token_type_ids([list(out["input_ids"][0])])[0]:
                    raise ConfigError(f"{type(self.processor).__name__}'s {key} is not rebuilt from the ids by "
                                      "create_mm_token_type_ids: not verified for training here")
            self._per_token_keys = keys
        return self._per_token_keys

    def token_inputs(self, input_ids) -> dict:
        """The per-token inputs of a (padded) batch of ids: 1 where an image's token is (0 on padding and answers)."""
        import torch

        return {key: torch.tensor(self.processor.create_mm_token_type_ids(input_ids.tolist()),
                                  dtype=input_ids.dtype, device=input_ids.device) for key in self.per_token_keys()}

    def image_token_count(self, ids: list[int]) -> int:
        """The tokens of `ids` the model fills with image features (the processor's image_token_ids)."""
        image_ids = set(self.processor.image_token_ids) - {None}
        return sum(1 for token in ids if token in image_ids)

    def last_image_position(self, ids: list[int]) -> int:
        """The position of the last token of the last image (-1: none): its last image token (what the model counts
        against the image's features: the processor's image_token_ids) and the special tokens its expansion closes
        with (Idefics3's <fake_token_around_image>, Gemma 3's <end_of_image>). A row cut before it would keep an
        image's features without all of its tokens."""
        if self._span_ids is None:
            from PIL import Image

            expansion = self.prompt_ids(self.placeholder, [Image.new("RGB", (32, 32))])
            self._image_ids = set(self.processor.image_token_ids) - {None}
            self._span_ids = self._image_ids | (set(expansion) & set(self.tokenizer.all_special_ids))
        last = max((position for position, token in enumerate(ids) if token in self._image_ids), default=-1)
        while 0 <= last < len(ids) - 1 and ids[last + 1] in self._span_ids:
            last += 1
        return last


@dataclass
class ImageCollator:
    """A trainer's collator (TRL's padded batch of token ids) with its examples' images: each example's images decoded
    from IMAGE_COLUMN and processed for every padded row the example fills (DPO: its chosen and its rejected row, as
    TRL's DataCollatorForVisionPreference repeats them), and the per-token inputs rebuilt for the padded ids."""

    collator: object
    processing: ImageProcessing
    # The packed DPO forward (src/packed_forward.py PackedDPOForward) when the collator packs: once its first-batch check
    # passed, TRL's padded batch goes without its (repeated) images, which only the padded forward reads
    packed_forward: object = None

    def __getattr__(self, name):  # pad_token_id, max_length, ... of the collator it wraps
        if name in ("collator", "processing", "packed_forward"):
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples: list[dict]) -> dict:
        images = [[decode(data) for data in example.get(IMAGE_COLUMN) or []] for example in examples]
        examples = [{key: value for key, value in example.items() if key != IMAGE_COLUMN} for example in examples]
        batch = self.collator(examples)
        rows = batch["input_ids"].shape[0]
        packed_only = self.packed_forward is not None and self.packed_forward.checked and self.packed_forward.enabled
        if not packed_only:
            batch.update(self.processing.image_inputs(images * (rows // len(examples))))
        batch.update(self.processing.token_inputs(batch["input_ids"]))
        if "packed_segment_ids" in batch:  # the packed layout's images: each prompt's once, in the packed order
            packed = self.processing.image_inputs([images[index] for index in self._packed_order(batch)])
            batch.update({PACKED_PREFIX + key: value for key, value in packed.items()})
        return batch

    def _packed_order(self, batch: dict) -> list[int]:
        """The example of each segment of the packed rows, in the order their tokens come (row after row): the order
        the model reads their images in. A prefix-shared segment is one example's; a varlen one, one of its answers."""
        import torch

        segments = batch["packed_segment_ids"].reshape(-1)
        segments = segments[segments >= 0]
        first = torch.ones_like(segments, dtype=torch.bool)
        first[1:] = segments[1:] != segments[:-1]
        per_example = len(getattr(self.collator, "answers", ())) if getattr(self.collator, "layout", "") == "varlen" \
            else 1
        return [int(segment) // max(per_example, 1) for segment in segments[first]]


# --- the vision tower ----------------------------------------------------------------------------------------------

def _text_parameters(model) -> set:
    """The parameters of the language model and its output head (what is trained by default)."""
    head = model.get_output_embeddings()
    return {id(parameter) for module in (model.get_decoder(), head) if module is not None
            for parameter in module.parameters()}


def vision_modules(model) -> list[str]:
    """The names of the largest modules holding none of the language model's or head's weights: the vision tower and
    the projector between it and the language model (LLaVA's model.vision_tower and model.multi_modal_projector)."""
    text = _text_parameters(model)

    def outside(module, name: str) -> list[str]:
        parameters = [id(parameter) for parameter in module.parameters()]
        if parameters and text.isdisjoint(parameters):
            return [name]
        return [found for child_name, child in module.named_children()
                for found in outside(child, f"{name}.{child_name}" if name else child_name)]

    return outside(model, "")


def freeze_vision_tower(model) -> int:
    """The vision tower's and projector's weights frozen (--train_vision_tower leaves them trained): the parameter
    count frozen."""
    frozen = 0
    for name in vision_modules(model):
        for parameter in model.get_submodule(name).parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def lora_for(peft_config, model, train_vision_tower: bool):
    """LoRA on the language model alone: the vision modules excluded from its targets (peft's exclude_modules, a
    regular expression over module names), unless --train_vision_tower adapts them too."""
    if peft_config is None or train_vision_tower or not is_vision_config(model.config):
        return peft_config
    names = "|".join(name.replace(".", r"\.") for name in vision_modules(model))
    peft_config.exclude_modules = rf"({names})(\..*)?"
    return peft_config
