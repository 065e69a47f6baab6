"""Which CPU memory is a torchferry host pool: the planner refuses a tensor another ferry offloaded
(it views that ferry's pool), reconcile tells a replacement from a pool view. The host layer
registers each block it maps here (``torchferry._core._host.memory``)."""

from __future__ import annotations

__all__ = ["in_host_pool", "live_blocks"]

# id(mapping) -> (start, end) of every live host block, to recognise pool memory.
live_blocks: dict[int, tuple[int, int]] = {}


def in_host_pool(ptr: int) -> bool:
    """True if ``ptr`` lies in a torchferry host block (state offloaded by some ferry)."""
    return any(start <= ptr < end for start, end in live_blocks.values())
