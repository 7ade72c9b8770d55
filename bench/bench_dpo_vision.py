"""DPO on image pairs: this toolkit against plain `trl dpo` (TRL's own CLI) on a small LLaVA built locally, the arms
interleaved (bench/bench_dpo.py's runner: the same hyperparameters, pairs/s and peak memory, medians of the repeats).

    python bench/bench_dpo_vision.py                       # ~6 minutes on 2 CPU cores
    python bench/bench_dpo_vision.py --image_size 336 --hidden 1024 --layers 8 --steps 20    # on a GPU machine

What differs from text: TRL's vision DPO (DataCollatorForVisionPreference) repeats each prompt's images for its chosen
and its rejected row, so the vision tower encodes every image twice per pair and the prompt's image tokens are
attended twice, and it runs the reference model inside every step (it refuses precompute_ref_log_probs for images).
The toolkit's packed forward encodes each prompt's images once and computes its prompt once (src/packed_forward.py,
checked against the padded forward on the first batch); its reference log-probs are computed once and cached.

Time: every arm runs one process on one thread (OMP_NUM_THREADS=1), and its CPU seconds (user + system, the whole
run: imports, data, reference pass, training) are the measure a shared machine's load does not stretch: CPU-s per
pair. pairs/s is the wall-clock measure bench_dpo.py reports (training time, plus the reference pass before it for the
toolkit), shown beside it; on a loaded machine only the CPU seconds compare.

Data: RLAIF-V-shaped pairs (an image of one colour, a chat prompt with an image part, chosen, rejected) as parquet
with datasets' Image feature (what both read). The image is --image_size pixels (CLIP, patch 14: (size / 14)^2 image
tokens each, LLaVA-1.5's 336 px gives 576).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_dpo import shares, toolkit, trl_dpo  # noqa: E402


def build_assets(root: Path, args) -> tuple[Path, Path]:
    """A LLaVA of random weights (CLIP tower, Llama language model, the tests' tokenizer and template) and its pairs."""
    import datasets
    import torch
    from PIL import Image
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from conftest import WORDS, tiny_corpus
    from tiny_vlms import COLOURS, VLM_TEMPLATE, vlm_tokenizer

    tokenizer = vlm_tokenizer(tiny_corpus(), ["<image>"])
    template = VLM_TEMPLATE.replace("IMAGE", "<image>")
    tokenizer.chat_template = template
    size = args.image_size
    processor = LlavaProcessor(CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size,
                                                                                          "width": size}),
                               tokenizer, patch_size=14, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=template)
    vision = CLIPVisionConfig(hidden_size=args.vision_hidden, intermediate_size=args.vision_hidden * 4,
                              num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_hidden // 64,
                              image_size=size, patch_size=14)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=args.hidden // 64, max_position_embeddings=4096, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_id=tokenizer.convert_tokens_to_ids("<image>")))
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)

    rng = random.Random(0)
    words = lambda count: " ".join(rng.choice(WORDS) for _ in range(count))  # noqa: E731
    rows = {"images": [], "prompt": [], "chosen": [], "rejected": []}
    for _ in range(args.steps * args.batch_size):
        colour, wrong = rng.sample(sorted(COLOURS), 2)
        buffer = io.BytesIO()
        Image.new("RGB", (size, size), COLOURS[colour]).save(buffer, format="PNG")
        rows["images"].append([{"bytes": buffer.getvalue(), "path": None}])
        rows["prompt"].append([{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": f"what color is it {words(rng.randint(4, 20))}"}]}])
        rows["chosen"].append([{"role": "assistant", "content": f"it is {colour} {words(rng.randint(5, 30))}"}])
        rows["rejected"].append([{"role": "assistant", "content": f"it is {wrong} {words(rng.randint(5, 30))}"}])
    data_dir = root / "data"
    data_dir.mkdir()
    datasets.Dataset.from_dict(rows).cast_column("images", datasets.List(datasets.Image())).to_parquet(
        str(data_dir / "train.parquet"))
    return model_dir, data_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="the language model's width")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vision_hidden", type=int, default=256)
    parser.add_argument("--vision_layers", type=int, default=4)
    parser.add_argument("--image_size", type=int, default=224, help="pixels (CLIP patch 14: (size/14)^2 tokens)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch (pairs per optimizer step)")
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", help="keep the work directory here (default: a temporary one, deleted)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="prefkit_bench_vision_"))
    sys.path.insert(0, str(ROOT))
    from src.resource_limits import usable_cores

    cores = usable_cores()
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"} | {
        "HF_HOME": str(work / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    model, data = build_assets(work / "assets", args)
    print(f"LLaVA: language model {args.layers} x {args.hidden}, CLIP tower {args.vision_layers} x "
          f"{args.vision_hidden}, {args.image_size} px images ({(args.image_size // 14) ** 2} tokens each); "
          f"{args.steps} steps of {args.batch_size} pairs; {args.repeats} repeats; one thread an arm ({cores} CPU "
          f"cores); load average at start {os.getloadavg()[0]:.2f}", flush=True)
    arms = {"trl dpo (TRL CLI)": [], "toolkit padded, cold cache": [], "toolkit packed, cold cache": [],
            "toolkit packed, warm cache": []}
    for repeat in range(args.repeats):
        for name in arms:
            log = work / f"log-{repeat}-{re.sub('[^a-z0-9]+', '_', name)}.txt"
            packed = "packed" in name
            warm_cache = work / "warm-cache"
            if name.startswith("trl"):
                result = trl_dpo(args, model, data, work / "trl-out", log, env)
            elif "cold" in name:
                cold_cache = work / f"cold-cache-{repeat}-{'packed' if packed else 'padded'}"
                result = toolkit(args, model, data, work / "results", cold_cache, 1, log, env, packed)
                if packed and not warm_cache.exists():
                    shutil.copytree(cold_cache, warm_cache)
                shutil.rmtree(cold_cache, ignore_errors=True)
            else:
                result = toolkit(args, model, data, work / "results", warm_cache, 1, log, env, packed)
            arms[name].append(result)
            print(f"  repeat {repeat + 1}: {name:<30} {result['cpu s']:6.1f} CPU-s  {result['samples/s']:6.2f} pairs/s  "
                  f"{result['wall s']:6.1f} s wall  {result['peak MB']:7.0f} MB  padding / repeated prompt "
                  f"{shares(result)}", flush=True)
    pairs = args.steps * args.batch_size
    baseline = {key: statistics.median(result[key] for result in arms["trl dpo (TRL CLI)"])
                for key in ("cpu s", "samples/s", "peak MB")}
    print(f"\n| arm | CPU-s per pair (whole run) | vs trl dpo | pairs/s (wall) | peak MB | vs trl dpo | padding / "
          "repeated prompt (policy forward) |")
    print("|---|---|---|---|---|---|---|")
    for name, results in arms.items():
        median = {key: statistics.median(result[key] for result in results) for key in ("cpu s", "samples/s",
                                                                                        "peak MB")}
        print(f"| {name} | {median['cpu s'] / pairs:.2f} | {baseline['cpu s'] / median['cpu s']:.2f}x | "
              f"{median['samples/s']:.2f} | {median['peak MB']:.0f} | {median['peak MB'] / baseline['peak MB']:.2f}x | "
              f"{shares(results[0])} |")
    first, second = arms["toolkit padded, cold cache"][0]["losses"], arms["toolkit packed, cold cache"][0]["losses"]
    print(f"loss curves, padded vs packed: {len(first)} steps, largest difference "
          f"{max(abs(a - b) for a, b in zip(first, second)):.2e}; load average at end {os.getloadavg()[0]:.2f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
