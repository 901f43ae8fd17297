"""MMEngine's import paths, backed by trainrun."""
