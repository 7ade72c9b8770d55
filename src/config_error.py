"""ConfigError: a mistake in the user's configuration, reported as one line with no traceback.

A module of its own at the bottom of the layers, so that whatever checks a configuration (the schema's parser and
checks, the objectives' rows, the plan, the run's own checks) raises it without importing the schema.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A mistake in the user's configuration: reported as one line, no traceback."""
