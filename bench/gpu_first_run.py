"""The first run on a GPU machine: everything GPU-specific in one command, and one markdown table to paste into docs.

    python bench/gpu_first_run.py              # on a GPU machine: under 30 minutes on one GPU
    python bench/gpu_first_run.py --dry_run    # what it would run (what it does on a machine without a CUDA GPU)

In this order, each step under its own time limit and all of them under --minutes (30):

1. check_gpu.py --json on the real driver (with --bench on 2+ GPUs): its verdict, problems and launch command.
2. The GPU tests: python -m pytest -m gpu (every test with the marker, in one process: they share the GPU).
3. The DPO benchmark against TRL's own CLI (bench/bench_dpo.py, the packed arms, a 12 x 768 Llama): pairs/s and GPU
   memory of `trl dpo` and of the toolkit, cold and warm reference cache, interleaved.
4. The packed forward's attention (bench/bench_packed_attention.py, at most 8 minutes): `trl dpo`, the padded forward,
   the packed forward on the dense mask and on FlexAttention's block-sparse mask, reference cold and cached, at the
   125M, Qwen2.5-0.5B and 1.5B shapes on UltraFeedback-like and long-prompt lengths (its own table beside this one).
5. The memory plan against the measured peak: check_gpu.py's plan of a DPO run (full fine-tune, then LoRA) on one
   GPU, of a generated 12 x 1024 Llama on pairs that fill --max_length, and then that run for a few steps; its peak
   (torch's most allocated, training_info.json) against the plan's model state + reference + activations.

Writes results/gpu-first-run/table.md (each step's log beside it) and prints the table; exits 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "gpu-first-run"
GIB = 1024**3
# The memory step's run: pairs that fill max_length (a worst case the plan is written for), one GPU.
MEMORY_MODEL = {"hidden": 1024, "layers": 12}
MEMORY_FLAGS = ["--stage", "dpo", "--batch_size", "8", "--max_length", "512"]
MEMORY_METHODS = {"full fine-tune": ("full", []), "LoRA": ("lora", ["--use_lora"])}  # the plan's method, flags
ATTENTION_MINUTES = 6  # starts no new model past this; the last one (1.5B) may take ~2 more
BENCH_FLAGS = ["--hidden", "768", "--layers", "12", "--steps", "40", "--repeats", "2", "--arms", "packed"]


@dataclass
class Step:
    key: str
    title: str
    budget_s: int  # the most this step may take; the run stops a step at its budget or at the overall deadline
    commands: Callable[[Path], list[list[str]]]  # what it runs (listed by the dry run)
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (what, result, numbers) for the table
    report: dict = field(default_factory=dict)  # check_gpu.py's JSON (the machine row)
    seconds: float = 0.0
    failed: bool = False


# --------------------------------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------------------------------


def check_gpu_command(work: Path, gpus: int) -> list[str]:
    return [sys.executable, "check_gpu.py", "--json"] + (["--bench"] if gpus > 1 else [])


def gpu_tests_command(work: Path) -> list[str]:
    # every test with the gpu marker (tests/test_gpu.py, the packed DPO forward's), in one process: they share the GPU
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "tests",
            "--junitxml", str(work / "gpu-tests.xml")]


def bench_command(work: Path) -> list[str]:
    return [sys.executable, "bench/bench_dpo.py", *BENCH_FLAGS]


def attention_command(work: Path) -> list[str]:
    return [sys.executable, "bench/bench_packed_attention.py", "--minutes", str(ATTENTION_MINUTES),
            "--out", str(OUT / "packed_attention.md")]


def memory_flags(work: Path, method: str) -> list[str]:
    return ["--model_name_or_path", str(work / "memory" / "model"), "--dataset_name", str(work / "memory" / "data"),
            *MEMORY_FLAGS, *MEMORY_METHODS[method][1]]


def memory_commands(work: Path, method: str) -> list[list[str]]:
    """check_gpu.py's plan for the run, then the run (5 steps on GPU 0)."""
    run_name = "memory-" + method.split()[0].lower()
    return [[sys.executable, "check_gpu.py", "--json", "--num_procs", "1", *memory_flags(work, method)],
            [sys.executable, "-m", "src.main_distributed", *memory_flags(work, method), "--max_steps", "5",
             "--results_dir", str(work / "results"), "--run_name", run_name, "--save_strategy", "no",
             "--eval_strategy", "no", "--num_samples", "0", "--judge", "none", "--val_size", "0", "--test_size", "0",
             "--overwrite"]]


def steps(gpus: int) -> list[Step]:
    return [
        Step("check_gpu", "check_gpu.py on the real driver", 180, lambda work: [check_gpu_command(work, gpus)]),
        Step("gpu_tests", "GPU tests (`pytest -m gpu`)", 600, lambda work: [gpu_tests_command(work)]),
        Step("bench", "DPO vs `trl dpo` (bench/bench_dpo.py)", 600, lambda work: [bench_command(work)]),
        Step("attention", "packed attention: dense vs block-sparse (bench/bench_packed_attention.py)", 480,
             lambda work: [attention_command(work)]),
        Step("memory", "memory plan vs measured peak", 360,
             lambda work: [command for method in MEMORY_METHODS for command in memory_commands(work, method)]),
    ]


# --------------------------------------------------------------------------------------------------------------------
# What each step's output says (pure functions: tests/test_gpu_first_run.py feeds them recorded outputs)
# --------------------------------------------------------------------------------------------------------------------


def machine_row(report: dict, torch_version: str) -> tuple[str, str, str]:
    driver = report.get("driver") or {}
    gpus = report.get("gpus") or []
    names: dict[str, int] = {}
    for gpu in gpus:
        label = (f"{gpu.get('name')} (cc {'.'.join(map(str, gpu.get('compute_capability') or []))}, "
                 f"{(gpu.get('memory_total_bytes') or 0) / GIB:.1f} GiB)")
        names[label] = names.get(label, 0) + 1
    listed = ", ".join(f"{count} x {label}" for label, count in names.items()) or "no GPU reported"
    return ("machine", listed, f"driver {driver.get('driver_version', '?')} (CUDA "
                               f"{driver.get('cuda_driver_version', '?')}), torch {torch_version}")


def check_gpu_rows(report: dict) -> list[tuple[str, str, str]]:
    problems = report.get("problems") or []
    named = ", ".join(f"{problem['code']} ({problem['severity']})" for problem in problems) or "none"
    bench = report.get("bench") or {}
    bandwidth = ""
    if bench.get("attempts"):  # 2+ GPUs: the largest message's bus bandwidth of the last attempt (nccl-tests' busbw)
        points = bench["attempts"][-1].get("points") or []
        if points:
            best = max(points, key=lambda point: point["size_bytes"])
            bandwidth = (f"; all-reduce bus bandwidth {best['busbw_gbps']:.0f} GB/s at "
                         f"{best['size_bytes'] / 2**20:.0f} MiB ({bench.get('outcome')})")
    return [("check_gpu.py (real driver)", f"{report.get('verdict')} (exit {report.get('exit_code')})",
             f"problems: {named}{bandwidth}; command `{report.get('command')}`")]


def gpu_test_rows(junit_xml: str) -> tuple[list[tuple[str, str, str]], bool]:
    root = ElementTree.fromstring(junit_xml)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failing = [case.get("name") for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    result = f"{passed} passed" + "".join(f", {counts[key]} {key}" for key in ("failures", "errors", "skipped")
                                          if counts[key])
    return [("GPU tests (`pytest -m gpu`)", result, "failing: " + (", ".join(failing) or "none"))], bool(failing)


def bench_rows(output: str) -> list[tuple[str, str, str]]:
    """bench_dpo.py's table: each toolkit arm against trl dpo (pairs/s and peak memory), and the limit line."""
    arms = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 4 and (cells[0].startswith(("trl", "toolkit"))):
            arms[cells[0]] = cells
    baseline = next((cells for name, cells in arms.items() if name.startswith("trl")), None)
    rows = []
    for name, cells in arms.items():
        if name.startswith("trl") or baseline is None:
            continue
        rows.append((f"DPO vs trl dpo: {name.removeprefix('toolkit ')}", f"{cells[2]} trl dpo's pairs/s",
                     f"{cells[1]} vs {baseline[1]} pairs/s; peak {cells[3]} vs {baseline[3]} MB"
                     + (f"; padding / repeated prompt {cells[4]}" if len(cells) > 4 else "")))
    limit = re.search(r"^limit vs plain trl dpo.*$", output, re.M)
    if limit and rows:
        rows.append(("DPO vs trl dpo: the limit if time ~ tokens", limit.group(0).split(": ", 1)[-1], ""))
    return rows


def attention_rows(report: dict) -> list[tuple[str, str, str]]:
    """bench_packed_attention.py's JSON: per model and lengths, each packed arm against `trl dpo`, cold and cached."""
    rows = []
    for result in report["results"]:
        arms = result["arms"]
        ratio = lambda key: f"{arms[key]['vs_trl_dpo']:.2f}x" if key in arms else "not run"  # noqa: E731
        found = [name for name in ("packed flex", "packed dense", "padded") if f"{name}, cold" in arms]
        numbers = "; ".join(f"{name}: cold {ratio(name + ', cold')}, cached {ratio(name + ', cached')}, peak "
                            f"{arms[name + ', cached']['peak_memory_mb']} MB" for name in found)
        flex = arms.get("packed flex, cached", {})
        compiles = flex.get("compiles") or {}
        rows.append((f"attention: {result['model']}, {result['lengths']}", numbers,
                     f"trl dpo {arms['trl dpo, every step']['pairs_per_s']} pairs/s, peak "
                     f"{arms['trl dpo, every step']['peak_memory_mb']} MB; flex compiles {compiles.get('count')} "
                     f"({compiles.get('seconds')} s)"))
    if report.get("skipped"):
        rows.append(("attention: not run (time)", ", ".join(report["skipped"]), ""))
    return rows


def memory_row(method: str, plan_report: dict, training_info: dict) -> tuple[tuple[str, str, str], bool]:
    """The plan's estimate for the method the run used (MEMORY_METHODS) against the run's measured peak (torch's most
    allocated): it holds when the peak is within the plan's model state + reference + activations plus its margin."""
    plan = plan_report.get("memory_plan") or {}
    chosen = next((estimate for estimate in plan.get("estimates", [])
                   if estimate.get("method") == MEMORY_METHODS[method][0]), None)
    measured_mb = (training_info.get("summary") or {}).get("peak_memory_mb")
    if chosen is None or measured_mb is None:
        return (f"memory plan vs peak: {method}", "not measured",
                "no plan" if chosen is None else "no peak in training_info.json"), True
    planned = chosen["model_state_bytes"] + chosen["reference_bytes"] + chosen["activation_bytes"]
    measured = measured_mb * 2**20
    holds = measured <= planned + chosen["margin_bytes"]
    verdict = f"{'holds' if holds else 'UNDER-ESTIMATES'}: measured {measured / planned:.2f}x the plan"
    numbers = (f"plan {planned / GIB:.2f} GiB (state {chosen['model_state_bytes'] / GIB:.2f} + reference "
               f"{chosen['reference_bytes'] / GIB:.2f} + activations {chosen['activation_bytes'] / GIB:.2f}; margin "
               f"{chosen['margin_bytes'] / GIB:.2f}), measured peak {measured / GIB:.2f} GiB allocated; batch "
               f"{plan.get('per_device_batch_size')} x max_length {plan.get('max_length')}, {plan.get('precision')}")
    return (f"memory plan vs peak: {method}", verdict, numbers), not holds


def render(steps_run: list[Step], machine: tuple[str, str, str] | None, total_s: float) -> str:
    lines = ["| first run on GPU | result | numbers | s |", "|---|---|---|---|"]
    if machine:
        lines.append(f"| {machine[0]} | {machine[1]} | {machine[2]} | |")
    for step in steps_run:
        for index, (what, result, numbers) in enumerate(step.rows):
            seconds = f"{step.seconds:.0f}" if index == 0 else ""
            lines.append(f"| {what} | {result} | {numbers} | {seconds} |")
    lines.append(f"| total | | | {total_s:.0f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------------------------------------


def build_memory_assets(work: Path) -> None:
    """A generated Llama (its BPE tokenizer trained on the data, bench_dpo.py's) and pairs long enough that every row
    fills --max_length: the worst case the memory plan is written for."""
    sys.path.insert(0, str(ROOT / "bench"))
    import random

    from bench_dpo import WORDS, build_assets

    model, data = build_assets(work / "memory", MEMORY_MODEL["hidden"], MEMORY_MODEL["layers"], pairs=64)
    rng = random.Random(0)
    words = lambda count: " ".join(rng.choice(WORDS) for _ in range(count))  # noqa: E731
    rows = [{"prompt": words(60) + " ?", "chosen": " " + words(400) + " .", "rejected": " " + words(400) + " ."}
            for _ in range(64)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def run_logged(command: list[str], log: Path, timeout: float, env: dict) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(1, timeout), env=env)
    except subprocess.TimeoutExpired as expired:
        log.write_text(f"$ {shlex.join(command)}\n(timed out after {timeout:.0f} s)\n{expired.stdout or ''}")
        raise
    log.write_text(f"$ {shlex.join(command)}\n(exit {result.returncode})\n{result.stdout}\n{result.stderr}")
    return result


def run_step(step: Step, work: Path, deadline: float, env: dict) -> None:
    started = time.monotonic()
    limit = lambda: min(step.budget_s - (time.monotonic() - started), deadline - time.monotonic())  # noqa: E731
    commands = step.commands(work)
    try:
        if step.key == "check_gpu":
            result = run_logged(commands[0], OUT / "check_gpu.log", limit(), env)
            step.report = json.loads(result.stdout)
            step.rows = check_gpu_rows(step.report)
            step.failed = result.returncode not in (0, 1)
        elif step.key == "gpu_tests":
            result = run_logged(commands[0], OUT / "gpu_tests.log", limit(), env)
            step.rows, step.failed = gpu_test_rows((work / "gpu-tests.xml").read_text())
            step.failed = step.failed or result.returncode != 0
        elif step.key == "bench":
            result = run_logged(commands[0], OUT / "bench_dpo.log", limit(), env)
            step.rows = bench_rows(result.stdout)
            step.failed = result.returncode != 0 or not step.rows
        elif step.key == "attention":
            result = run_logged(commands[0], OUT / "packed_attention.log", limit(), env)
            report_path = OUT / "packed_attention.json"
            step.rows = attention_rows(json.loads(report_path.read_text())) if result.returncode == 0 else [
                (step.title, "FAILED", f"exit {result.returncode}; see {OUT / 'packed_attention.log'}")]
            step.failed = result.returncode != 0
        elif step.key == "memory":
            build_memory_assets(work)
            for method, (plan_command, run_command) in zip(MEMORY_METHODS, zip(commands[::2], commands[1::2])):
                name = method.split()[0].lower()
                plan = run_logged(plan_command, OUT / f"memory-{name}-plan.log", limit(), env)
                run = run_logged(run_command, OUT / f"memory-{name}-run.log", limit(), env | {"CUDA_VISIBLE_DEVICES": "0"})
                info_path = work / "results" / f"memory-{name}" / "training_info.json"
                info = json.loads(info_path.read_text()) if run.returncode == 0 and info_path.exists() else {}
                row, failed = memory_row(method, json.loads(plan.stdout), info)
                step.rows.append(row)
                step.failed = step.failed or failed or run.returncode != 0
    except subprocess.TimeoutExpired:
        step.rows.append((step.title, "TIMED OUT", f"past its {step.budget_s} s or the overall deadline"))
        step.failed = True
    except (json.JSONDecodeError, FileNotFoundError, ElementTree.ParseError) as error:
        step.rows.append((step.title, "FAILED", f"{type(error).__name__}: {error}; see {OUT}"))
        step.failed = True
    step.seconds = time.monotonic() - started


def dry_run(all_steps: list[Step], work: Path, minutes: float, reason: str) -> int:
    print(f"gpu_first_run: dry run ({reason}); on a GPU machine it runs, in {minutes:.0f} minutes at most:")
    for number, step in enumerate(all_steps, start=1):
        print(f"\n{number}. {step.title} (at most {step.budget_s // 60} min)")
        if step.key == "memory":
            print(f"   builds a {MEMORY_MODEL['layers']} x {MEMORY_MODEL['hidden']} Llama and pairs that fill "
                  f"--max_length under {work / 'memory'}, then for each of {', '.join(MEMORY_METHODS)}:")
        for command in step.commands(work):
            print(f"   $ {shlex.join(command)}")
    print(f"\nand writes the table to {OUT / 'table.md'} (each step's log beside it).")
    return 0


def cuda_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry_run", action="store_true", help="list what it would run, run nothing")
    parser.add_argument("--minutes", type=float, default=30, help="the whole run's limit (default 30)")
    parser.add_argument("--only", help="comma-separated steps to run: check_gpu, gpu_tests, bench, attention, memory")
    args = parser.parse_args(argv)
    gpus = cuda_gpus()
    work = OUT / "work"
    all_steps = [step for step in steps(gpus) if not args.only or step.key in args.only.split(",")]
    if args.dry_run or gpus == 0:
        return dry_run(all_steps, work, args.minutes, "asked for" if args.dry_run else "no CUDA GPU on this machine")

    import shutil

    import torch

    shutil.rmtree(OUT, ignore_errors=True)
    work.mkdir(parents=True)
    env = os.environ | {"HF_HOME": str(work / "hf"), "PREFKIT_CACHE": str(work / "cache"), "PYTHON": sys.executable}
    started = time.monotonic()
    deadline = started + args.minutes * 60
    machine = None
    for step in all_steps:
        if time.monotonic() >= deadline:
            step.rows, step.failed = [(step.title, "SKIPPED", f"the {args.minutes:.0f}-minute limit was reached")], True
            continue
        print(f"gpu_first_run: {step.title} ...", flush=True)
        run_step(step, work, deadline, env)
        if step.report:
            machine = machine_row(step.report, torch.__version__)
        print(f"gpu_first_run: {step.title}: {'FAILED' if step.failed else 'ok'} in {step.seconds:.0f} s", flush=True)
    table = render(all_steps, machine, time.monotonic() - started)
    (OUT / "table.md").write_text(table)
    print("\n" + table)
    print(f"written to {OUT / 'table.md'}; logs in {OUT}")
    return 1 if any(step.failed for step in all_steps) else 0


if __name__ == "__main__":
    sys.exit(main())
