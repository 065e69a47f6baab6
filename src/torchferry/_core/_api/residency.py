"""Residency of a ferry's state set: where its bytes live and what is in flight."""

from __future__ import annotations

import enum

__all__ = ["Residency"]


class Residency(enum.Enum):
    """Where a :class:`~torchferry.Ferry`'s state lives.

    The cycle is ``DEVICE -> D2H_IN_FLIGHT -> HOST -> H2D_IN_FLIGHT -> DEVICE``
    (FSDP2 calls the analogous states of a parameter ``ShardedState``).

    * ``DEVICE``: every tensor the ferry knows is on its device (GPU).
    * ``D2H_IN_FLIGHT``: ``offload()`` was issued; the tensors already are CPU
      tensors viewing the host pool, but the copies may still be running: wait
      on the offload handle before reading them on the host.
    * ``HOST``: the offload copies are complete; the device memory is released.
    * ``H2D_IN_FLIGHT``: ``reload()`` was issued; the tensors are device tensors
      again and the current stream waits for the copies, but the host has not
      seen them finish.
    * ``PREFETCHING``: ``reload(prefetch=...)`` was issued; each FSDP unit's
      tensors become device tensors when its forward starts (see
      ``torchferry._core._schedules.prefetch``); ``reload()`` completes the rest at once.
    """

    DEVICE = "device"
    D2H_IN_FLIGHT = "d2h_in_flight"
    HOST = "host"
    H2D_IN_FLIGHT = "h2d_in_flight"
    PREFETCHING = "prefetching"

    @property
    def on_host(self) -> bool:
        """True for ``D2H_IN_FLIGHT`` and ``HOST``: the tensors are CPU tensors."""
        return self in (Residency.D2H_IN_FLIGHT, Residency.HOST)

