"""Training throughput leaves evaluation and checkpoint time out: the curve does not dip after every evaluation."""

from __future__ import annotations

import time

import pytest


EVALUATION_SECONDS = 100.0


class SlowClock:
    """time.perf_counter that jumps EVALUATION_SECONDS forward inside every evaluation: a slow evaluation without
    the wait, and without depending on how fast this (shared) machine runs a training step."""

    def __init__(self):
        self.real = time.perf_counter
        self.offset = 0.0

    def __call__(self) -> float:
        return self.real() + self.offset

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class SlowEvaluation(TrainerCallback):
            def on_evaluate(self, args, state, control, **kwargs):
                clock.offset += EVALUATION_SECONDS

        return SlowEvaluation()


def train_with_slow_evaluation(tiny_model, tmp_path, monkeypatch, toolkit: bool) -> list[dict]:
    """Ten steps, logged every 2, evaluated every 2, each evaluation taking 100 s more; the meter's records."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from src.throughput import ThroughputMeter
    from src.trainers.base import ToolkitTrainerMixin

    class Records(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    rows = [{"input_ids": [1 + (i + j) % 50 for j in range(16)], "labels": [1 + (i + j) % 50 for j in range(16)],
             "attention_mask": [1] * 16} for i in range(64)]
    data = Dataset.from_list(rows)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=10, logging_steps=2, eval_strategy="steps",
                             eval_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer_class = type("Toolkit", (ToolkitTrainerMixin, Trainer), {}) if toolkit else Trainer
    meter, records = ThroughputMeter("cpu", sum(p.numel() for p in model.parameters()), False), Records()
    clock = SlowClock()
    trainer = trainer_class(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
                            callbacks=[meter, records, clock.callback()])
    monkeypatch.setattr(time, "perf_counter", clock)
    trainer.train()
    return [record for record in records.logs if "perf/step_time_s" in record]


@pytest.mark.parametrize("toolkit", [True, False], ids=["toolkit_trainer", "plain_trainer_control"])
def test_training_throughput_leaves_evaluation_time_out(tiny_model, tmp_path, monkeypatch, toolkit):
    records = train_with_slow_evaluation(tiny_model, tmp_path, monkeypatch, toolkit)
    assert len(records) == 5
    # Each window after the first (2 steps) follows a 100 s evaluation; a step of this model takes well under 10 s.
    after_evaluation = [record["perf/step_time_s"] for record in records[1:]]
    if toolkit:
        assert max(after_evaluation) < 10, after_evaluation
    else:  # a plain Trainer does not report the pause and the meter counts it: the test tells the two apart
        assert min(after_evaluation) >= EVALUATION_SECONDS / 2, after_evaluation
