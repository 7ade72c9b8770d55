"""Progress of long work (data preparation, the reference pass, training) as one clean line.

On a terminal the line redraws itself in place; in a log file (stdout not a TTY: torchrun, Slurm, nohup) it is a
plain line at most every `log_every` seconds, so a ten-hour run's log holds a few hundred readable lines instead of a
tqdm storm of carriage returns. Either way the line says what is done, the rate, the elapsed time and the ETA:

    tokenizing train: 48,000/200,000 rows (24%)  1,210 rows/s  elapsed 40 s  ETA 2 min 6 s

`format_duration` and `eta_seconds` are the one place durations and ETAs are worded, for the console and reports.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def format_duration(seconds: float | None) -> str:
    """`42 s`, `3 min 5 s`, `2 h 7 min`; `n/a` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "n/a"
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s"


def eta_seconds(done: float, total: float | None, elapsed: float) -> float | None:
    """Remaining time at the average rate so far; None while nothing is done or the total is unknown."""
    if not total or done <= 0 or elapsed <= 0:
        return None
    return max(total - done, 0) * elapsed / done


class Progress:
    """Counts units of work and reports them as one line.

    `enabled=False` (e.g. every rank but 0) makes it count silently, so callers never branch on rank.
    The first line waits `delay` seconds: work that finishes quickly prints only its closing line.
    """

    def __init__(self, label: str, total: int | None = None, unit: str = "rows", enabled: bool = True,
                 stream: TextIO | None = None, log_every: float = 30.0, redraw_every: float = 0.2,
                 delay: float = 2.0, clock=time.monotonic):
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = redraw_every if self.interactive else log_every
        self.delay, self.clock = delay, clock
        self.started = clock()
        self.done = 0
        self._last_shown: float | None = None
        self._width = 0

    def update(self, count: int = 1) -> None:
        self.done += count
        now = self.clock()
        due = now - self.started >= self.delay and (self._last_shown is None or now - self._last_shown >= self.every)
        if self.enabled and due:
            self._show(self.line(now))
            self._last_shown = now

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else self.clock()) - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.total:
            count = f"{self.done:,}/{self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            count = f"{self.done:,} {self.unit}"
        parts = [f"{self.label}: {count}", f"{rate:,.0f} {self.unit}/s" if rate >= 10 else f"{rate:.2f} {self.unit}/s",
                 f"elapsed {format_duration(elapsed)}"]
        if self.total and self.done < self.total:
            parts.append(f"ETA {format_duration(eta_seconds(self.done, self.total, elapsed))}")
        return "  ".join(parts)

    def close(self) -> float:
        """Print the closing line (always, when enabled) and return the elapsed seconds."""
        now = self.clock()
        if self.enabled:
            self._show(self.line(now), final=True)
        return now - self.started

    def _show(self, text: str, final: bool = False) -> None:
        if self.interactive:
            padding = " " * max(self._width - len(text), 0)
            self.stream.write("\r" + text + padding + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.enabled and self.interactive and self._width:
            self.stream.write("\n")  # leave the partial line, end it so the error starts on its own line
