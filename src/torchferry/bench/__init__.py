"""``torchferry bench``: a colocated RL step on a real architecture, strategies side by side."""
