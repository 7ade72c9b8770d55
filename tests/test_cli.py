"""The command line: mistakes get one line naming the flag, file, row or column, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import forked
from conftest import PROJECT_ROOT, preference_rows, write_jsonl


def run_main(*args, timeout=120, env=None):
    """`python -m src.main_distributed ARGS`, forked (tests/forked.py): what the command prints and exits with."""
    return forked.run_main(list(args), env=env, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def user_args(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    return ["--model_name_or_path", str(tiny_model), "--dataset_name", str(data), "--results_dir",
            str(tmp_path / "results"), "--max_length", "64"]


@pytest.mark.parametrize("extra, fragments", [
    (["--learnign_rate", "1e-4"], ["unknown key 'learnign_rate'", "did you mean 'learning_rate'"]),
    (["--batch_size", "-4"], ["--batch_size must be a positive whole number"]),
    (["--packed_attention", "flex"], ["--packed_attention flex needs a CUDA GPU", "no backward on CPU"]),
    (["--config", "configs/nope.yaml"], ["configs/nope.yaml does not exist"]),
])
def test_config_mistakes(extra, fragments, user_args):
    assert_one_line_error(run_main(*user_args, *extra), *fragments)


def test_data_and_model_mistakes(user_args, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{oops\n')
    swap = user_args.index("--dataset_name") + 1
    assert_one_line_error(run_main(*user_args[:swap], str(bad), *user_args[swap + 1:]), "bad.jsonl line 2",
                          "not valid JSON")
    model = user_args.index("--model_name_or_path") + 1
    assert_one_line_error(run_main(*user_args[:model], str(tmp_path / "no_model"), *user_args[model + 1:]),
                          "no_model: no such directory")


def test_dry_run_prints_the_plan_and_trains_nothing(user_args, tmp_path):
    result = run_main(*user_args, "--stage", "dpo", "--batch_size", "8", "--dry_run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "8 per device x 1 accumulation x 1 processes = 8 global" in result.stdout
    assert "rows" in result.stdout and not (tmp_path / "results").exists()


def test_the_preflight_does_not_import_the_training_stack(user_args):
    # run_distributed.sh runs this check before every launch: transformers' trainer utilities pull in peft and
    # bitsandbytes (8 s of CPU on this machine), matplotlib another second, and the check needs none of them.
    heavy = ("peft", "bitsandbytes", "matplotlib", "transformers.trainer_utils", "trl.trainer.dpo_trainer", "deepspeed")
    script = ("import json, sys\nfrom src.main_distributed import main\n"
              f"code = main({[*user_args, '--stage', 'dpo', '--dry_run']!r})\n"
              f"print(json.dumps([code, [name for name in {heavy!r} if sys.modules.get(name)]]))")  # None: marked absent
    result = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[0, []]"


def test_debug_shows_the_traceback(user_args):
    result = run_main(*user_args, "--batch_size", "0", "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_launcher_refuses_bad_flags_before_starting_workers(user_args):
    result = subprocess.run(["bash", "run_distributed.sh", "2", *user_args, "--batch_size", "3"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=120,
                            env=os.environ | {"PYTHON": sys.executable})
    assert_one_line_error(result, "--batch_size 3 cannot be split across 2 processes")
    assert "ChildFailedError" not in result.stderr  # torchrun never started
    # the command that runs: the nearest batch that splits, the learning rate still tuned for 3
    assert f"; run: ./run_distributed.sh 2 {' '.join(user_args)} --batch_size 2 --base_batch_size 3" in result.stderr


def test_corrupt_or_incomplete_weights_are_named_before_anything_loads(user_args, tiny_model, tmp_path):
    import shutil

    model = user_args.index("--model_name_or_path") + 1
    copy = shutil.copytree(tiny_model, tmp_path / "model")
    weights = copy / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) - 100])  # a download cut short
    assert_one_line_error(run_main(*user_args[:model], str(copy), *user_args[model + 1:]),
                          "model.safetensors is corrupt", "truncated")
    weights.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")  # an LFS pointer
    assert_one_line_error(run_main(*user_args[:model], str(copy), *user_args[model + 1:]), "model.safetensors is corrupt")
    weights.unlink()
    (copy / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    assert_one_line_error(run_main(*user_args[:model], str(copy), *user_args[model + 1:]),
                          "names shards that are missing: model-00001-of-00002.safetensors")


def test_no_hub_message_when_nothing_needs_the_hub(user_args):
    """An offline machine (the Hub endpoint refuses connections): local or embedded model and data say nothing about
    the Hub; a Hub id still gets the message, once."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there: the probe fails at once
    message = "the Hugging Face Hub is unreachable"
    model, data = user_args.index("--model_name_or_path") + 1, user_args.index("--dataset_name") + 1
    launches = [user_args, user_args[:model] + ["embedded"] + user_args[model + 1:],
                user_args[:data] + ["some-org/some-pairs"] + user_args[data + 1:]]
    # One fresh interpreter (the libraries read the Hub settings when they are imported) forks each command line:
    # each its own process, as a new command would be, with those settings.
    script = ("import json, sys\nsys.path[:0] = ['tests', '.']\nimport forked\nforked.WARM = False\n"
              "print(json.dumps([vars(forked.run_main(argv)) for argv in json.loads(sys.argv[1])]))")
    fresh = subprocess.run([sys.executable, "-c", script, json.dumps([[*args, "--stage", "dpo", "--dry_run"]
                                                                      for args in launches])],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    *local, hub_data = [subprocess.CompletedProcess(**result) for result in json.loads(fresh.stdout)]
    for result in local:
        assert result.returncode == 0, result.stderr[-2000:]
        assert message not in result.stdout + result.stderr
    assert (hub_data.stdout + hub_data.stderr).count(message) == 1
    assert_one_line_error(hub_data, "--dataset_name some-org/some-pairs")

