"""Layer 2, what moves: module walks, targets, plans, parked tensor objects, and every read of FSDP2/DTensor
internals (``fsdp.py``). Imports only ``_api``."""
