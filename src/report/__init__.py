"""A CLI entry shim: `python -m src.report RUN_DIR` (src/report/__main__.py), the report's command, kept where users
know it. The code is src/reporting/report.py; nothing imports this package."""
