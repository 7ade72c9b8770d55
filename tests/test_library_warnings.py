"""The libraries' lines on a run's console (src/library_warnings.py): each known-harmless one dropped by its exact
message, any other warning shown once per process however often the filters change. An engine run's whole console
against DDP's: tests/test_engines.py (forked jobs), tests/test_two_hosts.py (run_distributed.sh and accelerate launch)."""

from __future__ import annotations

import builtins
import contextlib
import io
import logging
import warnings

import pytest

from src import library_warnings
from src.library_warnings import HARMLESS, LOGGER, PRINTED, WARNING


@pytest.fixture
def console(monkeypatch):
    """This process's warnings as a fresh one has them, installed, shown into a string (pytest records them)."""
    shown = io.StringIO()
    with warnings.catch_warnings():
        warnings.resetwarnings()
        monkeypatch.setattr(warnings, "showwarning",
                            lambda message, category, *args, **kwargs: shown.write(f"{category.__name__}: {message}\n"))
        monkeypatch.setattr(library_warnings, "_shown", {})
        library_warnings.install()
        yield shown


def test_a_warning_nobody_listed_shows_once_however_often_the_filters_change(console):
    for _ in range(3):
        warnings.warn("your learning rate is odd", UserWarning)
        with warnings.catch_warnings():  # what torch and DeepSpeed do inside every step: Python forgets what it showed
            warnings.simplefilter("default")
    warnings.warn("another one", UserWarning)
    assert console.getvalue().splitlines() == ["UserWarning: your learning rate is odd", "UserWarning: another one"]


def test_the_listed_warnings_are_dropped_by_their_exact_message(console):
    for entry in HARMLESS:
        if entry.channel == WARNING and ".*" not in entry.message:
            warnings.warn(entry.message, getattr(builtins, entry.category))
            warnings.warn(entry.message + " Soon.", FutureWarning)  # not the exact message: news, shown
    assert console.getvalue().count("Soon.") == sum(
        entry.channel == WARNING and ".*" not in entry.message for entry in HARMLESS) == 2
    assert all(line.endswith("Soon.") for line in console.getvalue().splitlines())


def test_a_libraries_log_line_is_dropped_and_its_other_lines_are_not(console):
    entry = next(entry for entry in HARMLESS if entry.channel == LOGGER and entry.message)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(entry.logger)
    logger.addHandler(handler)
    try:
        logger.warning(f"[RANK 0] {entry.message}2. Using DeepSpeed's value.")
        logger.warning("something else")
        library_warnings.install()  # twice: still one filter
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == ["something else"]
    assert sum(getattr(existing, "message", None) == entry.message for existing in logger.filters) == 1


def test_a_printed_line_is_dropped_and_the_lines_around_it_are_printed():
    (line,) = [entry.message for entry in HARMLESS if entry.channel == PRINTED]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), library_warnings.printed_lines_dropped():
        print("before")
        print(line)
        print("after", end="")
    assert out.getvalue() == "before\nafter"


def test_deepspeed_is_told_the_accelerator_only_where_no_gpu_driver_is(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(library_warnings, "gpu_device_files", lambda: [])
    assert library_warnings.launch_environment() == {"DS_ACCELERATOR": "cpu"}
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # the user's own choice is kept, and passed on as it is
    assert library_warnings.launch_environment() == {"DS_ACCELERATOR": "xpu"}
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(library_warnings, "gpu_device_files", lambda: ["/dev/nvidia0"])
    assert library_warnings.launch_environment() == {}  # DeepSpeed looks for itself, and says what it found


def test_every_entry_says_why_it_is_harmless():
    for entry in HARMLESS:
        assert entry.channel in (WARNING, LOGGER, PRINTED, library_warnings.ENVIRONMENT) and entry.source
        assert len(entry.why) > 40, entry
