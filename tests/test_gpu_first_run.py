"""bench/gpu_first_run.py: on CPU its dry run lists every step and each command it would run (and those commands parse
as the tools they call expect); the table it writes on a GPU, from the outputs of real check_gpu reports (the fake
machines of tests/fakes), a pytest JUnit file and bench_dpo.py's table."""

from __future__ import annotations

import shlex
import sys

import pytest

from conftest import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "bench"))

import gpu_first_run  # noqa: E402
from bench_dpo import build_parser as bench_parser  # noqa: E402
from check_gpu import build_parser as check_gpu_parser  # noqa: E402
from check_gpu import options_from  # noqa: E402
from fakes.machines import a100_ecc, fake_sources, h100_nvswitch  # noqa: E402
from src.config_parse import parse_config  # noqa: E402
from src.diagnostics.check import check  # noqa: E402


def _check(spec, *flags) -> dict:
    return check(options_from(check_gpu_parser().parse_args(list(flags))), fake_sources(spec))


@pytest.mark.parametrize("argv, reason", [(["--dry_run"], "asked for"), ([], "no CUDA GPU on this machine")])
def test_the_dry_run_lists_each_step_and_commands_that_parse(argv, reason, capsys, monkeypatch):
    monkeypatch.setattr(gpu_first_run, "cuda_gpus", lambda: 0)
    assert gpu_first_run.main(argv) == 0
    output = capsys.readouterr().out
    assert f"dry run ({reason})" in output and "in 30 minutes at most" in output
    titles = [line for line in output.splitlines() if line[:2] in ("1.", "2.", "3.", "4.")]
    assert len(titles) == 4 and "check_gpu.py" in titles[0] and "pytest -m gpu" in titles[1]
    commands = [shlex.split(line.strip()[2:]) for line in output.splitlines() if line.strip().startswith("$ ")]
    assert len(commands) == 7 and not (PROJECT_ROOT / "results" / "gpu-first-run" / "table.md").exists()
    for command in commands:
        if command[1] == "check_gpu.py":
            options = options_from(check_gpu_parser().parse_args(command[2:]))  # the launcher's parse of its flags
            assert options.num_procs in (None, 1)
        elif command[1:3] == ["-m", "src.main_distributed"]:
            config = parse_config(command[3:], require_sources=False)
            assert config.training.max_steps == 5 and config.data.max_length == 512
        elif command[1] == "bench/bench_dpo.py":
            assert bench_parser().parse_args(command[2:]).arms == "packed"
        else:
            assert command[1:5] == ["-m", "pytest", "-m", "gpu"] and "tests" in command
    assert "--use_lora" in commands[-1] and "--use_lora" not in commands[-3]


def test_only_runs_the_steps_named(capsys, monkeypatch):
    monkeypatch.setattr(gpu_first_run, "cuda_gpus", lambda: 0)
    gpu_first_run.main(["--dry_run", "--only", "bench,memory"])
    output = capsys.readouterr().out
    assert "1. DPO vs `trl dpo`" in output and "2. memory plan" in output and "pytest" not in output


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1"
tests="6" time="212.4"><testcase classname="tests.test_gpu" name="test_auto_precision_follows_the_gpus" time="3.1"/>
<testcase classname="tests.test_gpu" name="test_qlora_trains_on_cuda" time="80.0"><failure message="boom"/></testcase>
</testsuite></testsuites>"""

BENCH = """
| arm | pairs/s | vs trl dpo | peak MB | padding / repeated prompt (policy forward) |
|---|---|---|---|---|
| trl dpo (TRL CLI) | 41.20 | 1.00x | 6120 | n/a |
| toolkit packed, cold cache | 63.10 | 1.53x | 4410 | 0% / 0% |
| toolkit packed, warm cache | 80.90 | 1.96x | 3930 | 56% / 11% (padded: its first batch's log-probs differ; check 0.9 vs 0.1) |

padded forward: 38% padding, 21% repeated prompt; computed / useful tokens 1.94 (packed forward: 1.00)
limit vs plain trl dpo if time ~ tokens: cold cache 1.94x (reached 1.53x, 79%), warm cache 2.59x (reached 1.96x, 76%)
"""


def test_the_table_from_recorded_outputs():
    report = _check(h100_nvswitch())
    machine = gpu_first_run.machine_row(report, "2.13.0+cu128")
    assert machine[1].startswith("8 x NVIDIA H100") and "cc 9.0" in machine[1] and "torch 2.13.0+cu128" in machine[2]
    (check_row,) = gpu_first_run.check_gpu_rows(report)
    assert check_row[1] == f"{report['verdict']} (exit {report['exit_code']})" and f"`{report['command']}`" in check_row[2]
    (ecc_row,) = gpu_first_run.check_gpu_rows(_check(a100_ecc()))
    assert "memory_errors (error), batch_does_not_split (error)" in ecc_row[2]

    tests, failed = gpu_first_run.gpu_test_rows(JUNIT)
    assert failed and tests[0][1] == "4 passed, 1 failures, 1 skipped" and tests[0][2] == "failing: test_qlora_trains_on_cuda"

    bench = gpu_first_run.bench_rows(BENCH)
    assert bench[0] == ("DPO vs trl dpo: packed, cold cache", "1.53x trl dpo's pairs/s",
                        "63.10 vs 41.20 pairs/s; peak 4410 vs 6120 MB; padding / repeated prompt 0% / 0%")
    assert bench[1][2].endswith("(padded: its first batch's log-probs differ; check 0.9 vs 0.1)")  # why it ran padded
    assert len(bench) == 3 and bench[2][1].startswith("cold cache 1.94x")

    step = gpu_first_run.Step("bench", "DPO", 1, lambda work: [], rows=bench, seconds=301.4)
    table = gpu_first_run.render([step], machine, 1234.5).splitlines()
    assert table[0] == "| first run on GPU | result | numbers | s |" and table[2].startswith("| machine | 8 x NVIDIA")
    assert table[3].endswith("| 301 |") and table[4].endswith("|  |") and table[-1] == "| total | | | 1234 |"


def test_the_memory_row_says_whether_the_plan_holds():
    report = _check(h100_nvswitch(), "--params", "7e9", "--use_lora", "--num_procs", "1")
    chosen = next(estimate for estimate in report["memory_plan"]["estimates"] if estimate["chosen"])
    planned = chosen["model_state_bytes"] + chosen["reference_bytes"] + chosen["activation_bytes"]
    row, failed = gpu_first_run.memory_row("LoRA", report, {"summary": {"peak_memory_mb": planned * 0.8 / 2**20}})
    assert not failed and row[1] == "holds: measured 0.80x the plan" and "batch " in row[2]
    row, failed = gpu_first_run.memory_row("LoRA", report, {"summary": {
        "peak_memory_mb": (planned + chosen["margin_bytes"]) * 1.1 / 2**20}})
    assert failed and row[1].startswith("UNDER-ESTIMATES")
    row, failed = gpu_first_run.memory_row("LoRA", report, {})
    assert failed and row[1:] == ("not measured", "no peak in training_info.json")
