"""Layer 1: the public value types (``Residency``, ``TransferStats``, ``TransferHandle``) and the argument checks.
Imports nothing of torchferry's above it."""
