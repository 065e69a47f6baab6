"""Layer 3, where it goes: host memory, the node's host budget, the pool and its layout.
Imports only ``_api`` and ``_state``."""
