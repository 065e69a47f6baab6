"""Layer 1: the public value types (``Residency``, ``TransferStats``, ``TransferHandle``), the argument checks and
the core's settings (``settings.CoreSettings``: values; the environment is read above the core, in
``torchferry/_public/env``). Imports nothing of torchferry's above it."""
