"""The host pool's side of :class:`~torchferry.Ferry`: its figures, reserving it before the first
offload ([Note: pin ahead] in ``_ferry/pin_ahead``, [Note: host budget] in ``_host/budget``) and
returning it to the OS while the state is resident."""

from __future__ import annotations

from concurrent.futures import Future

from .._api.args import check_bool
from .._api.handle import done_future
from .machine import ResidencyMachine
from .misuse import moves_state

__all__ = ["HostSide"]


class HostSide(ResidencyMachine):
    """The host pool's figures and calls of a :class:`~torchferry.Ferry`."""

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (pinned when the device is a GPU)."""
        return self._pool.nbytes

    @property
    def pinned(self) -> bool:
        """Whether the whole host pool is page-locked (GPU ferries once allocated, unless
        ``max_pinned_bytes`` kept part of it pageable)."""
        return self._pool.pin and self._pool.nbytes > 0 and self._pool.pinned_bytes == self._pool.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the host pool that are page-locked (registered with CUDA)."""
        return self._pool.pinned_bytes if self._pool.pin else 0

    @moves_state("reserve_host()")
    def reserve_host(self, *, background: bool = False) -> float | Future:
        """Plans the state now and allocates (and pins) the host pool for it.

        Optional (``offload()`` does it on first use, and ``pin_ahead`` starts it in the background): keeps pinning
        out of the first offload. ``background=True`` pins in a thread while training goes on; an ``offload()`` that
        comes first waits for it. The node's host budget is checked first ([Note: host budget]).

        Returns:
            Host seconds spent allocating, touching and pinning (0.0 when the pool already fits,
            unless pinned ahead and not yet reported); with ``background``, a ``Future`` of them.

        Raises:
            HostBudgetError: (a ``RuntimeError``) the node's budget or free memory cannot hold the
                pool; nothing was allocated.
            RuntimeError: host memory could not be allocated or pinned (with ``background``, raised
                by the future and by the next offload).
            TypeError: ``background`` is not a bool.
        """
        check_bool(background, "reserve_host(background=...)")
        self._check_open()
        self._complete_prefetch()
        if self.residency.on_host:
            return done_future(0.0) if background else 0.0
        self._state_bytes, fut, grew = self._set.reserve(background)
        ahead = self._pin_ahead.claim() if self._pin_ahead is not None else None  # the pool came from it
        if background:
            return fut or ahead or done_future(0.0)
        return self._pool.pin_seconds if grew or (ahead is not None and self._pool.pinned_bytes) else 0.0

    @moves_state("release_host()")
    def release_host(self) -> None:
        """Returns the host pool to the OS now, keeping the ferry usable.

        For a ferry whose state stays resident for a while: its pinned memory goes back to the
        node (and its budget); the next ``offload()`` pins again.

        Raises:
            RuntimeError: the state is offloaded (``reload()`` first), or the ferry is closed.
        """
        self._check_open()
        self._drop_pool("release_host()")

    def _drop_pool(self, what: str) -> None:
        """Returns the pool to the OS; the state must be (or become) resident."""
        self._complete_prefetch()
        if self.residency.on_host:
            raise RuntimeError(f"torchferry: {what} while the state is offloaded would lose it; "
                               "call reload() first")
        if self._last is not None:
            self._last.wait()  # the pool may still be read by an H2D copy
        self._set.disarm_early()
        self._set.forget_host()  # its views would keep the block mapped
        self._pool.release()
