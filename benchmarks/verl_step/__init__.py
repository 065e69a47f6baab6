"""The verl step bench (``benchmarks/verl_actor.py``), by concern."""
