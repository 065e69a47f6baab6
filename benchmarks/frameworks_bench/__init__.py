"""The frameworks bench (``benchmarks/frameworks.py``), by concern."""
