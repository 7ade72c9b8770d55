"""Does GRPO give the same numbers on any split of the batch? TRL's own GRPOTrainer (its sampling and metric averaging
put back: PROBE_TRL_OWN=1, tests/grpo_probe.py) against the toolkit's, each on 1 process x 4 accumulation steps, 2 x 2
and 4 x 1: the launches of tests/test_grpo.py (2 steps, 16 answers per step, the tiny test model). docs/grpo.md quotes
its output.

    python bench/grpo_split_invariance.py      # ~4 min on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import build_tiny_model, tiny_corpus, write_jsonl  # noqa: E402
from test_grpo import grpo_args, prompt_rows  # noqa: E402

from src import run_files  # noqa: E402

SPLITS = ((1, 4), (2, 2), (4, 1))
KEYS = ("loss", "reward", "kl", "entropy")


def launch(family: str, processes: int, accumulation: int, model: Path, data: Path, work: Path) -> tuple[list, list]:
    """One launch's answers (step, prompt row, token ids; every rank's, sorted) and its logged train records."""
    name = f"{family}-{processes}x{accumulation}"
    probe = work / "probe" / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "tests/grpo_probe.py", str(probe), *grpo_args(model, data, work / "results", name,
                                                             "--gradient_accumulation_steps", str(accumulation))]
    environment = os.environ | {"OMP_NUM_THREADS": "1", "PROBE_TRL_OWN": "1" if family == "trl" else "0"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment)
    if result.returncode:
        sys.exit(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    ranks = [json.loads((probe / f"rank{rank}.json").read_text()) for rank in range(processes)]
    answers = sorted((answer["step"], answer["prompt"], answer["answer"]) for rank in ranks for answer in rank["answers"])
    records = [record for record in run_files.read_jsonl(work / "results" / name / run_files.METRICS) if "loss" in record]
    return answers, records


def main() -> None:
    work = Path(tempfile.mkdtemp())
    os.environ.update(HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1")
    model = build_tiny_model(work / "model", tiny_corpus())
    data = write_jsonl(work / "prompts.jsonl", prompt_rows(24))
    for family in ("trl", "toolkit"):
        runs = {split: launch(family, *split, model, data, work) for split in SPLITS}
        answers, records = runs[SPLITS[0]]
        for (processes, accumulation), (other_answers, other_records) in runs.items():
            same = sum(mine == theirs for mine, theirs in zip(other_answers, answers))
            differences = {key: max(abs(mine[key] - theirs[key]) for mine, theirs in zip(other_records, records))
                           for key in KEYS}
            print(f"{family} {processes}x{accumulation}: answers equal to 1x4's {same}/{len(other_answers)}; "
                  f"max |difference| from 1x4: " + ", ".join(f"{key} {value:.2g}" for key, value in differences.items()))


if __name__ == "__main__":
    main()
