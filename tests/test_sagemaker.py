"""SageMaker's training-toolkit conventions: the SM_* environment becomes defaults that flags override, the
estimator's hyperparameters arrive as `--key value` flags (booleans as "True"), and a real tiny run started the way
SageMaker starts `src/main_distributed.py` leaves its model in SM_MODEL_DIR."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files
from src.config_parse import parse_config, sagemaker_defaults
from src.world import World, sagemaker_process_hint


@pytest.fixture
def sagemaker_env(tmp_path, monkeypatch):
    """The directories SageMaker mounts under /opt/ml, here under tmp_path; the training channel holds one file."""
    paths = {"SM_MODEL_DIR": tmp_path / "opt/ml/model", "SM_OUTPUT_DATA_DIR": tmp_path / "opt/ml/output/data",
             "SM_CHANNEL_TRAINING": tmp_path / "opt/ml/input/data/training"}
    for path in paths.values():
        path.mkdir(parents=True)
    write_jsonl(paths["SM_CHANNEL_TRAINING"] / "pairs.jsonl", preference_rows(48))
    for name, path in paths.items():
        monkeypatch.setenv(name, str(path))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    monkeypatch.setenv("SM_CHANNELS", '["training"]')
    return paths


def test_sagemaker_directories_become_defaults_and_flags_win(sagemaker_env, tmp_path):
    config = parse_config(["--model_name_or_path", "org/model"])
    assert config.training.results_dir == str(sagemaker_env["SM_OUTPUT_DATA_DIR"])
    assert config.training.final_model_dir == str(sagemaker_env["SM_MODEL_DIR"])
    assert config.data.dataset_name == str(sagemaker_env["SM_CHANNEL_TRAINING"] / "pairs.jsonl")
    assert config.recipe is None  # the channel is the data: not the embedded default recipe

    explicit = parse_config(["--model_name_or_path", "org/model", "--dataset_name", "org/data", "--results_dir",
                             str(tmp_path / "mine"), "--final_model_dir", str(tmp_path / "export")])
    assert (explicit.data.dataset_name, explicit.training.results_dir, explicit.training.final_model_dir) == (
        "org/data", str(tmp_path / "mine"), str(tmp_path / "export"))

    # A recipe's dataset gives way to the channel the job was given; flags still win over both.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: org/model\ndataset_name: org/recipe-data\nbeta: 0.2\n")
    from_recipe = parse_config(["--config", str(recipe)])
    assert from_recipe.data.dataset_name == str(sagemaker_env["SM_CHANNEL_TRAINING"] / "pairs.jsonl")
    assert from_recipe.dpo.beta == 0.2


def test_a_channel_with_split_files_is_used_as_a_directory(sagemaker_env):
    channel = sagemaker_env["SM_CHANNEL_TRAINING"]
    (channel / "pairs.jsonl").rename(channel / "train.jsonl")
    write_jsonl(channel / "test.jsonl", preference_rows(8))
    assert sagemaker_defaults()["dataset_name"] == (str(channel), "SM_CHANNEL_TRAINING")


def test_outside_sagemaker_there_are_no_defaults():
    assert sagemaker_defaults({}) == {}


def test_hyperparameters_as_sagemaker_passes_them(sagemaker_env):
    """The training toolkit turns the estimator's hyperparameters into sorted `--key value` pairs, with str() of
    each JSON-decoded value: booleans become "True"/"False", lists their Python repr."""
    config = parse_config(["--learning_rate", "5e-05", "--max_steps", "2", "--merge_adapter", "true",
                           "--model_name_or_path", "org/model", "--report_to", "['tensorboard', 'wandb']",
                           "--use_lora", "True", "--gradient_checkpointing", "False"])
    assert config.model.use_lora is True and config.model.use_peft is True and config.model.merge_adapter is True
    assert config.training.gradient_checkpointing is False
    assert config.training.report_to == ["tensorboard", "wandb"]
    assert (config.training.learning_rate, config.training.max_steps) == (5e-05, 2)


def test_idle_gpus_get_a_hint():
    assert "distribution={'torch_distributed'" in sagemaker_process_hint(World(), {"SM_NUM_GPUS": "8"})
    assert sagemaker_process_hint(World(world_size=8, local_world_size=8), {"SM_NUM_GPUS": "8"}) is None
    assert sagemaker_process_hint(World(), {}) is None


def test_a_run_started_as_sagemaker_starts_it_writes_the_model_into_sm_model_dir(sagemaker_env, tiny_model):
    hyperparameters = ["--batch_size", "4", "--eval_steps", "2", "--judge", "none", "--logging_steps", "1",
                       "--max_length", "64", "--max_new_tokens", "4", "--max_steps", "2", "--model_name_or_path",
                       str(tiny_model), "--num_samples", "2", "--test_size", "4", "--use_lora", "True",
                       "--val_size", "4"]
    result = subprocess.run([sys.executable, "src/main_distributed.py", *hyperparameters], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=600, env=os.environ)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    model_dir = sagemaker_env["SM_MODEL_DIR"]
    assert (model_dir / "adapter_model.safetensors").stat().st_size > 0
    assert {"adapter_config.json", "tokenizer.json", "README.md"} <= {path.name for path in model_dir.iterdir()}
    run_dir = sagemaker_env["SM_OUTPUT_DATA_DIR"] / f"dpo-{tiny_model.name}"
    info = run_files.read_json(run_dir / run_files.TRAINING_INFO)
    assert info["dataset_name"] == str(sagemaker_env["SM_CHANNEL_TRAINING"] / "pairs.jsonl")
    assert info["summary"]["completed_steps"] == 2 and info["use_lora"] is True
    assert info["sources"]["dataset_name"]["from"] == "SageMaker SM_CHANNEL_TRAINING"  # where each setting came from
    assert info["sources"]["max_steps"] == {"value": 2, "from": "--max_steps"}
    assert info["sources"]["mixed_precision"] == {"value": "auto", "from": "src/config.py"}
    assert (run_dir / "report.md").exists()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), model_dir)
    assert any("lora_B" in name and parameter.abs().sum() > 0 for name, parameter in reloaded.named_parameters())
