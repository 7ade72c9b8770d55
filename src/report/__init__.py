"""`python -m src.report RUN_DIR`: the report's command, kept where users know it. The code is src/reporting/report.py.

The names below are re-exported so `from src.report import build_report` keeps working.
"""

from src.reporting.report import PLOTS_DIR, REPORT, ReportError, build_report, main, render_report  # noqa: F401
