"""`python -m src.compare RUN_DIR...`: runs side by side on one page. The code is src/reporting/compare.py."""

import sys

from src.reporting.compare import main

if __name__ == "__main__":
    sys.exit(main())
