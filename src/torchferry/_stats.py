"""Transfer figures of a ferry, last and cumulative."""

from __future__ import annotations

import dataclasses

__all__ = ["TransferStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    """What a ferry has moved. Bytes in bytes, seconds in seconds, GB/s = 1e9 B/s.

    Seconds are the copy engine's time between the first and the last copy of
    a transfer (CUDA events on the copy stream), or host time on the CPU; they
    are known once the transfer was seen complete (``handle.wait()`` or
    ``handle.done()``), ``None`` before.
    """

    offloads: int = 0
    """Offloads issued (no-ops not counted)."""
    reloads: int = 0
    """Reloads issued (no-ops not counted)."""
    bytes_offloaded: int = 0
    """Bytes moved device -> host, all offloads."""
    bytes_reloaded: int = 0
    """Bytes moved host -> device, all reloads."""
    offload_seconds: float = 0.0
    """Seconds of all completed offloads."""
    reload_seconds: float = 0.0
    """Seconds of all completed reloads."""
    last_offload_bytes: int = 0
    last_offload_s: float | None = None
    last_reload_bytes: int = 0
    last_reload_s: float | None = None

    @property
    def last_offload_GBps(self) -> float | None:
        return _rate(self.last_offload_bytes, self.last_offload_s)

    @property
    def last_reload_GBps(self) -> float | None:
        return _rate(self.last_reload_bytes, self.last_reload_s)


def _rate(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None
