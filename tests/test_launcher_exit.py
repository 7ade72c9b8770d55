"""A stop the job chose is recorded for run_distributed.sh and the worker exits 0 (no torchrun restart, no failure
report); outside the launcher, or for a crash, the status is the worker's own."""

import re
from pathlib import Path

import pytest

from src.run_safety import launcher_exit
from src.run_safety.exit_status import FINAL, ExitStatus


@pytest.fixture
def under_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFKIT_EXIT_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "3")
    return tmp_path


@pytest.mark.parametrize("code", FINAL)
def test_a_chosen_stop_is_recorded_and_the_worker_exits_0(under_launcher, code):
    assert launcher_exit.recorded() is None
    assert launcher_exit.settle(code) == 0
    assert (under_launcher / "rank-3").read_text() == f"{int(code)}\n"
    assert launcher_exit.recorded() == code, "a restarted worker finds it"
    assert [path.name for path in under_launcher.iterdir()] == ["rank-3"], "no temporary file left"


@pytest.mark.parametrize("code", [0, 1, 130, 143])
def test_success_crashes_and_signals_keep_their_status(under_launcher, code):
    assert launcher_exit.settle(code) == code and launcher_exit.recorded() is None


def test_outside_the_launcher_the_status_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.delenv("PREFKIT_EXIT_DIR", raising=False)
    assert launcher_exit.settle(5) == 5
    monkeypatch.setenv("PREFKIT_EXIT_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # python -m src.main_distributed with the variable left in the shell
    assert launcher_exit.settle(5) == 5 and list(tmp_path.iterdir()) == []


def test_docs_reliability_has_a_row_for_every_exit_status():
    """docs/reliability.md's table follows src/run_safety/exit_status.py: each status has its row, and no row names
    another."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text()
    table = doc[doc.index("### Exit statuses"):]
    rows = {int(number) for row in re.findall(r"^\| ([0-9 /]+) \|", table, re.M) for number in row.split("/")}
    assert rows == {int(status) for status in ExitStatus}
