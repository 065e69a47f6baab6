"""Layer 1: the public value types (``Residency``, ``TransferStats``, ``TransferHandle``), the argument checks and
the core's one reader of the environment (``env``). Imports nothing of torchferry's above it."""
