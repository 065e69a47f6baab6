"""The host pool: one exact-size host block, cut into slots (``_host/slots.layout``), reused every cycle."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from .budget import NodeLedger
from .memory import HostBuffer

__all__ = ["HostPool"]

logger = logging.getLogger("torchferry")


class HostPool:
    """Persistent host memory for one ferry.

    The block is allocated at the first offload (or ahead, by
    ``Ferry.reserve_host``, possibly in a background thread), sized exactly
    to the layout (not rounded to a power of two), pinned when the ferry's
    device is a GPU, and kept for every later cycle. It only grows when the
    state grows (for example when gradients or optimizer state appear after
    the first step). Every allocation is first granted by the node's ledger
    (see [Note: host budget]).

    Args:
        pin: whether blocks are registered with the CUDA driver.
        device: CUDA device index to register from (``None`` on the CPU).
        budget: bytes all pools of the node may hold together, or ``None``.
        ledger: the node ledger (default: the node's shared one).
    """

    def __init__(self, *, pin: bool, device: int | None = None, budget: int | None = None,
                 ledger: NodeLedger | None = None) -> None:
        self.pin = pin
        self.device = device
        self.budget = budget
        self._ledger = ledger or NodeLedger()
        self._buffer: HostBuffer | None = None
        self._pending: Future | None = None  # a background allocation under way
        self._pending_bytes = 0
        self._pending_seconds: Future | None = None  # its pinning seconds, as handed out
        self._pending_quiet = False  # a failure is logged and forgotten (pinning ahead)
        self._generation = 0

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held or being allocated (0 before the first offload or after ``release``)."""
        if self._pending is not None:
            return self._pending_bytes
        return 0 if self._buffer is None else self._buffer.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the block registered with CUDA (waits for a background allocation)."""
        self._resolve()
        return 0 if self._buffer is None else self._buffer.pinned_bytes

    @property
    def block_id(self) -> int:
        """Identifies the current block: a new number whenever one is allocated; 0 when empty."""
        self._resolve()
        return 0 if self._buffer is None else self._generation

    @property
    def pin_seconds(self) -> float:
        """Host seconds the current block took to allocate, touch and pin (waits for a background one)."""
        self._resolve()
        return 0.0 if self._buffer is None else self._buffer.pin_seconds

    def ready(self) -> bool:
        """False while a background allocation is still running."""
        return self._pending is None or self._pending.done()

    def _resolve(self) -> None:
        """Waits for a background allocation and installs its block (re-raising its error)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if self._pending_quiet and pending.exception() is not None:
            # Pinning ahead failed: the next reserve allocates (and raises) itself.
            logger.info("torchferry: pinning ahead failed (%s); the first offload pins instead", pending.exception())
            return
        self._buffer = pending.result()  # may raise: the pool is then empty
        self._generation += 1

    def _allocate(self, nbytes: int, pin_bytes: int) -> HostBuffer:
        try:
            buf = HostBuffer(nbytes, pin_bytes=pin_bytes if self.pin else 0, device=self.device)
        except BaseException:
            self._ledger.settle(nbytes, allocated=False)
            raise
        self._ledger.settle(nbytes, allocated=True)
        ledger = self._ledger
        buf._mapping.on_unmap = lambda: ledger.give_back(nbytes)
        return buf

    def reserve(self, nbytes: int, *, pin_bytes: int | None = None, background: bool = False,
                quiet: bool = False) -> Future | None:
        """Makes the pool hold at least ``nbytes``; a no-op when it already does.

        Must only be called while no slot holds live state (the old block is
        freed before the new one is mapped, so that growing does not need both).

        Args:
            nbytes: bytes needed.
            pin_bytes: bytes from the start of the block to pin (``None``: all).
            background: allocate, touch and pin in a background thread and
                return at once; the next ``view`` (or ``reserve``) waits for it.
            quiet: with ``background``: if the allocation fails, log it and
                leave the pool empty instead of raising at the next ``view``
                (pinning ahead, which nobody asked for explicitly).

        Returns:
            With ``background``, a ``Future`` resolving to the host seconds the
            allocation took (``None`` when nothing had to be allocated; the
            pending one's when a background allocation already covers ``nbytes``).

        Raises:
            HostBudgetError: the node's budget or free memory cannot hold the
                block (raised here, also with ``background``); the pool is empty.
            RuntimeError: host memory could not be allocated or pinned; the
                pool is then empty.
        """
        if self._pending is not None and not background:
            self._resolve()
        if nbytes <= self.nbytes:
            return self._pending_seconds if self._pending is not None else None
        self.release()
        pin_bytes = nbytes if pin_bytes is None else min(pin_bytes, nbytes)
        self._ledger.request(nbytes, budget=self.budget,
                             what=f"a host pool ({pin_bytes if self.pin else 0} bytes pinned)")
        if not background:
            self._buffer = self._allocate(nbytes, pin_bytes)
            self._generation += 1
            return None
        fut: Future = Future()

        def work() -> None:
            try:
                fut.set_result(self._allocate(nbytes, pin_bytes))
            except BaseException as e:  # handed to whoever waits
                fut.set_exception(e)

        self._pending, self._pending_bytes, self._pending_quiet = fut, nbytes, quiet
        # Not a daemon: the interpreter's exit waits for it. A daemon thread still allocating in torch's C++ code
        # when the process exits aborts it ("terminate called without an active exception", rc 134:
        # tests/cpu/test_pool.py::test_the_process_exits_cleanly_with_a_background_allocation_in_flight).
        threading.Thread(target=work, name="torchferry-pin", daemon=False).start()
        seconds: Future = Future()
        fut.add_done_callback(
            lambda f: seconds.set_exception(f.exception()) if f.exception()
            else seconds.set_result(f.result().pin_seconds))
        self._pending_seconds = seconds
        return seconds

    def view(self, offset: int, nbytes: int, *, own: bool = False) -> torch.Tensor:
        """1D ``torch.uint8`` view of ``nbytes`` bytes at ``offset`` of the block; with ``own``,
        on a storage of its own (see :meth:`HostBuffer.own_view` and [Note: one storage per slot])."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        self._resolve()
        if self._buffer is None or offset + nbytes > self._buffer.nbytes:
            raise AssertionError(f"slot [{offset}, {offset + nbytes}) outside the pool")
        return self._buffer.own_view(offset, nbytes) if own else self._buffer.view(offset, nbytes)

    def release(self) -> None:
        """Returns the block to the OS (unpinned first). Idempotent; waits for a background allocation."""
        try:
            self._resolve()
        except Exception:
            pass  # it failed: nothing to free
        buf, self._buffer = self._buffer, None
        if buf is not None:
            buf.free()
