"""Tiny vision-language models built offline (no Hub): a family's processor around the tests' BPE tokenizer, a
one-layer vision tower and a two-layer language model, saved with the processor, reloadable with AutoProcessor and
AutoModelForImageTextToText. `python tests/tiny_vlms.py DIR` builds each family under DIR (for a look by hand).

Images are 56 px (LLaVA: CLIP, patch 14: 16 tokens an image), 28 px tiles (Idefics3: 4 tokens, no splitting) and
28 px (Gemma 3: SigLIP, patch 7, 4 soft tokens): a forward of a few rows costs milliseconds.
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import WORDS, build_tiny_tokenizer, save_seeded  # noqa: E402

# A template that places image parts ({"type": "image"}) where the message has them and reads content as text or as
# a list of parts, with generation markers (assistant-only loss), like the families' own.
VLM_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}IMAGE{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ render(message['content']) }}{{ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ render(message['content']) }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{% generation %}{{ render(message['content']) }}<|end|>"
    "{% endgeneration %}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def vlm_tokenizer(corpus: list[str], extra: list[str], **named):
    """The tests' BPE tokenizer with a family's image tokens (special, added at the end of the vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    base = build_tiny_tokenizer(corpus)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, pad_token="<|pad|>",
                                        eos_token="<|end|>", unk_token="<|unk|>", extra_special_tokens=named or None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>", *extra]})
    return tokenizer


def _llama(tokenizer, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, **overrides)


def build_llava(path: Path, corpus: list[str], seed: int = 0) -> Path:
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor)

    tokenizer = vlm_tokenizer(corpus, ["<image>"])
    template = VLM_TEMPLATE.replace("IMAGE", "<image>")
    tokenizer.chat_template = template
    images = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=template)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_llama(tokenizer),
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    return _save(LlavaForConditionalGeneration, config, processor, tokenizer, path, seed)


def build_idefics3(path: Path, corpus: list[str], seed: int = 0) -> Path:
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig)

    tiles = [f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)]
    tokenizer = vlm_tokenizer(corpus, ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                                    *tiles])
    template = VLM_TEMPLATE.replace("IMAGE", "<image>")
    tokenizer.chat_template = template
    images = Idefics3ImageProcessor(size={"longest_edge": 28}, max_image_size={"longest_edge": 28},
                                    do_image_splitting=False)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=template)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=_llama(tokenizer).to_dict(),
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=1)
    return _save(Idefics3ForConditionalGeneration, config, processor, tokenizer, path, seed)


def build_gemma3(path: Path, corpus: list[str], seed: int = 0) -> Path:
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)

    tokenizer = vlm_tokenizer(corpus, [], boi_token="<start_of_image>", eoi_token="<end_of_image>",
                           image_token="<image_soft_token>")
    template = VLM_TEMPLATE.replace("IMAGE", "<start_of_image>")
    tokenizer.chat_template = template
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 28, "width": 28}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=template)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=7)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                            sliding_window=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=None)
    config = Gemma3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                          image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, mm_tokens_per_image=4)
    return _save(Gemma3ForConditionalGeneration, config, processor, tokenizer, path, seed)


def _save(model_class, config, processor, tokenizer, path: Path, seed: int) -> Path:
    return save_seeded(model_class, config, tokenizer, processor, path, seed)


BUILDERS = {"llava": build_llava, "idefics3": build_idefics3, "gemma3": build_gemma3}


def image_file(colour: str, size: tuple[int, int] = (40, 30), kind: str = "PNG", mark: int = 0) -> bytes:
    """An image of one colour (a `mark`-sized dark square in its corner tells images of one colour apart), encoded."""
    from PIL import Image

    image = Image.new("RGB", size, COLOURS[colour])
    if mark:
        image.paste((0, 0, 0), (0, 0, mark, mark))
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return buffer.getvalue()


def colour_pairs(count: int, directory: Path, seed: int = 0, images_per_row: int = 1) -> list[dict]:
    """RLAIF-V-shaped rows (TRL's vision DPO format): `images` (file names relative to `directory`, written there), a
    chat prompt with an image part per image, chosen (names the colour) and rejected (another colour)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        colours = [rng.choice(sorted(COLOURS)) for _ in range(images_per_row)]
        names = []
        for number, colour in enumerate(colours):
            name = f"images/{index}_{number}.png"
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(image_file(colour, size=(30 + index % 7 * 3, 28 + index % 5 * 4),
                                                      mark=index % 4))
            names.append(name)
        wrong = rng.choice([colour for colour in sorted(COLOURS) if colour != colours[-1]])
        rows.append({
            "images": names,
            "prompt": [{"role": "user", "content": [*({"type": "image"} for _ in names),
                                                    {"type": "text", "text": f"what color is the {WORDS[index % 9]}"}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"it is {colours[-1]}"}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": f"it is {wrong} no"}]}],
        })
    return rows


if __name__ == "__main__":
    from conftest import tiny_corpus

    for name, build in BUILDERS.items():
        print(build(Path(sys.argv[1]) / name, tiny_corpus()))
