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
from src.config_parse import parse_config
from src.world import Devices, World
from src.pipeline.stages import plan_stages
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
    # a module:function judge is imported by every launch, recorded or not: its name is in the key (the configuration)
    with_function_judge = key_of(args + ["--judge", "tests.round_judges:by_length"])
    assert with_function_judge not in (None, key_of(args))
    # inputs that cannot be read without loading them: checked in full every time
    assert key_of(args + ["--chat_template_path", "someone/a-hub-tokenizer"]) is None


def dry_run(args, expect: int = 0, **env):
    script = ("import json, sys\nfrom src.main_distributed import main\n"
              f"code = main({[*args, '--dry_run']!r})\n"
              f"print(json.dumps([code, [name for name in {HEAVY!r} if name in sys.modules]]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, PREFKIT_QUIET_DRY_RUN="0", **env))
    assert result.returncode == 0, result.stderr[-3000:]
    *printed, outcome = result.stdout.strip().splitlines()
    code, modules = json.loads(outcome)
    assert code == expect, result.stderr[-3000:]
    return (result.stderr.strip().splitlines() if expect else printed), modules


def test_a_passed_preflight_is_not_redone_until_an_input_changes(launch, tmp_path):
    """... and a `module:function` judge, which every launch imports (input_checks.check_judge) and none of the
    recorded checks reads, is checked again on a recorded launch: a judge gone since is refused."""
    config = launch["model"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 48}))
    judges = tmp_path / "judges"
    judges.mkdir()
    (judges / "my_judge.py").write_text("def score(prompt, answer, meta=None):\n    return 1.0\n")
    # --max_length 64 past a rotary model's 48 positions: a warning the record must repeat
    # (no .pyc: the judge is rewritten at the same size within a second, which a .pyc's mtime would not see)
    args = launch["args"] + ["--judge", "my_judge:score"]
    judge_path = {"PYTHONPATH": str(judges), "PYTHONDONTWRITEBYTECODE": "1"}
    printed, imported = dry_run(args, **judge_path)
    assert imported == list(HEAVY)  # the first check loads the tokenizer and prepares the data
    assert any("warning" in line and "48" in line for line in printed) and any("rows" in line for line in printed)
    again, imported = dry_run(args, **judge_path)
    assert imported == [] and again == printed  # the same plan, data summary and warnings, without the imports
    (judges / "my_judge.py").write_text("def other(prompt, answer, meta=None):\n    return 1.0\n")
    refused, imported = dry_run(args, expect=2, **judge_path)
    assert refused == ["error: --judge my_judge:score: my_judge has no function 'score'"] and imported == []
    (judges / "my_judge.py").write_text("def score(prompt, answer, meta=None):\n    return 0.0\n")
    config.write_text(json.dumps(json.loads(config.read_text())))  # the same model, rewritten: checked again
    _, imported = dry_run(args, **judge_path)
    assert imported == list(HEAVY)
