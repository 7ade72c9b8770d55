"""`python -m src.reporting.compare` and results/index.md, on synthetic run directories (tests/report_fixtures.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT
from report_fixtures import judged_run_dir, pipeline_run_dir, sft_history, training_info, write_run_dir
from src.reporting.compare import CompareError, compare, main
from src.reporting.index import write_index
from src.run_files import append_jsonl, read_json, read_jsonl, write_json


def sweep(root: Path) -> list[Path]:
    """Three finished DPO runs that differ in global batch (16, 32, 64) and learning rate, all else equal."""
    runs = []
    for name, batch, rate, trained in (("batch16", 16, 5e-7, (0.78, 0.6)), ("batch32", 32, 7e-7, (0.78, 0.85)),
                                       ("batch64", 64, 1e-6, (0.7, 0.9))):
        run_dir = judged_run_dir(root / name, trained=trained)
        metrics = read_jsonl(run_dir / "metrics.jsonl")  # a bigger batch moves more tokens per second
        (run_dir / "metrics.jsonl").unlink()
        for record in metrics:
            for key in ("perf/tokens_per_second", "perf/samples_per_second"):
                if key in record:
                    record[key] *= batch / 16
            append_jsonl(run_dir / "metrics.jsonl", record)
        info = read_json(run_dir / "training_info.json")
        info.update(run_name=name, global_batch_size=batch, per_device_batch_size=batch // 2, learning_rate=rate,
                    status="completed", config={"batch_size": batch, "learning_rate": rate, "beta": 0.1,
                                                "seed": 42, "output_dir": f"/somewhere/{name}"},
                    summary={"wall_time_s": 90.0 * batch / 16, "throughput": {"tokens_per_second": 400.0 * batch}})
        write_json(run_dir / "training_info.json", info)
        runs.append(run_dir)
    return runs


def test_compare_three_runs_with_different_global_batches(tmp_path):
    runs = sweep(tmp_path / "results")
    page = compare([str(path) for path in runs])
    assert page == tmp_path / "results" / "comparisons" / "batch16_vs_batch32_vs_batch64" / "compare.md"
    text = page.read_text(encoding="utf-8")

    # A common axis: the global batches differ, so pairs seen.
    assert "**pairs seen** (step × global batch), because the global batches differ (batch16: 16, batch32: 32, " \
           "batch64: 64)" in text
    for name in ("loss", "rewards_chosen", "rewards_margins", "rewards_accuracies"):
        assert f"]({name}.png)" in text and (page.parent / f"{name}.png").stat().st_size > 10_000

    # Only the settings that differ, one column per run; output_dir differs by nature and is left out.
    settings = text.split("## Settings that differ")[1].split("##")[0]
    assert "| `global_batch_size` | 16 | 32 | 64 |" in settings
    assert "| `learning_rate` | 5e-07 | 7e-07 | 1e-06 |" in settings
    assert "`beta`" not in settings and "`seed`" not in settings and "output_dir" not in settings

    # Judged results side by side, each with its interval.
    judged = text.split("## Judged results")[1].split("##")[0]
    for name in ("batch16", "batch32", "batch64"):
        assert f"| {name} | test | correct and preferred | 40 |" in judged
    assert judged.count("% ±") == 12  # before and after, val and test, three runs

    throughput = text.split("## Throughput")[1]
    assert "| batch16 | 2× cpu | 16 | 6,400 | 3,200 |" in throughput and "| batch64 | 2× cpu | 64 | 25,600 | 12,800 |" \
        in throughput
    assert (page.parent / "throughput.png").is_file()


def test_compare_the_same_batch_uses_steps_and_a_glob_and_a_results_folder(tmp_path):
    results = tmp_path / "results"
    for name in ("lr_a", "lr_b"):
        judged_run_dir(results / name)
    (results / "notes.txt").write_text("not a run")
    page = compare([str(results / "lr_*")], str(tmp_path / "out"))
    assert page == tmp_path / "out" / "compare.md"
    assert "**optimizer steps** (every run has the same global batch, 16)" in page.read_text(encoding="utf-8")
    page = compare([str(results)], str(tmp_path / "all"))
    assert "# 2 runs compared" in page.read_text(encoding="utf-8")


def test_runs_of_different_stages_get_a_section_each(tmp_path):
    judged_run_dir(tmp_path / "dpo")
    judged_run_dir(tmp_path / "sft", stage="sft")
    text = compare([str(tmp_path / "dpo"), str(tmp_path / "sft")], str(tmp_path / "out")).read_text(encoding="utf-8")
    assert "## Curves: DPO runs" in text and "## Curves: SFT runs" in text
    assert "](dpo_loss.png)" in text and "](sft_loss.png)" in text and "](sft_mean_token_accuracy.png)" in text


@pytest.mark.parametrize("arguments, message", [
    ([], "error: no run directories given"),
    (["{missing}"], "does not exist"),
    (["{empty}"], "is not a run directory (no metrics.jsonl or training_info.json) and holds none"),
    (["{no_metrics}", "{run}"], "has no metrics (metrics.jsonl missing or empty): nothing to compare"),
    (["{run}"], "only one run"),
    (["{glob_nothing}"], "matches nothing"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, arguments, message):
    (tmp_path / "empty").mkdir()
    write_json((tmp_path / "no_metrics").mkdir() or tmp_path / "no_metrics" / "training_info.json", {"stage": "dpo"})
    judged_run_dir(tmp_path / "run")
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "no_metrics": tmp_path / "no_metrics",
             "run": tmp_path / "run", "glob_nothing": tmp_path / "nothing_*"}
    assert main([argument.format(**paths) for argument in arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert message in captured.err


def test_the_command_prints_the_page_path(tmp_path):
    runs = sweep(tmp_path / "results")
    completed = subprocess.run([sys.executable, "-m", "src.reporting.compare", *map(str, runs), "--output",
                                str(tmp_path / "o")], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == f"comparison: {tmp_path / 'o' / 'compare.md'}"


def test_index_lists_every_run_with_status_stage_settings_judged_and_time(tmp_path):
    results = tmp_path / "results"
    sweep(results)
    pipeline_run_dir(results / "default")
    write_run_dir(results / "crashed", sft_history(finished=False),
                  training_info("sft", status="running", planned_steps=400))
    (results / "comparisons").mkdir()  # not a run
    text = write_index(results).read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]  # below the header
    assert [row.split(" | ")[0] for row in rows] == ["| batch16", "| batch32", "| batch64", "| crashed", "| default"]
    batch16 = rows[0]
    assert "| finished | DPO | `tiny-llama-2x64` | `embedded:arithmetic-style` | batch 16 · lr 5e-07 · β 0.1 sigmoid" \
           " · 2× cpu | correct and preferred: " in batch16 and "| 1 min 30 s |" in batch16
    assert " → " in batch16 and "±" in batch16
    assert "| running 200/400 | SFT |" in rows[3]
    pipeline = rows[4]
    assert "| SFT → DPO |" in pipeline and pipeline.count(" → ") >= 3  # untrained → after SFT → after DPO


def test_the_ln2_line_is_drawn_only_when_every_run_used_the_sigmoid_loss(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = {}
    real_savefig = Figure.savefig

    def savefig(figure, path, *args, **kwargs):
        drawn[figure.axes[0].get_title(loc="left")] = [line.get_label() for ax in figure.axes for line in ax.lines]
        return real_savefig(figure, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    runs = [judged_run_dir(tmp_path / "results" / name) for name in ("plain", "rpo")]
    compare([str(path) for path in runs], str(tmp_path / "sigmoid"))
    assert any("ln 2" in label for label in drawn["DPO loss"])

    info = read_json(runs[1] / "training_info.json")
    write_json(runs[1] / "training_info.json", info | {"config": {"loss_type": ["sigmoid", "sft"],
                                                                  "loss_weights": [1.0, 0.4]}})
    drawn.clear()
    compare([str(path) for path in runs], str(tmp_path / "mixed"))
    assert drawn["DPO loss"] and not any("ln 2" in label for label in drawn["DPO loss"])
    assert any("chance" in label for label in drawn["Reward accuracy"])  # the other references stay
