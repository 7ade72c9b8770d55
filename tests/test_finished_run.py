"""A finished run relaunched (issue 33): the same command finishes the run's end and exits 0 without training; a kill
at each step of the end (src/run_safety/finished_run.py END_STEPS) is relaunched to the files of a run never killed.

Two real training launches (one process, the tiny model, 4 steps), shared by every case: a run never killed, and one
killed right after training finished. Each case copies the killed run, relaunches it killed at one end step
(the seam kill_after_end_step: the process SIGKILLs itself there, no timing), then relaunches it plainly.

    python -m pytest -q -n 0 tests/test_finished_run.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import forked
from conftest import PROJECT_ROOT, preference_rows, write_jsonl
from src import run_files, seams
from src.run_safety.finished_run import END_STEPS
from src.run_safety.run_lock import hold_path

# What two runs of one command measure differently (times, speeds, memory, the launch's own history): not compared.
MEASURED_INFO = {"started_at", "finished_at", "resumes", "live_report", "forward", "reference_log_probs", "one_job",
                 "disk_estimate"}
MEASURED_SUMMARY = {"wall_time_s", "peak_memory_mb", "throughput", "tokens_per_second", "samples_per_second"}
MEASURED_METRICS = ("time_s", "train_runtime", "train_samples_per_second", "train_steps_per_second", "perf/")


def job_args(model: Path, data: Path, results: Path) -> list[str]:
    return ["--stage", "dpo", "--model_name_or_path", str(model), "--dataset_name", str(data), "--results_dir",
            str(results), "--run_name", "job", "--batch_size", "4", "--max_steps", "4", "--save_steps", "2",
            "--eval_strategy", "no", "--logging_steps", "1", "--num_samples", "2", "--max_new_tokens", "4",
            "--judge", "none", "--learning_rate", "1e-3", "--max_length", "64", "--val_size", "2", "--test_size", "2",
            "--seed", "5"]


def launch(args: list[str], kill_after: str | None = None, launcher: bool = False) -> subprocess.CompletedProcess:
    """python -m src.main_distributed ARGS (one process), or ./run_distributed.sh 1 ARGS."""
    environ = {key: value for key, value in os.environ.items() if key != seams.VARIABLE} | {"OMP_NUM_THREADS": "1"}
    if kill_after:
        environ = seams.env(environ, kill_after_end_step=kill_after)
    if not launcher:
        return forked.run_main(args, env=environ, timeout=300)
    return subprocess.run(["bash", "run_distributed.sh", "1", *args], cwd=PROJECT_ROOT,
                          env=environ | {"PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """(data, the never-killed run's results folder, the results folder of a run killed right after training)."""
    root = tmp_path_factory.mktemp("finished")
    data = write_jsonl(root / "pairs.jsonl", preference_rows(24))
    reference = launch(job_args(tiny_model, data, root / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = launch(job_args(tiny_model, data, root / "killed"), kill_after="trained")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    return data, root / "reference", root / "killed"


def copy_results(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def _folder_text(path: Path, results: Path, *more: Path) -> str:
    text = path.read_text(encoding="utf-8")
    for folder in (results, *more):
        text = text.replace(str(folder), "RESULTS")
    return text


def _without(record: dict, measured) -> dict:
    return {key: value for key, value in record.items() if not key.startswith(tuple(measured))}


def comparable(path: Path, results: Path, moved_from: Path | None = None):
    """A run file as two runs of one command must agree on it: paths made relative (to `results`, or to the folder
    the results were copied from), measurements left out."""
    def _text(path: Path, results: Path) -> str:
        return _folder_text(path, results, *([moved_from] if moved_from else []))

    relative = path.relative_to(results)
    if path.suffix in (".safetensors", ".png", ".complete") or path.name.startswith("."):
        return path.read_bytes() if path.suffix == ".safetensors" else "present"
    if path.suffix in (".pt", ".pth", ".bin"):
        return "present"  # pickles that hold the launch's own paths and times
    if path.name == run_files.TRAINING_INFO:
        info = json.loads(_text(path, results))
        info["summary"] = _without(info.get("summary") or {}, MEASURED_SUMMARY)
        return _without(info, MEASURED_INFO)
    if path.name == run_files.METRICS:
        return [_without(json.loads(line), MEASURED_METRICS) for line in _text(path, results).splitlines()]
    if path.name == "trainer_state.json":
        state = json.loads(_text(path, results))
        return [_without(record, MEASURED_METRICS) for record in state["log_history"]]
    if relative.parts[1:] == ("model", "README.md"):  # TRL's own card: its tags come from a set, in any order
        return sorted(_text(path, results).splitlines())
    if path.suffix == ".md":  # report, index, model cards: every line but those that carry a measurement
        return [line for line in _text(path, results).splitlines()
                if not any(word in line for word in ("took", "throughput", "wall time", "peak memory", "started",
                                                     "DPO forward", " s |", "(UTC)"))] + [str(relative)]
    return _text(path, results)


def assert_same_files(results: Path, reference: Path, moved_from: Path | None = None) -> None:
    files = {path.relative_to(results): path for path in results.rglob("*") if path.is_file()}
    expected = {path.relative_to(reference): path for path in reference.rglob("*") if path.is_file()}
    assert sorted(files) == sorted(expected)
    for name, path in files.items():
        assert comparable(path, results, moved_from) == comparable(expected[name], reference), name


@pytest.mark.parametrize("step", END_STEPS)
def test_a_kill_at_each_end_step_is_relaunched_to_the_files_of_a_run_never_killed(step, runs, tiny_model, tmp_path):
    data, reference, killed = runs
    results = copy_results(killed, tmp_path / "results")
    args = job_args(tiny_model, data, results)
    if step != "trained":  # the copy was killed right after training: relaunched, it is killed at the next step
        again = launch(args, kill_after=step)
        assert again.returncode == -signal.SIGKILL, again.stderr[-3000:]
        assert "step     5/" not in again.stdout, "a resume from the final checkpoint trains nothing"
    assert hold_path(results / "job").exists(), "the kill leaves its hold behind"
    finished = launch(args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    if END_STEPS.index(step) < END_STEPS.index("completed"):
        assert "resuming from" in finished.stdout and "(step 4 of 4)" in finished.stdout
    else:
        assert finished.stdout.strip().splitlines() == [finished.stdout.strip()], "one line, nothing trained"
        assert "is already finished" in finished.stdout
    assert "step     5/" not in finished.stdout
    assert not hold_path(results / "job").exists(), "the hold is released"
    assert run_files.read_json(results / "job" / run_files.TRAINING_INFO)["status"] == "completed"
    assert_same_files(results, reference)


def test_the_launcher_finishes_a_finished_run_before_torchrun(runs, tiny_model, tmp_path):
    """The pages a kill left unwritten are written by the launcher's preflight, which then starts no worker."""
    data, reference, _ = runs
    results = copy_results(reference, tmp_path / "results")
    run_dir = results / "job"
    for page in (run_dir / "report.md", results / "index.md", run_dir / "model" / "final" / "README.md"):
        page.unlink()
    shutil.rmtree(run_dir / "plots")
    metrics_written = (run_dir / run_files.METRICS).stat().st_mtime_ns
    result = launch(job_args(tiny_model, data, results), launcher=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].strip().startswith(f"{run_dir} is already finished (at "), lines
    assert "4 steps): DPO ran 4 steps" in lines[0] and lines[0].endswith("Nothing to train: exiting 0.")
    assert (run_dir / run_files.METRICS).stat().st_mtime_ns == metrics_written
    assert not hold_path(run_dir).exists()
    assert_same_files(results, reference, moved_from=reference)


def test_another_configuration_is_refused_naming_each_difference(runs, tiny_model, tmp_path):
    data, reference, _ = runs
    results = copy_results(reference, tmp_path / "results")
    changed = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24, seed=1))
    args = job_args(tiny_model, changed, results) + ["--beta", "0.3", "--report_to", "tensorboard"]
    result = launch(args + ["--dry_run"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "already holds a finished run of another configuration (" in error
    assert "beta: 0.1 → 0.3" in error and f'dataset_name: "{data}" → "{changed}"' in error
    assert "report_to" not in error, "a tracker does not make another run"
    assert f"data: {changed} was not among the finished run's sources" in error


def test_the_same_data_copied_elsewhere_is_the_same_and_other_bytes_are_not(runs, tmp_path):
    """The fingerprint follows the bytes: a touched file with the same bytes is the same data."""
    from src.run_safety.finished_run import _data_differences, data_fingerprint

    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(24))
    recorded = json.loads(json.dumps(data_fingerprint([str(data)])))
    os.utime(data, ns=(1, 1))
    assert _data_differences(recorded, [str(data)]) == []
    write_jsonl(data, preference_rows(24, seed=3))
    (difference,) = _data_differences(recorded, [str(data)])
    assert difference.startswith(f"data: {data}: ") and "sha256" in difference
