"""Vision-language models (src/vision.py, src/data/images.py): image + text data through SFT and DPO, on a tiny model
of each family proven here (tests/tiny_vlms.py, built offline), with the text path's guarantees.

    python -m pytest -q -n 0 tests/test_vision.py
"""

from __future__ import annotations

import base64
import copy
import json
import os
from pathlib import Path

import pytest

import forked
from conftest import write_jsonl
from src import run_files, seams, vision
from tiny_vlms import BUILDERS, colour_pairs, image_file

FAMILIES = sorted(BUILDERS)


@pytest.fixture(scope="module")
def vlms(tmp_path_factory, corpus) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {name: build(root / name, corpus) for name, build in BUILDERS.items()}


def _prepare(model: Path, data: Path, stage: str = "dpo", cache: Path | None = None, **flags):
    from src.config_parse import parse_config
    from src.data import prepare_data

    argv = ["--model_name_or_path", str(model), "--dataset_name", str(data), "--max_length", "96", "--val_size", "2",
            "--test_size", "0"]
    for key, value in flags.items():
        argv += [f"--{key}", str(value)]
    config = parse_config(argv)
    processing = vision.ImageProcessing(vision.load_processor(str(model)))
    return prepare_data(config.data, config.sft, stage, 0, processing.tokenizer, cache or data.parent / "cache",
                        processing)


def test_the_families_built_here_are_the_families_proven():
    assert set(BUILDERS) == set(vision.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_prepared_pairs_are_trls_ids_tensors_and_log_probs(family, vlms, tmp_path):
    """RLAIF-V-shaped pairs (one or two images a prompt) prepared by src/data/ and collated by ImageCollator give TRL's
    DataCollatorForVisionPreference's ids, image tensors (pixel_values, Idefics3's pixel_attention_mask, Gemma 3's
    token_type_ids) and log-probs, row for row; a held-out prompt's generation ids are its training prompt's ids.
    ~3 CPU-s a family."""
    import torch
    from transformers import AutoModelForImageTextToText
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DataCollatorForVisionPreference

    from src.data import source_rows

    rows = colour_pairs(6, tmp_path) + colour_pairs(4, tmp_path / "two", seed=1, images_per_row=2)
    for row in rows[6:]:
        row["images"] = ["two/" + name for name in row["images"]]
    prepared = _prepare(vlms[family], write_jsonl(tmp_path / "pairs.jsonl", rows))
    processing = prepared.processing
    train, numbers = prepared.train, source_rows(prepared, "train")
    examples = [{"images": [vision.decode((tmp_path / name).read_bytes()) for name in rows[number - 1]["images"]],
                 **copy.deepcopy({key: rows[number - 1][key] for key in ("prompt", "chosen", "rejected")})}
                for number in numbers]
    theirs = DataCollatorForVisionPreference(processor=processing.processor)(examples)
    ours = vision.ImageCollator(DataCollatorForPreference(pad_token_id=processing.tokenizer.pad_token_id),
                                processing)([dict(row) for row in train])
    for index in range(len(theirs["input_ids"])):  # TRL flushes left, the toolkit pads right
        assert (theirs["input_ids"][index][theirs["attention_mask"][index].bool()].tolist()
                == ours["input_ids"][index][ours["attention_mask"][index].bool()].tolist()), index
    image_keys = set(theirs) - {"input_ids", "attention_mask", "completion_mask"}
    assert image_keys == set(ours) - {"input_ids", "attention_mask", "completion_mask"} and "pixel_values" in image_keys
    for key in image_keys - {"token_type_ids"}:
        assert torch.equal(theirs[key], ours[key]), key
    model = AutoModelForImageTextToText.from_pretrained(vlms[family]).eval()

    def answer_log_probs(batch):
        inputs = {key: value for key, value in batch.items() if key != "completion_mask"}
        with torch.no_grad():
            logits = model(**inputs).logits.log_softmax(-1)
        token = logits[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return (token * batch["completion_mask"][:, 1:]).sum(1)

    assert torch.allclose(answer_log_probs(theirs), answer_log_probs(ours), atol=1e-5)
    held_out = prepared.validation[0]
    assert held_out["sample_prompt_ids"] == held_out["prompt_ids"] and len(held_out[vision.IMAGE_COLUMN]) >= 1


def test_the_shapes_users_have_prepare_to_the_same_rows(tiny_llava, tmp_path):
    """The same pairs as an images column of relative paths (JSON Lines), datasets' Image feature (parquet bytes),
    OpenAI image_url parts with data URLs, image parts holding their own path, and one `image` column beside text
    question / chosen / rejected columns (a chat once the template renders it): the same ids and image bytes.
    ~4 CPU-s."""
    import datasets

    rows = colour_pairs(6, tmp_path)
    files = {name: (tmp_path / name).read_bytes() for row in rows for name in row["images"]}
    text = [row["prompt"][0]["content"][-1]["text"] for row in rows]
    answers = {side: [row[side][0]["content"][0]["text"] for row in rows] for side in ("chosen", "rejected")}
    url = [[f"data:image/png;base64,{base64.b64encode(files[row['images'][0]]).decode()}"] for row in rows]
    shapes = {
        "paths": write_jsonl(tmp_path / "paths.jsonl", rows),
        "data_urls": write_jsonl(tmp_path / "urls.jsonl", [
            {**row, "prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": link[0]}},
                                                            {"type": "text", "text": question}]}]}
            for row, link, question in zip([{k: v for k, v in r.items() if k != "images"} for r in rows], url, text)]),
        "own_path": write_jsonl(tmp_path / "own.jsonl", [
            {**{k: v for k, v in row.items() if k != "images"},
             "prompt": [{"role": "user", "content": [{"type": "image", "image": row["images"][0]},
                                                     {"type": "text", "text": question}]}]}
            for row, question in zip(rows, text)]),
        "question_image": write_jsonl(tmp_path / "question.jsonl", [
            {"image": row["images"][0], "question": question, "chosen": chosen, "rejected": rejected}
            for row, question, chosen, rejected in zip(rows, text, answers["chosen"], answers["rejected"])]),
    }
    parquet = tmp_path / "parquet" / "train.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_dict({
        "images": [[{"bytes": files[row["images"][0]], "path": None}] for row in rows],
        "prompt": [row["prompt"] for row in rows], "chosen": [row["chosen"] for row in rows],
        "rejected": [row["rejected"] for row in rows],
    }).cast_column("images", datasets.List(datasets.Image())).to_parquet(str(parquet))
    shapes["image_feature"] = parquet
    prepared = {}
    for name, data in shapes.items():
        split = _prepare(tiny_llava, data, cache=tmp_path / "cache").splits
        assert vision.IMAGE_COLUMN in split["train"].column_names, name
        prepared[name] = sorted((row["prompt_ids"], row["chosen_ids"], row["rejected_ids"], row[vision.IMAGE_COLUMN])
                                for kind in split for row in split[kind])
    assert len(prepared["paths"]) == 6
    for name, found in prepared.items():
        assert found == prepared["paths"], name


def test_sft_drops_a_row_that_max_length_would_cut_inside_an_image(tiny_llava, tmp_path):
    """Chats trained whole (no assistant-only loss), three showing an image in a later turn: a --max_length that ends
    inside that image's tokens drops those three (counted), never cuts into it; the chats whose image comes first
    are kept, cut after it. ~2 CPU-s."""
    (tmp_path / "red.png").write_bytes(image_file("red"))
    image = [{"type": "image"}, {"type": "text", "text": "what color"}]
    late = {"images": ["red.png"], "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world the sky is blue"},
        {"role": "user", "content": image}, {"role": "assistant", "content": "it is red"}]}
    early = {"images": ["red.png"], "messages": [
        {"role": "user", "content": image}, {"role": "assistant", "content": "it is red the sky is blue green"}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [late, early] * 3)
    whole = _prepare(tiny_llava, data, "sft", val_size=0)
    lengths = {tuple(row["input_ids"][:3]): row["input_ids"] for row in whole.train}
    processing = whole.processing
    late_ids = max(lengths.values(), key=processing.last_image_position)
    early_ids = min(lengths.values(), key=processing.last_image_position)
    assert processing.last_image_position(early_ids) + 4 < processing.last_image_position(late_ids) - 4
    cut = _prepare(tiny_llava, data, "sft", val_size=0, max_length=processing.last_image_position(late_ids) - 2)
    counts = cut.summary["splits"]["train"]
    assert (counts["kept"], counts["dropped_prompt_too_long"]) == (3, 3), counts
    assert all(processing.last_image_position(row["input_ids"]) == processing.last_image_position(early_ids)
               for row in cut.train)


def _run_args(model: Path, data: Path, results: Path, name: str, stage: str, *extra: str) -> list[str]:
    return ["--stage", stage, "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", name, "--max_length", "64", "--logging_steps", "1", "--eval_steps", "100",
            "--num_samples", "2", "--max_new_tokens", "4", "--judge", "none", "--seed", "3", "--val_size", "2",
            "--test_size", "2", "--batch_size", "4", "--micro_batch_size", "2", "--learning_rate", "1e-3", *extra]


def _logged(run_dir: Path, keys: tuple[str, ...]) -> list[list[float]]:
    return [[record[key] for key in keys] for record in run_files.read_jsonl(run_dir / run_files.METRICS)
            if "loss" in record]


def test_dpo_on_images_gives_the_same_numbers_on_two_processes_resumes_and_keeps_the_tower(tiny_llava, tmp_path):
    """LLaVA, DPO on 24 RLAIF-V-shaped pairs, global batch 4: 1 process x 2 accumulation and 2 processes x 1 (killed
    after checkpoint 2, relaunched: it resumes) log the same losses and rewards (fp32, 1e-5). The vision tower and
    projector end as they started (frozen by default), the language model changed, the processor is saved with the
    model, report.md shows each held-out prompt's image (a thumbnail); the reference log-probs cached by the first run are reused by the second, and computed again once an image
    file changes (the prepared data's key covers the images). ~40 CPU-s."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_pairs(24, tmp_path / "data"))
    results, keys = tmp_path / "results", ("loss", "rewards/margins", "rewards/chosen", "grad_norm")
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    one = forked.run_job(1, _run_args(tiny_llava, data, results, "w1", "dpo", "--max_steps", "4"), env=environment)
    assert one.returncode == 0, one.stderr[-4000:]
    two_args = _run_args(tiny_llava, data, results, "w2", "dpo", "--max_steps", "4", "--save_steps", "2")
    killed = forked.run_job(2, two_args, env=seams.env(environment, kill_at_checkpoint=f"after_complete:2:*:{tmp_path}/k"))
    assert killed.returncode != 0
    two = forked.run_job(2, two_args, env=environment)
    assert two.returncode == 0, two.stderr[-4000:]
    info = run_files.read_json(results / "w2" / run_files.TRAINING_INFO)
    assert [resume["from_step"] for resume in info["resumes"]] == [2]
    assert info["reference_log_probs"]["train"]["cache"] == "reused"
    first, second = _logged(results / "w1", keys), _logged(results / "w2", keys)
    assert len(first) == 4
    for step, (mine, theirs) in enumerate(zip(first, second), start=1):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6), step
    final = results / "w2" / "model" / "final"
    assert AutoProcessor.from_pretrained(final).image_token == "<image>"
    card = (final / "README.md").read_text()  # the model card loads it as what it is
    assert "AutoModelForImageTextToText.from_pretrained" in card and "AutoProcessor.from_pretrained" in card
    before, after = (AutoModelForImageTextToText.from_pretrained(path).state_dict() for path in (tiny_llava, final))
    tower = [name for name in before if name.startswith(("model.vision_tower", "model.multi_modal_projector"))]
    assert tower and all(torch.equal(before[name], after[name]) for name in tower)
    assert not torch.equal(before["model.language_model.layers.0.mlp.up_proj.weight"],
                           after["model.language_model.layers.0.mlp.up_proj.weight"])
    samples = run_files.read_jsonl(results / "w2" / run_files.samples_file("val"))
    assert len(samples) == 2 and all(sample["prompt"].count("<image>") == 1 for sample in samples)
    # the report shows each sample's image beside its answers: a thumbnail in the run directory, linked
    assert all(len(sample["images"]) == 1 and (results / "w2" / sample["images"][0]).stat().st_size for sample in samples)
    assert f"![image 1]({run_files.SAMPLE_IMAGES_DIR}/test_" in (results / "w2" / "report.md").read_text()

    (tmp_path / "data" / "images" / "5_0.png").write_bytes(image_file("blue", size=(31, 29)))
    three = forked.run_job(1, _run_args(tiny_llava, data, results, "w3", "dpo", "--max_steps", "1"), env=environment)
    assert three.returncode == 0, three.stderr[-4000:]
    assert run_files.read_json(results / "w3" / run_files.TRAINING_INFO)["reference_log_probs"]["train"][
        "cache"] == "computed"


def test_sft_on_images_gives_the_same_numbers_on_two_processes(vlms, tmp_path):
    """Gemma 3 (its token_type_ids mark the image's tokens), SFT on the pairs' chosen answers: 1 process x 2
    accumulation and 2 processes x 1 log the same losses and token accuracies (fp32, 1e-5), and the held-out answers
    are generated from the images (different images, different answers from the same untrained model). ~20 CPU-s."""
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_pairs(20, tmp_path / "data"))
    results, keys = tmp_path / "results", ("loss", "mean_token_accuracy", "entropy", "grad_norm")
    for nproc in (1, 2):
        result = forked.run_job(nproc, _run_args(vlms["gemma3"], data, results, f"w{nproc}", "sft", "--max_steps",
                                                 "3"), env=os.environ | {"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-4000:]
    first, second = _logged(results / "w1", keys), _logged(results / "w2", keys)
    assert len(first) == 3
    for step, (mine, theirs) in enumerate(zip(first, second), start=1):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6), step
    assert run_files.read_jsonl(results / "w1" / run_files.samples_file("val")) == \
        run_files.read_jsonl(results / "w2" / run_files.samples_file("val"))


def test_held_out_answers_are_generated_from_the_images(tiny_llava):
    """The same prompt ids with a red and with a blue image: the untrained LLaVA answers them differently (its answer
    reads the image's tokens), and the same image twice alike. ~1 CPU-s."""
    from transformers import AutoModelForImageTextToText

    from src.generation import generate

    processing = vision.ImageProcessing(vision.load_processor(str(tiny_llava)))
    model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color"}]}]
    text = processing.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    red, blue = image_file("red", size=(56, 56)), image_file("blue", size=(56, 56))
    ids = processing.prompt_ids(text, [vision.decode(red)])
    answers = generate(model, processing.tokenizer, [ids] * 3, 6, 3, images=[[red], [blue], [red]],
                       processing=processing)
    assert answers[0] == answers[2] and answers[0] != answers[1]


def test_lora_adapts_the_language_model_alone_unless_the_tower_is_trained(tiny_llava):
    """LoRA on all linear layers of a VLM: adapters on the language model only (the tower and projector excluded);
    --train_vision_tower adapts them too. Full fine-tuning: the tower's weights frozen, the language model's not.
    ~1 CPU-s."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    for train_tower in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
        lora = vision.lora_for(LoraConfig(target_modules="all-linear", r=4), model, train_tower)
        adapted = {name.split(".lora_")[0] for name, _ in get_peft_model(model, lora).named_parameters()
                   if ".lora_" in name}
        in_tower = [name for name in adapted if "vision_tower" in name or "multi_modal_projector" in name]
        assert adapted and bool(in_tower) == train_tower, (train_tower, sorted(adapted)[:4])
    model = AutoModelForImageTextToText.from_pretrained(tiny_llava)
    frozen = vision.freeze_vision_tower(model)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert frozen > 0 and trainable and all(name.startswith(("model.language_model", "lm_head")) for name in trainable)


def test_the_tower_trains_on_two_processes_when_asked(tiny_llava, tmp_path):
    """DPO with --train_vision_tower on 2 processes: the tower's and projector's weights change, although LLaVA reads
    its tower's last hidden state before the post-layernorm (weights that get no gradient: before, DDP stopped at step
    2, "Expected to have finished reduction in the prior iteration"). ~6 CPU-s."""
    import torch
    from transformers import AutoModelForImageTextToText

    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_pairs(12, tmp_path / "data"))
    result = forked.run_job(2, _run_args(tiny_llava, data, tmp_path / "results", "tower", "dpo", "--max_steps", "2",
                                         "--train_vision_tower", "true", "--num_samples", "0"),
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    final = tmp_path / "results" / "tower" / "model" / "final"
    before, after = (AutoModelForImageTextToText.from_pretrained(path).state_dict() for path in (tiny_llava, final))
    for name in ("model.vision_tower.encoder.layers.0.mlp.fc1.weight",
                 "model.multi_modal_projector.linear_1.weight"):
        assert not torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_packed_forward_encodes_each_prompts_images_once_and_gives_the_padded_numbers(family, vlms, tmp_path):
    """DPO's packed, prefix-shared forward on image pairs: each prompt's images go to the vision tower once (TRL's
    padded batch repeats them for the chosen and the rejected row), its first-batch check against the padded forward
    passes, and a run logs the padded forward's losses and rewards (--padding_free false) at 1e-5. ~10 CPU-s a
    family."""
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_pairs(16, tmp_path / "data"))
    results, keys = tmp_path / "results", ("loss", "rewards/margins", "rewards/chosen", "grad_norm")
    logged, forwards = {}, {}
    for name, flags in (("packed", ()), ("padded", ("--padding_free", "false"))):
        result = forked.run_job(1, _run_args(vlms[family], data, results, name, "dpo", "--max_steps", "3",
                                             "--num_samples", "0", *flags), env=os.environ | {"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-4000:]
        logged[name] = _logged(results / name, keys)
        forwards[name] = run_files.read_json(results / name / run_files.TRAINING_INFO)["forward"]
    assert forwards["packed"]["forward"].startswith("packed") and forwards["packed"]["first_batch_check"]["passed"]
    assert forwards["padded"]["forward"] == "padded (TRL)"
    for step, (packed, padded) in enumerate(zip(logged["packed"], logged["padded"]), start=1):
        assert packed == pytest.approx(padded, rel=1e-5, abs=1e-6), step

    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from src.packed_dpo import PackedPreferenceCollator

    prepared = _prepare(vlms[family], data, cache=tmp_path / "cache")
    pad = prepared.processing.tokenizer.pad_token_id
    collator = vision.ImageCollator(PackedPreferenceCollator(DataCollatorForPreference(pad_token_id=pad)),
                                    prepared.processing)
    batch = collator([dict(row) for row in prepared.train.select(range(4))])
    images = "pixel_values"
    assert batch[vision.PACKED_PREFIX + images].shape[0] * 2 == batch[images].shape[0]


def test_the_data_audit_counts_the_images(tiny_llava, tmp_path):
    """The data audit of image pairs: images per row and their tokens (16 a LLaVA image here), repeated images by
    content, and answers that ignore the image (the same question answered alike for two different images); report.md's
    Data section shows them. ~2 CPU-s."""
    from src.reporting.audit import data_section

    rows = colour_pairs(6, tmp_path)
    rows[3]["images"] = rows[2]["images"]  # the same image file again
    for row in rows[4:]:  # one question, one answer, two different images
        row["prompt"][0]["content"][-1]["text"] = "what color is it"
        row["chosen"] = [{"role": "assistant", "content": "it is red"}]
    prepared = _prepare(tiny_llava, write_jsonl(tmp_path / "pairs.jsonl", rows), val_size=0)
    images = prepared.summary["audit"]["train"]["images"]
    assert images["rows_with_images_share"] == 1 and images["images_per_row"]["mean"] == 1
    assert images["image_tokens"]["median"] == 16
    assert images["duplicate_image_share"] == pytest.approx(1 / 6, abs=1e-6)
    assert images["answer_ignores_image_share"] == pytest.approx(2 / 6, abs=1e-6)
    assert any("same answer to the same question for other images" in line
               for line in data_section(prepared.summary["audit"], "dpo", None, tmp_path))
