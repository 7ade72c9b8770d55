"""The live report: the status line, refreshes within their 1% budget, atomic files, and a real 2-process run whose
report says running after its first evaluation and finished at the end."""

from __future__ import annotations

import errno
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

import forked
from conftest import plant
from report_fixtures import dpo_history, judged_run_dir, training_info, write_run_dir
from src import run_files, seams
from src.reporting.compare import compare
from src.reporting.live import LiveReport, build_report_apart
from src.reporting.report import ReportError, build_report
from src.run_safety.disk_space import write_failure_errno
from src.reporting.status import Live, run_state, status_line

NOW = datetime(2026, 11, 23, 17, 40, tzinfo=timezone.utc)


def line(info: dict, metrics: list[dict], live: Live | None = None) -> str:
    return status_line(run_state(info, metrics, live, last_written=NOW, now=NOW))


# ------------------------------------------------------------------------------------------------------ status line


def test_status_line_says_running_step_elapsed_and_eta_while_training():
    metrics = dpo_history(steps=100, eval_every=50, finished=False)
    text = line({"status": "running", "planned_steps": 400}, metrics,
                Live(step=100, total=400, elapsed_s=125.0, eta_s=375.0))
    assert text == ("**running** · step 100 of 400 (25%) · elapsed 2 min 5 s · ETA 6 min 15 s · "
                    "updated 2026-11-23 17:40 UTC")


def test_status_line_from_the_files_of_a_resumed_run_goes_at_the_rate_since_the_resume():
    # time_s restarts at a resume: 100 steps since step 100 took metrics' last time_s; 200 steps remain.
    metrics = [record for record in dpo_history(steps=200, eval_every=None, finished=False) if record["step"] <= 100]
    elapsed = metrics[-1]["time_s"]
    resumed = [{**record, "step": record["step"] + 100} for record in metrics]
    text = line({"status": "running", "planned_steps": 400, "resumes": [{"from_step": 100}]}, resumed)
    assert text.startswith("**running** · step 200 of 400 (50%) · ")
    assert "ETA" in text and "last record 2026-11-23 17:40 UTC (no end recorded" in text
    from src.progress import format_duration
    assert f"ETA {format_duration(2 * elapsed)}" in text


@pytest.mark.parametrize("info, expected", [
    ({"status": "completed"}, "**finished** · 200 of 200 steps · training took"),
    ({"status": "stopped", "stop_reason": "stopped by SIGTERM at step 120: checkpoint ... saved"},
     "**stopped** (by SIGTERM) at step 200 of 200 (100%) · elapsed"),
    ({"status": "diverged", "stop_reason": "r: training diverged at step 150 (loss nan (rank 0)); nothing saved"},
     "**diverged** (loss nan (rank 0)) at step 200 of 200 (100%) · elapsed"),
    ({}, "**finished**"),
])
def test_status_line_for_every_ending(info, expected):
    assert line({"planned_steps": 200, **info}, dpo_history(steps=200)).startswith(expected)


def test_a_run_that_logged_nothing_says_so():
    assert "no step logged yet" in line({"status": "running", "planned_steps": 10}, [])


# ---------------------------------------------------------------------------------------------------- live refresh


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_live_refreshes_follow_evaluations_and_the_timer_and_stay_within_one_percent(tmp_path):
    """A 10,000 s run, evaluated every 500 s, whose refresh takes 3 s: a refresh after each evaluation and every
    300 s between, as long as refreshing stays within 1% of the time so far."""
    clock, refreshed = FakeClock(), []

    def fake_build(run_dir, live):
        refreshed.append((clock.now, live))
        clock.now += 3.0

    paused = []
    report = LiveReport(tmp_path, on_pause=paused.append, clock=clock, max_share=0.01, build=fake_build)
    state = SimpleNamespace(global_step=0, max_steps=1000, is_world_process_zero=True)
    report.on_train_begin(None, state, None)
    for step in range(1, 1001):
        state.global_step = step - 1
        report.on_step_begin(None, state, None)
        assert report.seconds <= 0.01 * (clock.now - report.started) + 1e-9
        clock.now += 10.0
        state.global_step = step
        if step % 50 == 0:
            report.on_evaluate(None, state, None)
    times = [moment for moment, _ in refreshed]
    assert times[0] >= 300  # the first: once 1% of the time so far covers a refresh and the timer is due
    assert len(refreshed) == 33  # the budget allows one per ~300 s: the timer's and the evaluations' together
    assert all(later - earlier >= 290 for earlier, later in zip(times, times[1:]))
    assert paused == [3.0] * len(refreshed)  # each refresh is a pause for the throughput meter
    first = refreshed[0][1]
    assert first.total == 1000 and first.eta_s == pytest.approx(first.elapsed_s / first.step * (1000 - first.step))
    report.on_train_end(None, state, None)
    summary = report.summary()
    assert summary["refreshes"] == len(refreshed) and summary["seconds"] == 3.0 * len(refreshed)
    assert summary["share_of_training"] == pytest.approx(3.0 * len(refreshed) / clock.now, rel=1e-3) and \
        summary["share_of_training"] <= 0.01


def test_evaluations_refresh_at_once_when_the_budget_allows(tmp_path):
    clock, refreshed = FakeClock(), []
    report = LiveReport(tmp_path, clock=clock, max_share=1.0,
                        build=lambda run_dir, live: refreshed.append(live.step) or setattr(clock, "now", clock.now + 0.5))
    state = SimpleNamespace(global_step=0, max_steps=100, is_world_process_zero=True)
    report.on_train_begin(None, state, None)
    for step in range(1, 101):
        clock.now += 1.0
        report.on_step_begin(None, state, None)
        state.global_step = step
        if step % 20 == 0:
            report.on_evaluate(None, state, None)
    report.on_train_end(None, state, None)
    assert refreshed == [20, 40, 60, 80, 100]


def test_a_failing_refresh_warns_once_and_training_goes_on(tmp_path, capsys):
    def broken(run_dir, live):
        raise OSError("disk full")

    clock = FakeClock()
    report = LiveReport(tmp_path, clock=clock, max_share=1.0, build=broken)
    state = SimpleNamespace(global_step=5, max_steps=10, is_world_process_zero=True)
    report.on_train_begin(None, state, None)
    for _ in range(3):
        clock.now += 100
        report.on_evaluate(None, state, None)
        report.on_step_begin(None, state, None)
    assert capsys.readouterr().out.count("warning: the live report could not be refreshed (OSError: disk full)") == 1


def test_other_ranks_never_refresh(tmp_path):
    report = LiveReport(tmp_path, clock=FakeClock(), max_share=1e9, build=lambda *args: pytest.fail("rank 1 refreshed"))
    state = SimpleNamespace(global_step=5, max_steps=10, is_world_process_zero=False)
    report.on_evaluate(None, state, None)
    report.on_step_begin(None, state, None)


# ------------------------------------------------------------------------------------------- a process per refresh


def test_a_refresh_is_drawn_in_a_child_process_and_its_files_are_there_after(tmp_path, monkeypatch):
    """The memory a refresh takes is a child's, given back when it exits (issue 41): the drawing runs in another pid,
    and the parent finds the report it wrote."""
    run_dir = write_run_dir(tmp_path / "run", dpo_history(steps=60, finished=False),
                            training_info("dpo", status="running", planned_steps=120))
    drawn_by = tmp_path / "drawn_by"

    def recording_build(path, live):
        drawn_by.write_text(str(os.getpid()))
        return build_report(path, live)

    monkeypatch.setattr("src.reporting.live.build_report", recording_build)
    build_report_apart(run_dir, Live(step=60, total=120, elapsed_s=60.0, eta_s=60.0))
    assert int(drawn_by.read_text()) != os.getpid()
    assert (run_dir / "report.md").read_text(encoding="utf-8").startswith("**running** · step 60 of 120")
    assert (run_dir / "plots" / "loss.png").stat().st_size > 0


def test_what_a_refresh_raises_in_its_child_is_raised_in_rank_0(tmp_path, monkeypatch):
    with pytest.raises(ReportError, match="has no metrics.jsonl"):  # nothing logged yet: the next refresh tries again
        build_report_apart(tmp_path, Live(step=1, total=2, elapsed_s=1.0, eta_s=1.0))
    # A full disk in the child is the parent's OSError, errno and all (the run then stops on every rank), and the
    # test seam counts writes across children as in one process: the second refresh's report.md is the one to fail.
    run_dir = write_run_dir(tmp_path / "run", dpo_history(steps=20, finished=False), training_info("dpo"))
    plant(monkeypatch, fail_write="report.md#2")
    build_report_apart(run_dir, Live(step=20, total=40, elapsed_s=1.0, eta_s=1.0))
    with pytest.raises(OSError) as raised:
        build_report_apart(run_dir, Live(step=20, total=40, elapsed_s=1.0, eta_s=1.0))
    assert raised.value.errno == errno.ENOSPC and write_failure_errno(raised.value, run_dir) == errno.ENOSPC


def test_a_child_that_does_not_finish_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr("src.reporting.live.build_report", lambda *args: time.sleep(60))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        build_report_apart(tmp_path, Live(step=1, total=2, elapsed_s=1.0, eta_s=1.0), timeout_s=1.0)
    assert time.monotonic() - started < 30


# --------------------------------------------------------------------------------------------------- atomic writes


def test_a_reader_never_sees_a_half_written_report_or_plot(tmp_path):
    """Rebuild the report over and over while another thread reads report.md and a PNG: every read is whole."""
    run_dir = judged_run_dir(tmp_path / "run")
    build_report(run_dir)
    report, plot = run_dir / "report.md", run_dir / "plots" / "loss.png"
    whole_report = report.read_text(encoding="utf-8")
    stop, torn = threading.Event(), []

    def read():
        while not stop.is_set():
            text = report.read_text(encoding="utf-8")
            if not (text.startswith("**finished**") and text.rstrip().endswith(whole_report.rstrip()[-40:])):
                torn.append(("report", len(text)))
            data = plot.read_bytes()
            if not data.endswith(b"IEND\xaeB`\x82"):  # a PNG's last chunk
                torn.append(("png", len(data)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            build_report(run_dir)
    finally:
        stop.set()
        reader.join()
    assert not torn
    assert not [path.name for path in run_dir.rglob(".*tmp*")], "temporary files left behind"


def test_a_crash_while_writing_keeps_the_previous_file(tmp_path):
    path = tmp_path / "report.md"
    run_files.write_text(path, "the previous report\n")
    with pytest.raises(RuntimeError):
        with run_files.atomic_path(path) as temporary:
            temporary.write_text("half a rep", encoding="utf-8")
            raise RuntimeError("killed mid-write")
    assert path.read_text(encoding="utf-8") == "the previous report\n"
    assert [item.name for item in tmp_path.iterdir()] == ["report.md"]


def test_a_run_in_progress_reports_running_from_its_files(tmp_path):
    run_dir = write_run_dir(tmp_path / "run", dpo_history(steps=120, finished=False),
                            training_info(status="running", planned_steps=200))
    text = build_report(run_dir).read_text(encoding="utf-8")
    first, rest = text.split("\n", 1)
    assert first.startswith("**running** · step 120 of 200 (60%) · elapsed") and "ETA" in first
    assert "## Numbers so far" in rest and "Training is still running" in rest and "did not finish" not in rest
    assert "| latest train loss (last logged) |" in rest and "final " not in rest.split("## Setup")[0]


# ------------------------------------------------------------------------------------------------- a real 2-process


def test_a_two_process_run_reports_running_after_its_first_evaluation_then_finished(tiny_model, preference_file,
                                                                                    tmp_path):
    results = tmp_path / "results"
    report = results / "live" / "report.md"
    command = ["--stage", "dpo", "--model_name_or_path", str(tiny_model),
               "--dataset_name", str(preference_file), "--results_dir", str(results), "--run_name", "live",
               "--max_length", "64", "--logging_steps", "1", "--eval_steps", "2", "--max_steps", "8",
               "--batch_size", "8", "--num_samples", "4", "--max_new_tokens", "6", "--judge", "none", "--seed", "3",
               "--val_size", "4", "--test_size", "4"]
    # No budget: this 8-step run would otherwise be too short to earn a refresh before its end. Every first line
    # report.md showed while the job ran: each refresh's, from the seam live_report_log (src/reporting/live.py).
    refreshes = tmp_path / "refreshes.txt"
    environment = seams.env(os.environ | {"OMP_NUM_THREADS": "1", "PREFKIT_LIVE_REPORT_SHARE": "1e9"},
                            live_report_log=str(refreshes))
    job = forked.run_job(2, command, env=environment)  # 2 processes as one job (tests/forked.py)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-4000:]
    first_lines = refreshes.read_text(encoding="utf-8").splitlines()

    running = [text for text in first_lines if text.startswith("**running**")]
    assert running, first_lines
    assert running[0].startswith("**running** · step 2 of 8 (25%) · elapsed") or \
        running[0].startswith("**running** · step 3 of 8"), running  # refreshed at the step after the evaluation
    assert "ETA" in running[0] and "updated" in running[0]
    final = report.read_text(encoding="utf-8").split("\n", 1)[0]
    assert final.startswith("**finished** · 8 of 8 steps · training took"), final

    # Every console line of the training loop carries elapsed time and ETA; the reference pass is one clean line.
    step_lines = [text for text in output.splitlines() if text.lstrip().startswith("step ") and "done in" not in text]
    assert len(step_lines) >= 8 and all("elapsed" in text and "ETA" in text for text in step_lines), step_lines
    assert "\r" not in output and "Computing reference log probs" not in output
    assert "reference log-probs (train): 40/40 pairs (100%)" in output

    info = run_files.read_json(results / "live" / run_files.TRAINING_INFO)
    assert info["live_report"]["refreshes"] >= 1
    throughput = [record["perf/tokens_per_second"] for record in run_files.read_jsonl(results / "live" / "metrics.jsonl")
                  if "perf/tokens_per_second" in record]
    assert throughput and min(throughput) > 0  # evaluation and refresh pauses left out, never over-subtracted
    index = (results / "index.md").read_text(encoding="utf-8")
    assert "| [live](live/report.md) | finished | DPO |" in index

    # The real run beside two synthetic ones of other global batches (8, 16, 32): one page on pairs seen.
    from test_compare import sweep

    synthetic = sweep(tmp_path / "synthetic")[:2]
    page = compare([str(results / "live"), *map(str, synthetic)], str(tmp_path / "comparison"))
    text = page.read_text(encoding="utf-8")
    assert "because the global batches differ (live: 8, batch16: 16, batch32: 32)" in text
    assert "| live | **finished** · 8 of 8 steps" in text and "](loss.png)" in text
    assert "| live | 1× cpu" not in text and "| live | 2× cpu | 8 |" in text
