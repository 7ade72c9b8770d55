"""Model cards and the Hub push: the card's content for a DPO + LoRA run, a real tiny run that writes its card and
keeps its model when it cannot push, and the push followed up to the client calls (HfApi faked at its boundary)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

import forked
from report_fixtures import judged_run_dir
from src import run_files
from src.config_error import ConfigError
from src.config_parse import parse_config
from src.publish import PublishError, push_to_hub, write_model_cards
from src.run_safety.checkpoint_manifest import read_manifest, verify
from src.reporting.report import build_report

LORA_CONFIG = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "dataset_name": "trl-lib/ultrafeedback_binarized",
               "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_modules": ["q_proj", "v_proj"],
               "beta": 0.1, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.4]}


def test_card_of_a_dpo_lora_run_states_method_numbers_judge_and_plots(tmp_path):
    from huggingface_hub import ModelCard

    run_dir = judged_run_dir(tmp_path / "run")
    info = run_files.update_json(run_dir / run_files.TRAINING_INFO, use_lora=True, config=LORA_CONFIG,
                                 loss_type=["sigmoid", "sft"], model_name_or_path=LORA_CONFIG["model_name_or_path"],
                                 dataset_name=LORA_CONFIG["dataset_name"],
                                 summary={"stage": "dpo", "finished": True, "last_step": 200,
                                          "final_train_loss": 0.4321, "final_reward_accuracy_eval": 0.875})
    build_report(run_dir)  # the plots the card embeds
    (run_dir / "model" / "final").mkdir(parents=True)

    dirs = write_model_cards(run_dir, "my-org/tiny-dpo")
    card_path = dirs["final"] / "README.md"
    card = ModelCard.load(card_path)
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and card.data.library_name == "peft"
    assert card.data.datasets == ["trl-lib/ultrafeedback_binarized"] and {"dpo", "lora"} <= set(card.data.tags)
    text = card.text
    assert "# my-org/tiny-dpo" in text and 'AutoPeftModelForCausalLM' in text and '"my-org/tiny-dpo"' in text
    assert "| loss type | sigmoid + sft (weights 1, 0.4) |" in text and "| beta | 0.1 |" in text
    assert "| LoRA | r 8, alpha 16, dropout 0.05, target modules q_proj, v_proj |" in text
    judge = info["judge"]
    assert f"{100 * judge['before']:.1f}%" in text and f"{100 * judge['after']:.1f}%" in text  # before → after
    assert "| final train loss (last logged) | 0.4321 |" in text
    assert "| final reward accuracy (train / eval) | n/a / 87.5% |" in text
    assert "16 pairs per optimizer step" in text  # the resolved plan: 8 per device x 1 x 2 processes
    images = re.findall(r"!\[[^\]]+\]\((plots/[^)]+\.png)\)", text)
    assert len(images) >= 4 and all((dirs["final"] / image).is_file() for image in images)


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory) -> Path:
    """A real 3-step DPO + LoRA run with a merged copy, asked to push with no token: it must finish and keep the
    model, say why it did not push, and write the cards."""
    from conftest import preference_rows, write_jsonl

    root = tmp_path_factory.mktemp("publish")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(48))
    args = ["--stage", "dpo", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
            "--results_dir", str(root / "results"), "--run_name", "lora", "--max_length", "64", "--logging_steps",
            "1", "--eval_steps", "2", "--num_samples", "2", "--max_new_tokens", "4", "--judge", "none",
            "--val_size", "4", "--test_size", "4", "--batch_size", "4", "--max_steps", "3", "--learning_rate", "1e-3",
            "--use_lora", "--lora_r", "4", "--merge_adapter", "--push_to_hub", "--hub_model_id", "my-org/tiny-dpo"]
    env = {key: value for key, value in os.environ.items() if key != "HF_TOKEN"}
    result = forked.run_main(args, env=env)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "warning: --push_to_hub: no Hugging Face token" in result.stdout  # said before training
    assert "not pushed to the Hub: no Hugging Face token: set HF_TOKEN" in result.stdout
    assert f"python -m src.publish {root / 'results' / 'lora'} --hub_model_id my-org/tiny-dpo" in result.stdout
    return root / "results" / "lora"


def test_a_run_writes_its_card_and_keeps_its_model_when_it_cannot_push(lora_run):
    info = run_files.read_json(lora_run / run_files.TRAINING_INFO)
    assert info["hub"] == {"repo_id": "my-org/tiny-dpo", "pushed": False,
                           "error": "no Hugging Face token: set HF_TOKEN (or run `hf auth login`)"}
    final, merged = lora_run / "model" / "final", lora_run / "model" / "merged"
    assert (final / "adapter_model.safetensors").stat().st_size > 0
    card = (final / "README.md").read_text()
    assert "# my-org/tiny-dpo" in card and "| LoRA | r 4, alpha " in card and "| beta | 0.1 |" in card
    assert "| optimizer steps | 3 of 3" in card
    assert "library_name: transformers" in (merged / "README.md").read_text()
    assert "merged into the base weights" in (merged / "README.md").read_text()
    for saved in (final, merged):  # each saved with its manifest, which the card and plots written since leave intact
        files = read_manifest(saved)["files"]
        assert "tokenizer.json" in files and "README.md" not in files and verify(saved, threads=1) is None


def test_push_uploads_adapter_and_merged_model_with_cards_and_plots_and_writes_no_token(lora_run, tmp_path,
                                                                                        monkeypatch):
    from huggingface_hub import HfApi

    run_dir = shutil.copytree(lora_run, tmp_path / "lora")
    token = "hf_FAKEtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", token)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("src.publish.hub_reachable", lambda: True)
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = sorted(str(path.relative_to(folder_path)) for path in Path(folder_path).rglob("*") if path.is_file())
        calls.append(("upload_folder", repo_id, files))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    pushed = push_to_hub(run_dir, "my-org/tiny-dpo", private=True)

    assert pushed == {"my-org/tiny-dpo": "https://huggingface.co/my-org/tiny-dpo",
                      "my-org/tiny-dpo-merged": "https://huggingface.co/my-org/tiny-dpo-merged"}
    assert [(name, repo) for name, repo, _ in calls] == [
        ("create_repo", "my-org/tiny-dpo"), ("upload_folder", "my-org/tiny-dpo"),
        ("create_repo", "my-org/tiny-dpo-merged"), ("upload_folder", "my-org/tiny-dpo-merged")]
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True
    adapter_files, merged_files = calls[1][2], calls[3][2]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= set(adapter_files)
    assert {"plots/loss.png", "plots/margins.png"} <= set(adapter_files)
    assert {"model.safetensors", "config.json", "README.md", "plots/loss.png"} <= set(merged_files)
    assert "model.safetensors" not in adapter_files
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or token.encode() not in path.read_bytes(), f"the token was written to {path}"


def test_push_without_a_reachable_hub_is_a_clear_message_and_no_client_call(lora_run, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_TOKEN", "hf_FAKE")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("src.publish.hub_reachable", lambda: False)
    monkeypatch.setattr(HfApi, "create_repo", lambda *args, **kwargs: pytest.fail("the client was called"))
    with pytest.raises(PublishError, match=r"^cannot reach the Hugging Face Hub"):
        push_to_hub(lora_run, "my-org/tiny-dpo")


def test_a_refused_upload_is_one_line_naming_the_repository(lora_run, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_TOKEN", "hf_FAKE")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("src.publish.hub_reachable", lambda: True)

    def refuse(self, repo_id, **kwargs):
        raise PermissionError("403 Forbidden: you cannot create a repository in my-org\nmore detail")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    with pytest.raises(PublishError, match=r"^my-org/tiny-dpo: 403 Forbidden: you cannot create a repository in my-org$"):
        push_to_hub(shutil.copytree(lora_run, tmp_path / "copy"), "my-org/tiny-dpo")


@pytest.mark.parametrize("flags, message", [
    (["--push_to_hub"], "--push_to_hub needs --hub_model_id ORG/NAME"),
    (["--hub_model_id", "not a repo!"], "--hub_model_id 'not a repo!' is not a Hub repository id"),
    (["--hub_strategy", "every_save"], "'hub_strategy' is derived by the toolkit"),
])
def test_hub_flag_mistakes(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", *flags])


def test_trainer_own_push_stays_off(tiny_model, tmp_path):
    """The toolkit owns the push: TRL's config never gets push_to_hub, whatever the flags say."""
    from src.plan import resolve_plan
    from src.world import Devices, World
    from src.trainers.trl_config import build_trl_config

    config = parse_config(["--model_name_or_path", str(tiny_model), "--dataset_name", "d", "--push_to_hub",
                           "--hub_model_id", "my-org/x"])
    plan = resolve_plan(config, World(), Devices(kind="cpu"))
    trl_config = build_trl_config("dpo", config, plan, tmp_path, False, 10)
    assert trl_config.push_to_hub is False and config.hub.push_to_hub is True
