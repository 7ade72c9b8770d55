"""Synthetic run directories for the reporting tests: metric histories shaped like TRL's logs, samples, setup.

Histories simulate a batch of preference pairs per step (margin_i ~ Normal(mean, spread)), so loss, margin and
reward accuracy are mutually consistent the way TRL logs them. `kind` selects a healthy run or one failure.

Render an example run directory for a person to look at:
    python -m tests.report_fixtures /tmp/prefkit_report_example
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

from src.judges import ProgrammaticJudge
from src.run_files import METRICS, TRAINING_INFO, append_jsonl, read_json, read_jsonl, samples_file, write_json

PAIRS_PER_STEP = 16
BETA = 0.1


def _softplus(x: float) -> float:
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def _learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 10)
    return peak * step / warmup if step <= warmup else peak * (steps - step) / (steps - warmup)


def _dpo_means(kind: str, step: int, steps: int) -> tuple[float, float, float]:
    """(mean chosen reward, mean margin, spread of per-pair margins) at `step` for a history `kind`."""
    progress = 1 - math.exp(-step / 50)
    if kind == "stuck":
        return 0.0, 0.0, 1e-4
    if kind == "displacement":
        margin = 1.5 * progress
        return -2.2 * (1 - math.exp(-step / 60)), margin, 0.5 + 0.5 * margin
    if kind == "saturated":
        margin = 0.8 + 0.7 * progress
        return 0.3 * progress, margin, 0.12
    if kind == "unbounded":
        margin = 12.0 * step / steps
        return 0.05 * margin, margin, 1.0 + 0.3 * margin
    margin = 1.6 * progress  # healthy (and "nan" before it diverges)
    return 0.25 * progress, margin, 0.5 + 0.5 * margin


def _dpo_batch(rng: random.Random, chosen_mean: float, margin_mean: float, spread: float, pairs: int,
               fixed_noise: list[tuple[float, float]] | None = None) -> dict:
    """Metrics of one logged batch; `fixed_noise` (one (z_margin, z_chosen) per pair) makes it a fixed eval set."""
    noise = fixed_noise or [(rng.gauss(0, 1), rng.gauss(0, 1)) for _ in range(pairs)]
    margins = [margin_mean + spread * z_margin for z_margin, _ in noise]
    chosen = [chosen_mean + 0.3 * spread * z_chosen for _, z_chosen in noise]
    rejected = [c - m for c, m in zip(chosen, margins)]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "loss": mean([_softplus(-m) for m in margins]),
        "rewards/chosen": mean(chosen),
        "rewards/rejected": mean(rejected),
        "rewards/margins": mean(margins),
        "rewards/accuracies": mean([float(m > 0) for m in margins]),
        "logps/chosen": -60.0 + mean(chosen) / BETA,
        "logps/rejected": -72.0 + mean(rejected) / BETA,
        "logits/chosen": -1.2 + rng.gauss(0, 0.05),
        "logits/rejected": -1.3 + rng.gauss(0, 0.05),
    }


def dpo_history(kind: str = "healthy", steps: int = 200, eval_every: int | None = 50, seed: int = 0,
                perf: bool = False, finished: bool = True) -> list[dict]:
    """A DPO metric history. kind: healthy | stuck | displacement | saturated | unbounded | nan."""
    rng = random.Random(seed)
    eval_set = [(rng.gauss(0, 1), rng.gauss(0, 1)) for _ in range(256)]
    records, time_s, tokens, losses = [], 0.0, 0, []
    for step in range(1, steps + 1):
        time_s += 0.45 + rng.uniform(-0.05, 0.05)
        tokens += PAIRS_PER_STEP * 2 * 96
        chosen_mean, margin_mean, spread = _dpo_means(kind, step, steps)
        record = {"step": step, "epoch": round(2 * step / steps, 4), "time_s": round(time_s, 3)}
        record.update(_dpo_batch(rng, chosen_mean, margin_mean, spread, PAIRS_PER_STEP))
        record.update({
            "grad_norm": (6 * math.exp(-step / 80) + 2) * math.exp(rng.gauss(0, 0.25)),
            "learning_rate": _learning_rate(step, steps, 5e-7),
            "entropy": 2.1 - 0.3 * step / steps + rng.gauss(0, 0.03),
            "num_tokens": tokens,
            "mean_token_accuracy": 0.42 + 0.05 * step / steps + rng.gauss(0, 0.01),
        })
        if kind == "nan" and step >= 0.75 * steps:
            record.update({key: math.nan for key in record if "/" in key or key == "loss"})
            record["grad_norm"] = math.inf
        if perf:
            record.update({"perf/tokens_per_second": PAIRS_PER_STEP * 2 * 96 / 0.45 * math.exp(rng.gauss(0, 0.05)),
                           "perf/samples_per_second": PAIRS_PER_STEP / 0.45, "perf/step_time_s": 0.45,
                           "perf/peak_memory_mb": 1800.0 + min(step, 5) * 40})
        losses.append(record["loss"])
        records.append(record)
        if eval_every and step % eval_every == 0:
            evaluation = _dpo_batch(rng, chosen_mean * 0.9, margin_mean * 0.9, spread, len(eval_set), eval_set)
            if kind == "nan" and step >= 0.75 * steps:
                evaluation = {key: math.nan for key in evaluation}
            records.append({"step": step, "epoch": record["epoch"], "time_s": record["time_s"],
                            **{f"eval_{key}": value for key, value in evaluation.items()},
                            "eval_runtime": 3.1, "eval_samples_per_second": 82.0})
    if finished:
        records.append({"step": steps, "epoch": 2.0, "time_s": round(time_s, 3), "train_runtime": round(time_s + 1, 3),
                        "train_samples_per_second": PAIRS_PER_STEP * steps / time_s,
                        "train_steps_per_second": steps / time_s, "train_loss": sum(losses) / len(losses)})
    return records


def sft_history(kind: str = "healthy", steps: int = 200, eval_every: int | None = 50, seed: int = 0,
                finished: bool = True) -> list[dict]:
    """An SFT metric history. kind: healthy | flat | nan | overfit."""
    rng = random.Random(seed)
    records, time_s, tokens, losses = [], 0.0, 0, []
    for step in range(1, steps + 1):
        time_s += 0.2 + rng.uniform(-0.02, 0.02)
        tokens += 32 * 80
        mean_loss = 2.3 if kind == "flat" else 0.9 + 2.4 * math.exp(-step / 40)
        loss = mean_loss + rng.gauss(0, 0.08)
        record = {"step": step, "epoch": round(3 * step / steps, 4), "time_s": round(time_s, 3), "loss": loss,
                  "grad_norm": (3 * math.exp(-step / 60) + 0.8) * math.exp(rng.gauss(0, 0.2)),
                  "learning_rate": _learning_rate(step, steps, 2e-4), "entropy": 1.2 * mean_loss,
                  "num_tokens": tokens, "mean_token_accuracy": min(1.0, 0.95 - 0.25 * mean_loss + rng.gauss(0, 0.02))}
        if kind == "nan" and step >= 0.75 * steps:
            record.update(loss=math.nan, grad_norm=math.inf, mean_token_accuracy=math.nan)
        losses.append(record["loss"])
        records.append(record)
        if eval_every and step % eval_every == 0:
            eval_loss = mean_loss + 0.1 + (0.004 * max(0, step - 60) if kind == "overfit" else 0.0)
            eval_loss = math.nan if kind == "nan" and step >= 0.75 * steps else eval_loss
            records.append({"step": step, "epoch": record["epoch"], "time_s": record["time_s"], "eval_loss": eval_loss,
                            "eval_mean_token_accuracy": 0.93 - 0.25 * eval_loss, "eval_runtime": 1.2,
                            "eval_samples_per_second": 160.0})
    if finished:
        records.append({"step": steps, "epoch": 3.0, "time_s": round(time_s, 3), "train_runtime": round(time_s + 1, 3),
                        "train_samples_per_second": 32 * steps / time_s, "train_steps_per_second": steps / time_s,
                        "train_loss": sum(losses) / len(losses)})
    return records


def training_info(stage: str = "dpo", **overrides) -> dict:
    info = {
        "stage": stage, "run_name": f"{stage}-example", "model_name_or_path": "tiny-llama-2x64",
        "dataset_name": "embedded:arithmetic-style", "world_size": 2, "num_nodes": 1, "backend": "gloo",
        "device": "cpu", "per_device_batch_size": 8, "gradient_accumulation_steps": 1, "global_batch_size": 16,
        "learning_rate": 5e-7, "base_learning_rate": 2.5e-7, "base_batch_size": 8, "lr_scaling": "linear",
        "precision": "fp32", "gradient_checkpointing": False, "use_lora": False, "load_in_4bit": False,
        "max_steps": 200, "seed": 42, "versions": {"python": "3.11.9", "torch": "2.13.0", "transformers": "5.23.0",
                                                   "trl": "1.16.0", "peft": "0.21.2", "accelerate": "1.15.0"},
        "git_commit": "fc687dd", "started_at": "2025-11-22T07:43:00+00:00",
    }
    if stage == "dpo":
        info.update(beta=BETA, loss_type=["sigmoid"])
    info.update(overrides)
    return info


def arithmetic_check(row: dict, answer: str) -> dict:
    """The style task's checker: correct = the right number appears; preferred = the 'The answer is N.' form."""
    expected = str(row["meta"]["answer"])
    numbers = "".join(character if character.isdigit() or character == "-" else " " for character in answer).split()
    correct = bool(numbers) and numbers[-1] == expected
    preferred = answer.strip() == f"The answer is {expected}."
    return {"score": float(correct and preferred), "correct": correct, "preferred": preferred}


def arithmetic_rows(split: str, count: int) -> list[dict]:
    """Held-out prompts of the style task, as the training job's sample records carry them."""
    rng = random.Random(f"rows-{split}")
    rows = []
    for index in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append({"index": index, "split": split,
                     "prompt": f"<|user|>What is {a} + {b}? Answer in one sentence.\n<|assistant|>",
                     "chosen": f"The answer is {a + b}.", "rejected": f"{a + b}",
                     "meta": {"task": "add", "a": a, "b": b, "answer": a + b}})
    return rows


def answers(rows: list[dict], skill: float, style: float, seed: str) -> list[str]:
    """A model's answers: right with probability `skill`, in the preferred sentence with probability `style`."""
    rng = random.Random(seed)
    result = []
    for row in rows:
        expected = row["meta"]["answer"]
        value = expected if rng.random() < skill else expected + rng.choice([-10, -1, 1, 10])
        result.append(f"The answer is {value}." if rng.random() < style else f"{value}")
    return result


def judged_samples(rows: list[dict], reference: list[str], trained: list[str]) -> tuple[list[dict], dict]:
    """Sample records as the training job writes them, judged by the programmatic judge; and the judge's dict."""
    result = ProgrammaticJudge(arithmetic_check, metric="correct_and_preferred").judge(rows, reference, trained)
    samples = [{**row, "reference_answer": ref, "trained_answer": new, "verdict": verdict}
               for row, ref, new, verdict in zip(rows, reference, trained, result.verdicts)]
    return samples, result.to_dict()


def write_run_dir(run_dir: str | Path, metrics: list[dict], info: dict | None,
                  samples: dict[str, list[dict]] | None = None) -> Path:
    """Write a run directory the way the training job does (metrics appended line by line)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for record in metrics:
        append_jsonl(run_dir / METRICS, record)
    if info is not None:
        write_json(run_dir / TRAINING_INFO, info)
    for split, records in (samples or {}).items():
        for record in records:
            append_jsonl(run_dir / samples_file(split), record)
    return run_dir


STARTING_MODEL = (0.8, 0.1)  # (skill, style) of the model a DPO run starts from
TRAINED_MODEL = (0.78, 0.85)


def judged_run_dir(run_dir: str | Path, stage: str = "dpo", kind: str = "healthy", count: int = 40,
                   reference: tuple[float, float] = STARTING_MODEL, trained: tuple[float, float] = TRAINED_MODEL,
                   reference_answers: dict[str, list[str]] | None = None) -> Path:
    """A complete finished run directory: a `kind` history, judged val/test samples, judge results."""
    samples, judges = {}, {}
    for split in ("val", "test"):
        rows = arithmetic_rows(split, count)
        before = (reference_answers or {}).get(split) or answers(rows, *reference, seed=f"{split}-reference")
        samples[split], judges[split] = judged_samples(rows, before, answers(rows, *trained, seed=f"{split}-{stage}"))
    history = dpo_history(kind, perf=True) if stage == "dpo" else sft_history(kind)
    test = judges["test"]
    info = training_info(stage, judges=judges,
                         judge={"metric": test["metric"], "split": "test", "n": test["n"], "before": test["before"],
                                "after": test["after"]})
    return write_run_dir(run_dir, history, info, samples)


def pipeline_run_dir(run_dir: str | Path, count: int = 40) -> Path:
    """A DPO run that followed an SFT stage: the SFT run dir is `sft/` inside it, `previous_stage` points there;
    the DPO stage starts from the SFT model, so its reference answers are the SFT stage's trained answers."""
    run_dir = Path(run_dir)
    sft_dir = judged_run_dir(run_dir / "sft", stage="sft", count=count, reference=(0.02, 0.0), trained=STARTING_MODEL)
    sft_answers = {split: [record["trained_answer"] for record in read_jsonl(sft_dir / samples_file(split))]
                   for split in ("val", "test")}
    judged_run_dir(run_dir, stage="dpo", count=count, reference_answers=sft_answers)
    info = read_json(run_dir / TRAINING_INFO)
    info["previous_stage"] = {"stage": "sft", "run_dir": "sft", "judge": read_json(sft_dir / TRAINING_INFO)["judge"]}
    write_json(run_dir / TRAINING_INFO, info)
    return run_dir


if __name__ == "__main__":
    from src.reporting.report import build_report

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefkit_report_example")
    examples = {"dpo_healthy": lambda d: judged_run_dir(d), "sft_healthy": lambda d: judged_run_dir(d, stage="sft"),
                "pipeline": pipeline_run_dir}
    examples.update({f"dpo_{kind}": (lambda d, kind=kind: write_run_dir(d, dpo_history(kind), training_info("dpo")))
                     for kind in ("stuck", "displacement", "saturated", "unbounded", "nan")})
    examples["dpo_one_point"] = lambda d: write_run_dir(d, dpo_history(steps=1, eval_every=None), training_info("dpo"))
    examples["sft_no_eval"] = lambda d: write_run_dir(d, sft_history(eval_every=None), training_info("sft"))
    examples["sft_nan_crashed"] = lambda d: write_run_dir(d, sft_history("nan", finished=False), training_info("sft"))
    for name, make in examples.items():
        target = root / name
        if target.exists():
            import shutil
            shutil.rmtree(target)
        print(build_report(make(target)))
