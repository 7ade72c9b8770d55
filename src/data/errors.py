"""DataError: a problem with the user's data, reported as one line naming the file, row or column (every module of
src/data/ raises it; main_distributed prints it).
"""

from __future__ import annotations


class DataError(ValueError):
    """A problem with the user's data: reported as one line naming the file, row or column."""
