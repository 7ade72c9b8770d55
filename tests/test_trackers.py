"""Experiment trackers: real short runs whose TensorBoard event files, W&B offline run and trackio database are read
back; an uninstalled tracker refused before any process group or model."""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import forked
from conftest import PROJECT_ROOT
from src import run_files
from src.config_error import ConfigError
from src.config_parse import parse_config


def tracked_run(tiny_model, preference_file, results: Path, run_name: str, trackers: list[str], env: dict,
                stage: str = "dpo", fresh: bool = True):
    args = ["--stage", stage, "--model_name_or_path", str(tiny_model), "--dataset_name", str(preference_file),
            "--results_dir", str(results), "--run_name", run_name, "--max_length", "64", "--logging_steps", "1",
            "--eval_steps", "2", "--num_samples", "2", "--max_new_tokens", "4", "--judge", "none", "--seed", "3",
            "--val_size", "4", "--test_size", "4", "--batch_size", "4", "--max_steps", "3", "--learning_rate",
            "1e-3", "--report_to", *trackers] + (["--sft.max_steps", "2"] if stage == "sft_then_dpo" else [])
    # A fresh interpreter, not a fork, for wandb and trackio: they read their settings (WANDB_*, TRACKIO_DIR, HOME)
    # when imported, and a fork would keep those of the test process, whichever test imported them first. TensorBoard
    # reads none (`fresh=False`: forked, tests/forked.py).
    if fresh:
        result = subprocess.run([sys.executable, "-m", "src.main_distributed", *args], cwd=PROJECT_ROOT,
                                capture_output=True, text=True, timeout=600, env=env)
    else:
        result = forked.run_main(args, env=env, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result, run_files.read_json(results / run_name / run_files.TRAINING_INFO)


def test_tensorboard_event_files_hold_the_loss_the_plan_and_the_final_numbers(tiny_model, preference_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, info = tracked_run(tiny_model, preference_file, tmp_path / "results", "tb", ["tensorboard"], os.environ,
                          fresh=False)
    log_dir = tmp_path / "results" / "tb" / "tensorboard"
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [1, 2, 3]
    logged = [record["loss"] for record in run_files.read_jsonl(tmp_path / "results" / "tb" / run_files.METRICS)
              if "loss" in record]
    assert [event.value for event in losses] == pytest.approx(logged, rel=1e-6)

    def text(tag: str) -> str:
        return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()

    logged_info = json.loads("\n".join(line[4:] for line in text("prefkit/training_info").splitlines()))
    assert logged_info["global_batch_size"] == 4 and logged_info["world_size"] == 1
    assert logged_info["learning_rate"] == pytest.approx(info["learning_rate"])
    assert logged_info["config"]["beta"] == 0.1 and logged_info["config"]["report_to"] == ["tensorboard"]
    assert "4 per device × 1 accumulation × 1 processes = 4 pairs" in text("prefkit/setup")
    assert "final train loss" in text("prefkit/final_numbers")
    # The HParams row: the plan with its outcome, in the same directory.
    assert events.Scalars("final/completed_steps")[0].value == 3
    hparams = EventAccumulator(str(log_dir)).Reload().PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams and b"global_batch_size" in hparams[
        "_hparams_/session_start_info"]


def read_wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-<id>.wandb`): LevelDB log framing (32 KiB blocks, 7-byte chunk headers:
    crc32, little-endian length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) after a 7-byte ':W&B' file header; each record
    is a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, records, pending = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_without_a_key_logs_offline_and_trackio_locally(tiny_model, preference_file, tmp_path):
    """Both stages of an SFT-then-DPO run, each its own run in its own stage directory; the DPO stage read back."""
    env = {key: value for key, value in os.environ.items() if key not in ("WANDB_MODE", "WANDB_API_KEY", "NETRC")}
    env |= {"HOME": str(tmp_path / "home"), "TRACKIO_DIR": str(tmp_path / "trackio")}
    result, info = tracked_run(tiny_model, preference_file, tmp_path / "results", "wt", ["wandb", "trackio"], env,
                               stage="sft_then_dpo")
    assert "logging offline (WANDB_MODE=offline)" in result.stdout
    assert len(glob.glob(str(tmp_path / "results" / "wt" / "sft" / "wandb" / "offline-run-*"))) == 1

    (run_file,) = glob.glob(str(tmp_path / "results" / "wt" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb_records(Path(run_file))
    config = {item.key: json.loads(item.value_json) for record in records if record.HasField("config")
              for item in record.config.update}
    assert config["prefkit"]["global_batch_size"] == 4 and config["prefkit"]["config"]["beta"] == 0.1
    assert config["learning_rate"] == pytest.approx(info["learning_rate"])  # TRL's arguments, from WandbCallback
    summary = {item.key: json.loads(item.value_json) for record in records if record.HasField("summary")
               for item in record.summary.update if item.key}
    assert summary["final/completed_steps"] == 3
    assert summary["final/final_train_loss"] == pytest.approx(info["summary"]["final_train_loss"])

    (database,) = glob.glob(str(tmp_path / "trackio" / "*.db"))
    with sqlite3.connect(database) as connection:
        configs = [json.loads(row[0]) for row in connection.execute("select config from configs where run_name='wt'")]
        metrics = [json.loads(row[0]) for row in connection.execute("select metrics from metrics where run_name='wt'")]
    assert configs[-1]["prefkit"]["global_batch_size"] == 4 and configs[-1]["learning_rate"] == pytest.approx(
        info["learning_rate"])
    assert [record["train/loss"] for record in metrics if "train/loss" in record] == pytest.approx(
        [record["loss"] for record in run_files.read_jsonl(tmp_path / "results" / "wt" / run_files.METRICS)
         if "loss" in record], rel=1e-6)
    assert any(record.get("final/completed_steps") == 3 for record in metrics)
    with sqlite3.connect(database) as connection:
        assert {row[0] for row in connection.execute("select run_name from configs")} == {"wt/sft", "wt"}


def test_an_uninstalled_tracker_is_one_line_before_any_process_group(tiny_model, preference_file, tmp_path,
                                                                       monkeypatch, capsys):
    from src import main_distributed
    from src.pipeline import training

    monkeypatch.setitem(sys.modules, "trackio", None)  # what `import trackio` meets when it is not installed

    def never(*args, **kwargs):
        raise AssertionError("reached a process group or a model load")

    monkeypatch.setattr(main_distributed, "init", never)
    monkeypatch.setattr(training, "load_model", never)
    code = main_distributed.main(["--model_name_or_path", str(tiny_model), "--dataset_name", str(preference_file),
                                  "--results_dir", str(tmp_path / "results"), "--report_to", "tensorboard", "trackio"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("error: --report_to trackio: the trackio package is not installed: "
                                               "pip install trackio")


@pytest.mark.parametrize("trackers, message", [
    (["mlflw"], "--report_to mlflw: not a supported tracker; choose from none, tensorboard, wandb, trackio"),
    (["none", "wandb"], "'none' cannot be combined with a tracker"),
])
def test_unknown_tracker_names_are_refused(trackers, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--model_name_or_path", "m", "--dataset_name", "d", "--report_to", *trackers])


def test_tracker_directories_sit_in_the_run_directory_unless_the_user_chose(tmp_path):
    from src.trackers import tracker_environment

    run_dir = tmp_path / "results" / "run"
    assert tracker_environment(["tensorboard", "wandb"], run_dir, {}) == {
        "TENSORBOARD_LOGGING_DIR": str(run_dir / "tensorboard"), "WANDB_DIR": str(run_dir)}
    assert tracker_environment(["wandb"], run_dir, {"WANDB_DIR": "/elsewhere"}) == {"WANDB_DIR": "/elsewhere"}
    assert tracker_environment(["none"], run_dir, {}) == {}


def closed_port() -> int:
    import socket

    with socket.socket() as probe:  # bound then closed: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_wandb_server_is_found_before_training_and_the_run_logs_offline(tiny_model, preference_file,
                                                                                       tmp_path):
    """A key in the environment (a cluster's shell profile) and no network: the probe fails in a moment, the run logs
    offline into its own directory, says how to sync, and exits 0 (wandb alone retries for about 2 minutes, then
    fails the run with a CommError traceback)."""
    server = f"http://127.0.0.1:{closed_port()}"
    env = {key: value for key, value in os.environ.items() if key != "WANDB_MODE"}
    env |= {"WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": server}
    result, info = tracked_run(tiny_model, preference_file, tmp_path / "results", "offline", ["wandb"], env)
    assert f"W&B: {server} cannot be reached, so logging offline (WANDB_MODE=offline); upload it later with " \
           "`wandb sync <run dir>/wandb/offline-run-*`" in result.stdout
    assert result.stdout.index("cannot be reached") < result.stdout.index("== DPO"), "found before training"
    assert "Traceback" not in result.stderr and info["status"] == "completed"
    assert glob.glob(str(tmp_path / "results" / "offline" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert not (PROJECT_ROOT / "wandb").exists(), "tracker files belong in the run directory"

    online_only = subprocess.run([sys.executable, "-m", "src.main_distributed", "--model_name_or_path",
                                  str(tiny_model), "--dataset_name", str(preference_file), "--results_dir",
                                  str(tmp_path / "results"), "--run_name", "online", "--report_to", "wandb"],
                                 cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
                                 env=env | {"WANDB_MODE": "online"})
    assert online_only.returncode == 2 and "Traceback" not in online_only.stderr
    (line,) = [line for line in online_only.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --report_to wandb: the W&B server {server} cannot be reached and WANDB_MODE="
                           "online asks for online logging only"), line
    assert not (tmp_path / "results" / "online").exists()


def test_a_malformed_wandb_key_is_one_line(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "WANDB_MODE"} | {"WANDB_API_KEY": "short"}
    result = subprocess.run([sys.executable, "-m", "src.main_distributed", "--model_name_or_path", "m",
                             "--dataset_name", "d", "--results_dir", str(tmp_path), "--report_to", "wandb"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "--report_to wandb: WANDB_API_KEY invalid: API key must have 40+ characters" in line
    assert "fix WANDB_API_KEY" in line
