"""How reports write numbers: percentages, points of change, 95% intervals, durations and Markdown tables, one way
for report.md, the rounds section, the comparison page, the index and the model card."""

from __future__ import annotations

import math


def format_percent(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" if math.isfinite(value) else str(value)


def format_judged(measure: str, value: float | None) -> str:
    """A judged measure's value: a mean (`mean_reward`: a judge's raw scores) as a number, a fraction as a percent."""
    return format_number(value) if measure.startswith("mean_") else format_percent(value)


def format_number(value, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def metric_points(before: float | None, after: float | None) -> str:
    if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)):
        return "n/a"
    return f"{100 * (after - before):+.1f} pts"


def ci95(fraction: float, count: int) -> str:
    """Half-width of the normal-approximation 95% interval of a fraction, in percentage points."""
    if not count or fraction is None or not math.isfinite(fraction):
        return ""
    return f" ±{196 * math.sqrt(max(fraction * (1 - fraction), 0.0) / count):.1f}"


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else (f"{minutes} min {secs} s" if minutes else f"{seconds:.1f} s")


def metric_name(metric: str) -> str:
    return metric.replace("_", " ")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_lines(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return lines
