"""`python -m src.reporting RUN_DIR`: the run's report rebuilt from its files (src/reporting/report.py). Runs side by
side are `python -m src.reporting.compare RUN_DIR...` (src/reporting/compare.py)."""

import sys

from src.reporting.report import main

sys.exit(main())
