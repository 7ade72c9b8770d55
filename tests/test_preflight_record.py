"""A preflight that passed is not redone while its inputs are the same (src/preflight_record.py), and is redone when
any of them changes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src.config import Devices, World, parse_config
from src.main_distributed import plan_stages
from src.preflight_record import record_key

HEAVY = ("torch", "transformers", "datasets")


@pytest.fixture
def launch(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    return {"model": model, "data": data,
            "args": ["--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
                     str(tmp_path / "results"), "--stage", "dpo", "--max_length", "64", "--batch_size", "8"]}


def key_of(args):
    config = parse_config(args)
    return record_key(config, plan_stages(config, World(), Devices("cpu")), config.model.model_name_or_path)


def test_the_key_follows_every_input(launch, tmp_path):
    args, model, data = launch["args"], launch["model"], launch["data"]
    first = key_of(args)
    assert first is not None and key_of(args) == first
    assert key_of(args + ["--max_length", "48"]) != first  # the configuration
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    with_template = key_of(args + ["--chat_template_path", str(template)])
    assert with_template != first
    template.write_text("{{ messages }} ")
    assert key_of(args + ["--chat_template_path", str(template)]) != with_template  # the template file
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + " ")
    second = key_of(args)
    assert second != first  # a file of the model directory
    write_jsonl(data, preference_rows(25))
    assert key_of(args) != second  # the data file
    # inputs that cannot be read without loading them: checked in full every time
    assert key_of(args + ["--judge", "tests.round_judges:by_length"]) is None
    assert key_of(args + ["--chat_template_path", "someone/a-hub-tokenizer"]) is None


def dry_run(args):
    script = ("import json, sys\nfrom src.main_distributed import main\n"
              f"code = main({[*args, '--dry_run']!r})\n"
              f"print(json.dumps([code, [name for name in {HEAVY!r} if name in sys.modules]]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PREFKIT_QUIET_DRY_RUN="0"))
    assert result.returncode == 0, result.stderr[-3000:]
    *printed, modules = result.stdout.strip().splitlines()
    return printed, json.loads(modules)[1]


def test_a_passed_preflight_is_not_redone_until_an_input_changes(launch):
    config = launch["model"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 48}))
    args = launch["args"]  # --max_length 64 past a rotary model's 48 positions: a warning the record must repeat
    printed, imported = dry_run(args)
    assert imported == list(HEAVY)  # the first check loads the tokenizer and prepares the data
    assert any("warning" in line and "48" in line for line in printed) and any("rows" in line for line in printed)
    again, imported = dry_run(args)
    assert imported == [] and again == printed  # the same plan, data summary and warnings, without the imports
    config.write_text(json.dumps(json.loads(config.read_text())))  # the same model, rewritten: checked again
    _, imported = dry_run(args)
    assert imported == list(HEAVY)
