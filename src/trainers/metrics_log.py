"""What training logs, as it happens: every event appended to metrics.jsonl on rank 0 (a crashed run keeps its
curves), and one compact console line per event with the elapsed time and the ETA."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from src import run_files
from src.progress import eta_seconds, format_duration


class MetricsRecorder(TrainerCallback):
    """Appends every logged event to metrics.jsonl on rank 0, as it happens, so a crashed run keeps its curves."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = Path(metrics_path)
        self.started = time.monotonic()
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.start_step = time.monotonic(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Resumed from the final checkpoint, nothing trained: the end record of the launch that trained stands.
        if "train_runtime" in (logs or {}) and state.global_step == self.start_step and \
                self._ended_at(state.global_step):
            return
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "epoch": state.epoch, "time_s": round(time.monotonic() - self.started, 3)}
            record.update(logs)
            run_files.append_jsonl(self.metrics_path, record)  # a failed write is noted (src/trainers/base.py)


    def _ended_at(self, step: int) -> bool:
        return any("train_runtime" in record and record.get("step") == step
                   for record in run_files.read_jsonl(self.metrics_path))


class ConsoleLog(TrainerCallback):
    """One compact line per logged event on rank 0 (replaces Trainer's dict printer), ending with the elapsed time and
    the ETA (at the rate since this launch began training, evaluations included). `keys`: the objective's own
    (its row's console_keys, src/objectives/), shown between the loss and the learning rate."""

    FIRST = ("loss", "eval_loss")
    LAST = ("learning_rate", "grad_norm", "perf/tokens_per_second")

    def __init__(self, keys: tuple[str, ...] = ()):
        self.keys = self.FIRST + tuple(keys) + self.LAST
        self.started = time.monotonic()
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started, self.start_step = time.monotonic(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            line = (f"done in {format_duration(logs['train_runtime'])}, "
                    f"{logs.get('train_samples_per_second', 0):.1f} samples/s")
        else:
            parts = [f"{key} {logs[key]:.4g}" for key in self.keys if isinstance(logs.get(key), (int, float))]
            elapsed = time.monotonic() - self.started
            eta = eta_seconds(state.global_step - self.start_step, state.max_steps - self.start_step, elapsed)
            line = "  ".join(parts + [f"elapsed {format_duration(elapsed)}", f"ETA {format_duration(eta)}"])
        print(f"  step {state.global_step:>5}/{state.max_steps}  {line}", flush=True)
