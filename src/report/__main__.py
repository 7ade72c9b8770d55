import sys

from src.reporting.report import main

sys.exit(main())
