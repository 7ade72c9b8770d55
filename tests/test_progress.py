"""src/progress.py: one clean line, redrawn on a terminal, a few plain lines in a log file, with rate and ETA."""

from __future__ import annotations

import io

from src.progress import Progress, eta_seconds, format_duration


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_format_duration_and_eta():
    assert format_duration(4.25) == "4.2 s"
    assert format_duration(42) == "42 s"
    assert format_duration(185) == "3 min 5 s"
    assert format_duration(2 * 3600 + 7 * 60 + 20) == "2 h 7 min"
    assert format_duration(None) == "n/a" and format_duration(float("nan")) == "n/a"
    # 25 of 100 done in 10 s: 75 left at 2.5 per second
    assert eta_seconds(25, 100, 10.0) == 30.0
    assert eta_seconds(0, 100, 10.0) is None and eta_seconds(5, None, 10.0) is None


def test_log_file_gets_few_plain_lines_with_rate_and_eta():
    clock, log = FakeClock(), io.StringIO()
    progress = Progress("tokenizing train", total=1000, stream=log, log_every=30, delay=2, clock=clock)
    for _ in range(100):  # 100 s of work, 10 rows per second
        clock.now += 1
        progress.update(10)
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 5  # at 2 s, 32 s, 62 s, 92 s, and the closing line
    assert lines[0] == "tokenizing train: 20/1,000 rows (2%)  10 rows/s  elapsed 2.0 s  ETA 1 min 38 s"
    assert lines[-1] == "tokenizing train: 1,000/1,000 rows (100%)  10 rows/s  elapsed 1 min 40 s"


def test_terminal_redraws_one_line_and_ends_it():
    clock, terminal = FakeClock(), Terminal()
    with Progress("reference pass", total=50, unit="pairs", stream=terminal, delay=0, redraw_every=0.2,
                  clock=clock) as progress:
        for _ in range(50):
            clock.now += 0.5
            progress.update()
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.count("\r") == 51  # every update redraws (0.5 s apart), then the closing line
    assert text.rstrip("\n").split("\r")[-1].startswith("reference pass: 50/50 pairs (100%)")


def test_quick_work_prints_only_the_closing_line_and_disabled_prints_nothing():
    clock, log = FakeClock(), io.StringIO()
    with Progress("tokenizing validation", total=10, stream=log, clock=clock) as progress:
        clock.now += 0.5
        progress.update(10)
    assert log.getvalue().count("\n") == 1
    silent = io.StringIO()
    with Progress("x", total=10, stream=silent, enabled=False, delay=0, clock=clock) as progress:
        clock.now += 100
        progress.update(10)
    assert silent.getvalue() == "" and progress.done == 10
