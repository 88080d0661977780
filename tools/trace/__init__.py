"""Block-access traces: JSON-lines files, synthetic generators, and an attention recorder."""
