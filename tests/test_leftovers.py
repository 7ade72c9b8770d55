"""Nothing left behind: a preparation killed midway leaves no `.building-<pid>` directory once the next one runs,
and a writer killed mid-write leaves no temporary file once the next job holds the run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from conftest import PROJECT_ROOT
from src import run_files
from src.run_safety.build_once import build_once, is_complete
from test_resilience import wait_for


def test_a_build_killed_midway_is_cleaned_up_by_the_next_one(tmp_path):
    target = tmp_path / "cache" / "prepared"
    started = tmp_path / "started"
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(PROJECT_ROOT)!r})
        from pathlib import Path
        from src.run_safety.build_once import build_once

        def build(directory):
            (directory / "half.arrow").write_bytes(b"x" * 1000)
            Path({str(started)!r}).write_text("")
            time.sleep(600)

        build_once(Path({str(target)!r}), build)
        """)])
    try:
        wait_for(started.exists, timeout=60, what="the build to start")
        leftover = target.parent / f".prepared.building-{builder.pid}"
        assert leftover.is_dir()
        os.kill(builder.pid, signal.SIGKILL)  # a preparation killed midway (Ctrl-C twice, OOM killer, preemption)
        builder.wait(timeout=30)
    finally:
        builder.kill() if builder.poll() is None else None
    assert leftover.is_dir() and not target.exists()

    built = build_once(target, lambda directory: (directory / "data.arrow").write_text("whole"))
    assert is_complete(built) and (built / "data.arrow").read_text() == "whole"
    assert sorted(path.name for path in target.parent.iterdir()) == [".prepared.lock", "prepared"]


def test_temporary_files_of_a_killed_writer_are_removed(tmp_path):
    run_dir = tmp_path / "job"
    run_files.write_json(run_dir.mkdir() or run_dir / run_files.TRAINING_INFO, {"status": "running"})
    (run_dir / f".{run_files.TRAINING_INFO}.tmp4242").write_text('{"status": "runn')
    (run_dir / "sft").mkdir()
    (run_dir / "sft" / f".{run_files.TRAINING_INFO}.tmp77").write_text("")
    (run_dir / ".keep.tmpfile").write_text("not ours")
    removed = run_files.remove_temporary_files(run_dir)
    assert sorted(path.name for path in removed) == [f".{run_files.TRAINING_INFO}.tmp4242",
                                                     f".{run_files.TRAINING_INFO}.tmp77"]
    assert sorted(path.name for path in run_dir.rglob("*")) == [".keep.tmpfile", "sft", run_files.TRAINING_INFO]
