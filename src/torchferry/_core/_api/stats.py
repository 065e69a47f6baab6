"""Transfer figures of a ferry, last and cumulative."""

from __future__ import annotations

import dataclasses
import logging
import weakref

__all__ = ["StatsRecorder", "TransferStats"]

logger = logging.getLogger("torchferry")


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    """What a ferry has moved. Bytes in bytes, seconds in seconds, GB/s = 1e9 B/s.

    Seconds are the copy engine's time between the first and the last copy of
    a transfer (CUDA events on the copy stream), or host time on the CPU; a
    transfer's are known once it was seen complete (``handle.wait()`` or
    ``handle.done()``): ``last_offload_s`` / ``last_reload_s`` are ``None``
    before, and the totals count completed transfers only (``0.0`` before any).
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
    """Bytes of the state the last offload moved to the host (``state_bytes``)."""
    offload_bytes_copied: int = 0
    """Bytes the last offload actually copied device -> host: ``last_offload_bytes`` less the
    storages skipped as unchanged (``Ferry(skip_unchanged=True)``, [Note: unchanged storages])."""
    last_offload_s: float | None = None
    """Seconds of the last offload, ``None`` until it was seen complete."""
    last_reload_bytes: int = 0
    """Bytes of the state the last reload moved to the device."""
    last_reload_s: float | None = None
    """Seconds of the last reload, ``None`` until it was seen complete."""

    @property
    def last_offload_GBps(self) -> float | None:
        return _rate(self.last_offload_bytes, self.last_offload_s)

    @property
    def last_reload_GBps(self) -> float | None:
        return _rate(self.last_reload_bytes, self.last_reload_s)


def _rate(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


class StatsRecorder:
    """Keeps a ferry's :class:`TransferStats` as its transfers are issued and seen complete.

    Handles reach it through a weak reference, so a handle kept by a caller
    keeps neither the recorder nor the ferry alive.
    """

    def __init__(self) -> None:
        self.stats = TransferStats()
        self._latest: dict[str, object] = {}  # direction -> the last handle issued

    def issued(self, handle, nbytes: int | None = None) -> None:
        """Counts a transfer of ``nbytes`` (default ``handle.nbytes``) and watches ``handle``."""
        kind = "offload" if handle.direction == "d2h" else "reload"
        nbytes = handle.nbytes if nbytes is None else nbytes
        st = self.stats
        self.stats = dataclasses.replace(
            st,
            **{f"{kind}s": getattr(st, f"{kind}s") + 1,
               f"bytes_{kind}ed": getattr(st, f"bytes_{kind}ed") + nbytes,
               f"last_{kind}_bytes": nbytes, f"last_{kind}_s": None,
               **({"offload_bytes_copied": getattr(handle, "bytes_copied", nbytes)} if kind == "offload" else {})},
        )
        self._latest[handle.direction] = handle
        ref = weakref.ref(self)
        handle.add_done_callback(lambda h: (r := ref()) is not None and r._completed(h))

    def latest(self, direction: str):
        """The last handle issued in ``direction`` (``"d2h"`` or ``"h2d"``), or ``None``."""
        return self._latest.get(direction)

    def _completed(self, handle) -> None:
        kind = "offload" if handle.direction == "d2h" else "reload"
        seconds = handle.seconds or 0.0
        st = self.stats
        changes = {f"{kind}_seconds": getattr(st, f"{kind}_seconds") + seconds}
        if handle is self._latest.get(handle.direction):
            changes[f"last_{kind}_s"] = seconds
        self.stats = dataclasses.replace(st, **changes)
        logger.debug("%s done: %d bytes in %.6f s (%.2f GB/s)", kind, handle.nbytes, seconds,
                     handle.nbytes / seconds / 1e9 if seconds else float("nan"))
