"""The report: summary numbers, plots, sample text files, report.md, and `python -m src.reporting RUN_DIR`."""

import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from src.reporting.plots import (CHARTS, MAX_DRAWN_POINTS, dpo_loss_chart, plot_history, smooth, smoothing_span,
                                  thinned)
from src.reporting.report import ReportError, build_report, main, pick_examples, render_samples_text
from src.run_files import METRICS, TRAINING_INFO, read_json, read_jsonl, samples_file, write_json
from src.reporting.summary import summarize
from tests.report_fixtures import (dpo_history, judged_run_dir, pipeline_run_dir, sft_history, training_info,
                                   write_run_dir)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    """A finished, judged DPO run directory with its report built (built once: rendering plots takes a while)."""
    run_dir = judged_run_dir(tmp_path_factory.mktemp("judged") / "run", count=40)
    return run_dir, build_report(run_dir)


def assert_real_png(path: Path) -> None:
    """Written, decodable, and not a blank canvas."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels[..., :3].std() > 0.05


# ------------------------------------------------------------------------------------------------------ summary


def test_summary_of_a_finished_dpo_run():
    history = dpo_history(perf=True)
    summary = summarize(history, "dpo")
    evals = [(record["eval_loss"], record["step"]) for record in history if "eval_loss" in record]
    assert (summary["best_eval_loss"], summary["best_eval_step"]) == min(evals)
    assert summary["final_eval_loss"] == evals[-1][0]
    last_train = [record for record in history if "loss" in record][-1]
    assert summary["final_train_loss"] == last_train["loss"]
    assert summary["final_reward_accuracy_train"] == last_train["rewards/accuracies"]
    last_eval = [record for record in history if "eval_loss" in record][-1]
    assert summary["final_reward_accuracy_eval"] == last_eval["eval_rewards/accuracies"]
    assert summary["finished"] is True and summary["last_step"] == 200
    assert summary["wall_time_s"] == history[-1]["train_runtime"]
    assert summary["train_loss"] == history[-1]["train_loss"]
    assert summary["peak_memory_mb"] == 2000.0
    logged = [record["perf/tokens_per_second"] for record in history if "perf/tokens_per_second" in record]
    assert summary["tokens_per_second"] == pytest.approx(sum(logged) / len(logged))


def test_summary_of_a_crashed_sft_run_without_throughput_records():
    history = sft_history(steps=100, finished=False)
    summary = summarize(history, "sft")
    train = [record for record in history if "num_tokens" in record]
    expected = (train[-1]["num_tokens"] - train[0]["num_tokens"]) / (train[-1]["time_s"] - train[0]["time_s"])
    assert summary["tokens_per_second"] == pytest.approx(expected)
    assert summary["finished"] is False and summary["train_loss"] is None
    assert summary["wall_time_s"] == history[-1]["time_s"] and summary["peak_memory_mb"] is None
    assert summary["final_token_accuracy_train"] == train[-1]["mean_token_accuracy"]
    assert "final_reward_accuracy_train" not in summary


def test_summary_without_eval_or_with_nan_eval():
    summary = summarize(dpo_history(eval_every=None), "dpo")
    assert summary["best_eval_loss"] is None and summary["best_eval_step"] is None
    summary = summarize(dpo_history("nan"), "dpo")
    assert summary["best_eval_step"] == 100 and math.isnan(summary["final_eval_loss"])


# -------------------------------------------------------------------------------------------------------- plots


HISTORIES = {
    "dpo": dpo_history(perf=True), "dpo_no_eval": dpo_history(eval_every=None),
    "dpo_one_point": dpo_history(steps=1, eval_every=None), "dpo_nan": dpo_history("nan", finished=False),
    "sft": sft_history(), "sft_no_eval": sft_history(eval_every=None),
    "sft_one_point": sft_history(steps=1, eval_every=None), "sft_nan": sft_history("nan"),
}


@pytest.mark.parametrize("name", HISTORIES)
def test_plots_are_written_and_non_empty(name, tmp_path):
    stage = name.split("_")[0]
    written = plot_history(HISTORIES[name], stage, tmp_path)
    names = {path.name for _, path in written}
    expected = {"dpo": {"loss.png", "rewards.png", "margins.png", "reward_accuracy.png", "lr_grad_norm.png"},
                "sft": {"loss.png", "token_accuracy.png", "lr_grad_norm.png"}}[stage]
    assert expected <= names
    assert ("throughput.png" in names) == (name == "dpo")  # only when perf/* was logged
    for _, path in written:
        assert_real_png(path)


def test_the_dpo_loss_chart_draws_ln2_only_for_the_sigmoid_loss(tmp_path):
    """ln 2 is where sigmoid DPO starts; a combined loss (the default's sigmoid + 0.4 x sft) starts above it, and the
    line would look like a problem."""
    (panel,) = dpo_loss_chart("sigmoid").panels
    assert [label for _, label in panel.reference_lines] == ["ln 2 = 0.693 (policy = reference)"]
    assert dpo_loss_chart(["sigmoid"], [1.0]) == dpo_loss_chart(None) == CHARTS["dpo"][0]
    combined = dpo_loss_chart(["sigmoid", "sft"], [1.0, 0.4])
    assert combined.panels[0].reference_lines == () and combined.panels[0].title == "DPO loss: sigmoid + 0.4 × sft"
    assert dpo_loss_chart("ipo").panels[0].reference_lines == ()
    info = training_info("dpo", loss_type=["sigmoid", "sft"], config={"loss_type": ["sigmoid", "sft"],
                                                                       "loss_weights": [1.0, 0.4]})
    report = build_report(write_run_dir(tmp_path / "run", HISTORIES["dpo"], info)).read_text(encoding="utf-8")
    assert "![DPO loss (sigmoid + 0.4 × sft)](plots/loss.png)" in report
    assert "| DPO | beta 0.1, loss sigmoid + 0.4 × sft |" in report


def test_a_chart_with_no_data_is_not_written_and_a_partial_one_is(tmp_path):
    history = [{key: value for key, value in record.items() if key != "grad_norm"} for record in sft_history()]
    names = {path.name for _, path in plot_history(history, "sft", tmp_path)}
    assert "lr_grad_norm.png" in names  # the learning rate is still there
    assert plot_history([{"step": 1, "epoch": 0.1, "time_s": 1.0}], "sft", tmp_path / "empty") == []


def test_every_chart_names_its_axes():
    for charts in CHARTS.values():
        for chart in charts:
            for panel in chart.panels:
                assert panel.title and panel.ylabel


def test_smoothing_does_not_lag_a_steep_fall():
    """A loss that falls from 4 to 0.5 between points 10 and 20 of 100: at the middle of the fall (point 15, raw
    2.25) a forward EMA of span 8 still reads 3.1; a centred window over the straight fall reads 2.25 exactly, and
    the curve starts and ends at the raw values."""
    raw = [4.0] * 10 + [4.0 - 0.35 * (index + 1) for index in range(10)] + [0.5] * 80
    smoothed = smooth(raw, span=8)
    assert smoothed[14] == pytest.approx(raw[14])
    assert (smoothed[0], smoothed[-1]) == (raw[0], raw[-1])
    assert smooth([1.0, math.nan, 3.0], span=3) == [1.0, pytest.approx(math.nan, nan_ok=True), 3.0]
    noisy = [1.0 + (0.5 if index % 2 else -0.5) for index in range(40)]
    assert max(abs(value - 1.0) for value in smooth(noisy, span=8)[4:-4]) < 0.1  # per-batch noise ironed out


def test_smoothing_is_the_centred_window_mean_at_any_length():
    """The running-sum smoothing gives each point the mean of the finite values in its centred window, worked out
    here point by point, NaN left out (a long curve: the window is a twelfth of it)."""
    rng = random.Random(0)
    values = [rng.gauss(1.0, 0.3) for _ in range(600)]
    values[100:103] = [math.nan, math.inf, math.nan]
    span = smoothing_span(len(values))
    for index, value in enumerate(smooth(values, span)):
        reach = min(span // 2, index, len(values) - 1 - index)
        window = [item for item in values[index - reach:index + reach + 1] if math.isfinite(item)]
        assert math.isnan(value) if not math.isfinite(values[index]) else value == pytest.approx(
            sum(window) / len(window), rel=1e-9)


def test_a_long_curve_is_drawn_with_as_many_points_as_the_chart_is_wide():
    """27,000 steps logged every step: at most MAX_DRAWN_POINTS points drawn, the curve's lowest and highest values
    and its NaN among them, in step order; a curve that fits is drawn whole."""
    rng = random.Random(1)
    steps = list(range(1, 27001))
    values = [rng.gauss(0.0, 1.0) for _ in steps]
    values[5000], values[20000] = -9.0, math.nan
    drawn_steps, drawn_values = thinned(steps, values)
    assert len(drawn_steps) <= MAX_DRAWN_POINTS + MAX_DRAWN_POINTS // 2 and drawn_steps == sorted(drawn_steps)
    assert min(value for value in drawn_values if math.isfinite(value)) == -9.0
    assert max(drawn_values, key=lambda value: value if math.isfinite(value) else -math.inf) == max(
        value for value in values if math.isfinite(value))
    assert 20001 in drawn_steps and math.isnan(drawn_values[drawn_steps.index(20001)])
    assert thinned(steps[:900], values[:900]) == (steps[:900], values[:900])


# ------------------------------------------------------------------------------------------------------ samples


def test_sample_text_holds_every_prompt_once_with_all_answers(judged_run):
    run_dir, _ = judged_run
    for split in ("val", "test"):
        samples = read_jsonl(run_dir / samples_file(split))
        text = (run_dir / f"distributed_output_{split}.txt").read_text(encoding="utf-8")
        assert text.count("--- PROMPT ---") == 40
        for position, sample in enumerate(samples, start=1):
            assert text.count(f"] {split} #{sample['index']}  ->") == 1
            assert f"[{position}/40] {split} #{sample['index']}" in text
            block = text.split(f"] {split} #{sample['index']}  ->")[1].split("=" * 100 + "\n[")[0]
            for field in ("prompt", "reference_answer", "trained_answer", "chosen"):
                assert sample[field].rstrip() in block
            verdict = sample["verdict"]["trained"]
            correct = "yes" if verdict["correct"] else "no"
            assert f"verdict trained:   score {verdict['score']:g}, correct {correct}" in block
        assert "correct_and_preferred: before" in text.splitlines()[1]


def test_sample_text_without_verdicts_or_chosen():
    samples = [{"index": 0, "split": "val", "prompt": "Q?", "reference_answer": "a", "trained_answer": "b",
                "chosen": None, "rejected": None, "meta": {}, "verdict": None}]
    text = render_samples_text(samples, "val")
    assert "--- TRAINED answer ---\nb" in text and "--- CHOSEN" not in text and "verdict" not in text


def test_examples_prefer_the_biggest_improvement_then_the_worst_regression():
    def sample(index, before, after, same=False):
        return {"index": index, "reference_answer": "x", "trained_answer": "x" if same else f"y{index}",
                "verdict": {"reference": {"reward": before}, "trained": {"reward": after}}}
    samples = [sample(0, 0, 0, same=True), sample(1, 0, 0.5), sample(2, 0, -2), sample(3, 1, 4), sample(4, 0, -1)]
    assert [s["index"] for s in pick_examples(samples)] == [3, 2, 1]
    assert [s["index"] for s in pick_examples(samples[:1] * 1)] == [0]


# ------------------------------------------------------------------------------------------------------- report


def test_report_of_a_judged_dpo_run(judged_run):
    run_dir, report_path = judged_run
    assert report_path == run_dir / "report.md"
    report = report_path.read_text(encoding="utf-8")
    judge = read_json(run_dir / TRAINING_INFO)["judge"]
    lines = report.splitlines()
    assert lines[0] == "**finished** · 200 of 200 steps · training took 1 min 31 s"  # where the run stands
    assert lines[2] == "# DPO run `dpo-example`"
    assert lines[4] == (f"**Verdict:** DPO moved correct-and-preferred from {100 * judge['before']:.1f}% to "
                        f"{100 * judge['after']:.1f}% on 40 held-out test prompts. No health alerts.")
    assert "| batch | 8 per device × 1 accumulation × 2 processes = 16 pairs per optimizer step |" in report
    assert "2.5e-07 at base batch 8 → 5e-07 at batch 16 (linear scaling)" in report
    assert "| versions | python 3.11.9 · torch 2.13.0" in report
    assert "| ↳ preferred |" in report and "| val | correct and preferred | 40 |" in report
    assert "| best eval loss |" in report and "| peak memory per device | 2,000 MB |" in report
    images = [line[line.index("(") + 1:-1] for line in lines if line.startswith("![")]
    assert len(images) == 6 and all((run_dir / image).is_file() for image in images)
    assert report.count("#### test #") == 3 and "#### test #" in report.split("## Sample comparisons")[1]
    assert "No health alerts" in report.split("## Health alerts")[1].split("##")[0]


def test_report_of_a_pipeline_shows_untrained_sft_and_dpo(tmp_path):
    run_dir = pipeline_run_dir(tmp_path / "run")
    build_report(run_dir / "sft")
    report = build_report(run_dir).read_text(encoding="utf-8")
    sft_judge = read_json(run_dir / "sft" / TRAINING_INFO)["judge"]
    dpo_judge = read_json(run_dir / TRAINING_INFO)["judge"]
    assert (f"went from {100 * sft_judge['before']:.1f}% (untrained) to {100 * sft_judge['after']:.1f}% after SFT "
            f"and {100 * dpo_judge['after']:.1f}% after DPO") in report
    assert "| split | metric | n | untrained | after SFT | after DPO | DPO change |" in report
    assert "[SFT stage report](sft/report.md)" in report
    assert "measured its starting model" not in report  # the DPO stage's "before" equals the SFT stage's "after"


def test_pipeline_report_without_the_sft_directory_uses_the_copied_summary(tmp_path):
    """Only the DPO run directory was copied: the SFT numbers come from previous_stage.judge (test split only)."""
    run_dir = pipeline_run_dir(tmp_path / "run")
    shutil.rmtree(run_dir / "sft")
    info = read_json(run_dir / TRAINING_INFO)
    info["judges"]["test"]["before"] += 0.05  # and the DPO stage measured its starting model differently
    write_json(run_dir / TRAINING_INFO, info)
    report = build_report(run_dir).read_text(encoding="utf-8")
    sft = info["previous_stage"]["judge"]
    test_row = next(line for line in report.splitlines() if line.startswith("| test |"))
    assert f"| {100 * sft['before']:.1f}% | {100 * sft['after']:.1f}% |" in test_row
    val_row = next(line for line in report.splitlines() if line.startswith("| val |"))
    assert "| n/a |" in val_row  # the untrained model was judged on test only
    assert "The DPO stage measured its starting model at" in report and "SFT stage report" not in report


def test_report_lists_alerts_first_thing(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", dpo_history("stuck"), training_info("dpo"))
    report = build_report(run_dir).read_text(encoding="utf-8")
    verdict = report.splitlines()[4]
    assert "**1 health alert(s) including 1 error(s):** DPO loss stuck at ln 2" in verdict
    assert "(no held-out judge)" in verdict
    alerts = report.split("## Health alerts")[1].split("\n## ")[0]
    assert "⛔ **error: DPO loss stuck at ln 2" in alerts and "What to do:" in alerts


def test_report_of_a_crashed_run_without_training_info_or_samples(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", sft_history("nan", steps=60, finished=False), info=None)
    with open(run_dir / METRICS, "a", encoding="utf-8") as handle:
        handle.write('{"step": 61, "loss": 0.4')  # torn last line
    report = build_report(run_dir).read_text(encoding="utf-8")
    assert report.startswith("**did not finish** · step 60 · elapsed 12 s\n\n# SFT run `run`")  # stage inferred
    assert "The run did not finish (last logged step 60)" in report
    assert "NaN/inf in the logged metrics" in report and "training_info.json` is missing" in report
    assert (run_dir / "plots" / "loss.png").is_file() and not list(run_dir.glob("distributed_output_*"))


def test_summary_values_from_training_info_fill_gaps_only(tmp_path):
    info = training_info("sft", summary={"peak_memory_mb": 1234.0, "wall_time_s": 99999.0})
    run_dir = write_run_dir(tmp_path / "run", sft_history(), info)
    report = build_report(run_dir).read_text(encoding="utf-8")
    assert "| peak memory per device | 1,234 MB |" in report  # the metrics lack it
    assert "27 h" not in report  # the metrics' own wall time wins


def test_reward_model_judge_results_read_as_win_rates(tmp_path):
    result = {"metric": "win_rate", "n": 50, "before": 0.5, "after": 0.64, "judge": "reward model ./rm",
              "details": {"mean_reward": {"before": -0.2, "after": 0.35}, "outcomes": {"wins": 31, "ties": 2,
                                                                                        "losses": 17}}}
    info = training_info("dpo", judges={"test": result}, judge={**result, "split": "test"})
    run_dir = write_run_dir(tmp_path / "run", dpo_history(), info)
    report = build_report(run_dir).read_text(encoding="utf-8")
    assert "DPO's answers beat the starting model's on 64.0% of 50 held-out test prompts" in report
    assert "| ↳ mean reward |  | -0.2 | 0.35 |  |" in report and "test: 31 wins, 2 ties, 17 losses." in report


# --------------------------------------------------------------------------------------------------------- CLI


def test_cli_rebuilds_a_run_directory_copied_away_from_the_code(tmp_path):
    original = judged_run_dir(tmp_path / "cluster" / "results" / "dpo-example")
    laptop = tmp_path / "laptop" / "dpo-example"
    laptop.mkdir(parents=True)
    for name in (METRICS, TRAINING_INFO, samples_file("val"), samples_file("test")):
        shutil.copy(original / name, laptop / name)
    shutil.rmtree(tmp_path / "cluster")
    completed = subprocess.run([sys.executable, "-m", "src.reporting", str(laptop)], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert f"report: {laptop / 'report.md'}" in completed.stdout and "Health checks: no alerts." in completed.stdout
    assert {path.name for path in laptop.iterdir()} >= {"report.md", "plots", "distributed_output_val.txt",
                                                        "distributed_output_test.txt"}
    for png in (laptop / "plots").iterdir():
        assert_real_png(png)


@pytest.mark.parametrize("metrics, message", [
    (None, "has no metrics.jsonl"),
    ("", "holds no complete record"),
    ('{"step": 1}\nnot json\n{"step": 2}\n', "line 2 is not valid JSON"),
])
def test_cli_rejects_a_bad_run_directory_in_one_line(metrics, message, tmp_path, capsys):
    run_dir = tmp_path
    if metrics is not None:
        (run_dir / METRICS).write_text(metrics)
    assert main([str(run_dir)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and error.count("\n") == 1
    with pytest.raises(ReportError):
        build_report(run_dir)


def test_cli_error_has_no_traceback(tmp_path):
    completed = subprocess.run([sys.executable, "-m", "src.reporting", str(tmp_path / "nope")], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 1 and "Traceback" not in completed.stderr
    assert completed.stderr.strip() == f"error: {tmp_path / 'nope'} is not a directory"
