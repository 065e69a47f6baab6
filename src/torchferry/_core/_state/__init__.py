"""Layer 2, what moves: module walks, targets, plans, parked tensor objects, and every read of FSDP2/DTensor
internals (``fsdp.py``; FSDP1's in ``fsdp1.py``). Imports only ``_api``."""
