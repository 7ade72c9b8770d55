"""What the libraries say on a run's console besides the toolkit: each known-harmless warning or notice, matched by its
exact message, is kept off it, and HARMLESS lists every one with why it is harmless; any other warning a library
raises shows once per process, however often it is raised.

Why "once" needs doing here: Python shows a warning once per place by default, but its registry of places shown is
cleared whenever any code changes the warning filters (`warnings.catch_warnings` does, on exit), and torch and
DeepSpeed do that inside every step: a ZeRO-3 run printed torch's deprecation of `reduce_scatter_tensor` 304 times in
8 steps. A warning that is not listed here is news (a library telling the user something about their run): it still
shows, the first time.

    install()                  # once, first thing in every toolkit process (src/main_distributed.py, check_gpu.py)
    with printed_lines_dropped():   # around a library call that prints a listed line with print()

Light: no torch (the preflight and check_gpu.py install it).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from src.world import gpu_device_files

WARNING, LOGGER, PRINTED, ENVIRONMENT = "warning", "logger", "printed", "environment"


@dataclass(frozen=True)
class Harmless:
    """A library's message that tells a user of this toolkit nothing to act on: where it comes from (`source`), how it
    is kept off the console (`channel`: a `warnings` warning of `category`, a `logging` record of logger `logger`, a
    line a library print()s, or a variable that answers the library's question before it asks: `environment`), and
    `why` it is harmless."""

    source: str
    channel: str
    message: str
    why: str
    category: str = ""
    logger: str = ""


HARMLESS = (
    Harmless("torch 2.13, called by DeepSpeed ZeRO", WARNING, category="FutureWarning",
             message="`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                     "`torch.distributed.reduce_scatter_single` instead.",
             why="DeepSpeed 0.19.8's ZeRO calls torch's old name, which torch 2.13 forwards to reduce_scatter_single: "
                 "the same collective; the call is DeepSpeed's, nothing for a user to change"),
    Harmless("torch 2.13, called by DeepSpeed ZeRO", WARNING, category="FutureWarning",
             message="`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                     "`torch.distributed.all_gather_single` instead.",
             why="the same for the all-gather: torch 2.13 forwards it to all_gather_single"),
    Harmless("TRL 1.16", WARNING, category="FutureWarning",
             message=r".*is_gradient_checkpointing.*is deprecated",
             why="TRL still calls a transformers method that transformers 5 renamed; the warning is TRL's to act on"),
    Harmless("DeepSpeed 0.19.8", ENVIRONMENT,
             message="Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
             why="on a machine with no GPU driver (src/world.py gpu_device_files) DeepSpeed would pick its CPU "
                 "accelerator anyway and warns that it guessed; the toolkit names it (DS_ACCELERATOR=cpu, DeepSpeed's "
                 "own switch), so DeepSpeed does not guess. Where a driver exists DeepSpeed still decides and says so"),
    Harmless("DeepSpeed 0.19.8", PRINTED,
             message="DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
             why="DeepSpeed's shared-memory all-reduce for CPU processes, built once and loaded by every process as "
                 "its process group starts (deepspeed/comm/torch.py build_shm_op): the op works, the line says so"),
    Harmless("accelerate 1.15 under transformers' Trainer and DeepSpeed", LOGGER, logger="accelerate.accelerator",
             message="Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has ",
             why="transformers' Trainer accumulates gradients itself and gives accelerate 1 on purpose; under DeepSpeed "
                 "the accumulation is DeepSpeed's, filled from the plan's, and accelerate adopts it, as it says: the "
                 "plan's accumulation is the one used (tests/test_engines.py: ZeRO's losses are DDP's at 2 steps)"),
    Harmless("bitsandbytes 0.50 on CPU", LOGGER, logger="bitsandbytes.backends.cpu.ops",
             message=r"",  # every record of that logger below ERROR
             why="it warns on every CPU import that an optional kernel package (\"kernels\", which reaches for the "
                 "Hub) is missing; its pure-PyTorch fallback is used instead: nothing to act on"),
)

# Each warning a process showed already ({(category, text): True}): a dict, so a forked test run can empty it in place.
_shown: dict[tuple[type, str], bool] = {}


def install() -> None:
    """Keep the listed messages off this process's console and show any other warning once; idempotent."""
    for entry in HARMLESS:
        if entry.channel == WARNING:
            warnings.filterwarnings("ignore", message=_exact(entry.message), category=getattr(builtins, entry.category))
        elif entry.channel == LOGGER and entry.message == "":
            logging.getLogger(entry.logger).setLevel(logging.ERROR)
        elif entry.channel == LOGGER:
            _drop_records(logging.getLogger(entry.logger), entry.message)
    for name, value in launch_environment().items():
        os.environ.setdefault(name, value)
    if not getattr(warnings.showwarning, "_once_per_process", False):
        warnings.showwarning = _once(warnings.showwarning)


def launch_environment() -> dict[str, str]:
    """The variables that answer a library before it warns (the ENVIRONMENT entries) on this machine, as this process
    has them (a user's own value kept): run_distributed.sh exports them for the processes it starts that the
    toolkit's code does not run in (accelerate launch's own, which imports DeepSpeed)."""
    environment = {}
    if not gpu_device_files():
        environment["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    return environment


@contextlib.contextmanager
def printed_lines_dropped():
    """Around a library call that print()s one of the PRINTED lines: those lines are dropped, every other line is
    printed as it was."""
    dropped = {entry.message for entry in HARMLESS if entry.channel == PRINTED}
    stream = _LineFilter(sys.stdout, dropped)
    with contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            stream.close()


class _LineFilter(io.TextIOBase):
    """A text stream that writes whole lines to `target` except those in `dropped`."""

    def __init__(self, target, dropped: set[str]):
        super().__init__()
        self.target, self.dropped, self.pending = target, dropped, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            if line not in self.dropped:
                self.target.write(line + "\n")
        return len(text)

    def close(self) -> None:
        if self.pending and self.pending not in self.dropped:
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()
        super().close()


def _drop_records(logger: logging.Logger, message: str) -> None:
    """`logger`'s records that contain `message` (after any prefix a library's adapter adds: "[RANK 0] ") dropped."""
    if any(getattr(existing, "message", None) == message for existing in logger.filters):
        return

    class Dropped(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return message not in record.getMessage()

    dropped = Dropped()
    dropped.message = message
    logger.addFilter(dropped)


def _once(show):
    """`warnings.showwarning` that shows each (category, text) once in this process."""
    def show_once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key in _shown:
            return
        _shown[key] = True
        show(message, category, filename, lineno, file, line)

    show_once._once_per_process = True
    return show_once


def _exact(message: str) -> str:
    """A `warnings` filter's message pattern (matched at the start) for exactly `message`; an entry written as a
    pattern (one with `.*`) is taken as it is."""
    return message if ".*" in message else re.escape(message) + r"\Z"


