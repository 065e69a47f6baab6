"""``torchferry bench-grpo``: a GRPO-like colocated step under a GPU budget, every set offloaded after its
phase (verl's flags) against a :class:`~torchferry.Dock` (``docs/dock.md``).

``config`` (what runs; no torch import), ``steps`` (set-up, the two strategies' steps, their
calibration and comparison), ``report`` (figures, lines, plot), ``run`` (the whole run as a
function), ``command`` (what the CLI calls).
"""
