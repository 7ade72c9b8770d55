"""Host reads of device values (each a GPU stall) counted in a real training run, for tests/test_host_reads.py and
bench/host_reads.py.

A read is a call of `Tensor.item`, `.tolist`, `bool(tensor)`, `float(tensor)`, `int(tensor)`, `.nonzero`, `.cpu` or
`.numpy`: on a GPU each waits for the device's queue to drain. On CPU every tensor is a host tensor, so every call is
counted: an upper bound of what a GPU run reads. Counting starts at the second optimizer step (the first one runs the
packed forward's first-batch check and sets things up) and ends at the first logging step, evaluation, checkpoint or
the end of training, whichever comes first: the reads of the steps between, per step, with the place of each (the
first frame outside torch). GRPO's sampling and judging (`_generate_and_score_completions`) are left out: its
training part is counted.
"""

from __future__ import annotations

import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy")


class ReadCounter:
    """Wraps the reading methods of torch.Tensor; counts calls (and where from) into the window of the stage being
    counted (`callback(stage)`: one window per trainer)."""

    def __init__(self):
        self.window: dict | None = None  # the window counting now
        self.windows: dict[str, dict] = {}
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def install(self) -> ReadCounter:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, name, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            window = counter.window
            if window is not None:
                counter.window = None  # a read inside a read (a torch helper) is not another one
                try:
                    window["reads"][name] += 1
                    window["places"][f"{name} {_caller()}"] += 1
                finally:
                    counter.window = window
            return original(tensor, *args, **kwargs)

        return counted

    def paused(self, function):
        """`function` with no read counted while it runs (GRPO's sampling and judging: token ids go to the judges on
        the host by nature; its training part is what is counted)."""
        counter = self

        def uncounted(*args, **kwargs):
            window, counter.window = counter.window, None
            try:
                return function(*args, **kwargs)
            finally:
                counter.window = window

        return uncounted

    def callback(self, stage: str) -> TrainerCallback:
        counter = self
        window = self.windows.setdefault(stage, {"steps": 0, "reads": collections.Counter(),
                                                 "places": collections.Counter(), "closed": False})

        class CountSteps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step >= 1 and not window["closed"]:
                    counter.window = window

            def on_step_end(self, args, state, control, **kwargs):
                if counter.window is window:
                    window["steps"] += 1
                    if control.should_log or control.should_evaluate or control.should_save:
                        self._stop()  # what this step logs, evaluates or saves is not a step's own work

            def _stop(self, *args, **kwargs):
                if counter.window is window:
                    window["closed"] = True  # one window per trainer
                    counter.window = None

            on_log = on_evaluate = on_save = on_train_end = _stop

        return CountSteps()

    def result(self) -> dict:
        return {stage: {"steps": window["steps"], "reads": dict(window["reads"]),
                        "per_step": sum(window["reads"].values()) / max(window["steps"], 1),
                        "places": dict(window["places"].most_common(40))} for stage, window in self.windows.items()}


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def entry(argv: list[str]) -> int:
    """The toolkit's main as a forked process's entry point (tests/forked.py), counting: `argv` is RESULT_JSON then
    main_distributed's flags; RESULT_JSON gets {stage: its window} for every stage trained. The callback goes on each
    trainer after the toolkit's own, so their step-end reads are inside the window."""
    from src import main_distributed
    from src.trainers import build

    result_path, argv = Path(argv[0]), argv[1:]
    counter = ReadCounter().install()
    build_trainer = build.build_trainer

    def counted_build(stage, *args, **kwargs):
        trainer = build_trainer(stage, *args, **kwargs)
        trainer.add_callback(counter.callback(stage))
        if hasattr(trainer, "_generate_and_score_completions"):  # GRPO: its training part counted
            trainer._generate_and_score_completions = counter.paused(trainer._generate_and_score_completions)
        return trainer

    build.build_trainer = counted_build
    sys.argv = [sys.argv[0], *argv]
    try:
        return main_distributed.main(argv)
    finally:
        counter.remove()
        result_path.write_text(json.dumps(counter.result(), indent=1))
