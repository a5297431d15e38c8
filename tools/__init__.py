"""Developer tools run from the repository root (`python -m tools...`); not shipped."""
