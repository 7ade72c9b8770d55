"""A training process imports neither bitsandbytes without 4/8-bit, nor a tracker not asked for, nor deepspeed without
DeepSpeed (src/unneeded_libraries.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src.config_parse import parse_config
from src.unneeded_libraries import unneeded_libraries


def config_of(*flags):
    return parse_config(["--model_name_or_path", "m", "--dataset_name", "d.jsonl", *flags])


@pytest.mark.parametrize("flags, engine, unneeded", [
    ([], None, ["bitsandbytes", "wandb", "trackio", "deepspeed"]),
    (["--use_peft", "true", "--load_in_4bit", "true"], None, ["wandb", "trackio", "deepspeed"]),
    (["--load_in_8bit", "true"], None, ["wandb", "trackio", "deepspeed"]),
    (["--optim", "paged_adamw_8bit"], None, ["wandb", "trackio", "deepspeed"]),  # transformers' bitsandbytes optimizers
    (["--optim", "adamw_torch"], None, ["bitsandbytes", "wandb", "trackio", "deepspeed"]),
    (["--report_to", "wandb"], None, ["bitsandbytes", "trackio", "deepspeed"]),
    (["--report_to", "trackio"], None, ["bitsandbytes", "wandb", "deepspeed"]),
    (["--report_to", "tensorboard"], None, ["bitsandbytes", "wandb", "trackio", "deepspeed"]),
    (["--stage", "sft_then_dpo", "--sft.report_to", "wandb"], None, ["bitsandbytes", "trackio", "deepspeed"]),
    ([], "deepspeed", ["bitsandbytes", "wandb", "trackio"]),  # STRATEGY=zero1|2|3 (src/engines.py)
    ([], "fsdp", ["bitsandbytes", "wandb", "trackio", "deepspeed"]),
    (["--deepspeed", "ds_config.json"], None, ["bitsandbytes", "wandb", "trackio"]),  # TRL's own, passed through
    (["--stage", "sft_then_dpo", "--sft.deepspeed", "ds_config.json"], None, ["bitsandbytes", "wandb", "trackio"]),
])
def test_what_a_run_does_not_need(flags, engine, unneeded, tmp_path):
    assert unneeded_libraries(config_of(*flags), [str(tmp_path)], engine) == unneeded


def test_a_checkpoint_saved_in_4_bits_keeps_bitsandbytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert unneeded_libraries(config_of(), [str(tmp_path)]) == ["wandb", "trackio", "deepspeed"]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert unneeded_libraries(config_of(), [str(tmp_path)]) == ["bitsandbytes", "wandb", "trackio", "deepspeed"]
    # a Hub id that is not in the local cache: its config cannot be read, so bitsandbytes stays importable
    assert unneeded_libraries(config_of(), ["someone/not-cached-model"]) == ["wandb", "trackio", "deepspeed"]


def test_a_training_process_does_not_import_them(tiny_model, tmp_path):
    # Each costs every training process (~1.6 s, ~1 s, ~0.2 s, 0.4-1.0 s of CPU here); LoRA goes through peft without
    # them, a checkpoint (TRL's model card asks for trackio's space) without trackio, DDP without deepspeed.
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16))
    flags = ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--results_dir",
             str(tmp_path / "results"), "--stage", "dpo", "--use_peft", "true", "--max_steps", "1", "--batch_size",
             "4", "--max_length", "64", "--eval_strategy", "no", "--save_steps", "1", "--num_samples", "0",
             "--judge", "none", "--val_size", "0", "--test_size", "0"]
    script = ("import json, sys\nfrom src.main_distributed import main\n"
              f"code = main({flags!r})\n"
              "print(json.dumps([code, [name for name in ('bitsandbytes', 'wandb', 'trackio', 'deepspeed', 'peft') "
              "if sys.modules.get(name)]]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == '[0, ["peft"]]'


def test_a_launch_without_deepspeed_leaves_it_out_before_any_model_is_built_or_read(monkeypatch):
    """transformers imports deepspeed whenever it is installed, as soon as its model code loads: building the embedded
    model on a new machine did, in the preflight of a DDP launch (a dry run too), and DeepSpeed's accelerator notice
    was its first line. The preflight leaves deepspeed out first, before it resolves (or builds) the model."""
    from src.pipeline import preflight

    order = []

    def resolve_model_path(*args):
        order.append(("model", None))
        raise StopIteration  # what comes after is not this test's

    monkeypatch.setattr(preflight, "skip_imports", lambda names: order.append(("skip", names)) or names)
    monkeypatch.setattr(preflight, "resolve_model_path", resolve_model_path)
    with pytest.raises(StopIteration):
        preflight.prepare(config_of("--dry_run"), stages=[])
    assert order == [("skip", ["deepspeed"]), ("model", None)]
