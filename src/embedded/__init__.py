"""The embedded default: verifiable tasks, the data shipped with the project, and a small model built offline."""
