"""Completion handles for transfers."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Literal

import torch

from .args import check_callable, check_stream

__all__ = ["TransferHandle", "done_future"]


class TransferHandle:
    """Completion of one offload (D2H) or reload (H2D).

    Attributes:
        direction: ``"d2h"`` (offload) or ``"h2d"`` (reload).
        nbytes: bytes the transfer moves (0 for a no-op).
        bytes_copied: bytes actually copied: ``nbytes`` less, for an offload,
            the storages skipped as unchanged (``Ferry(skip_unchanged=True)``).
        issued_at: ``time.perf_counter()`` when the transfer was issued.
    """

    def __init__(
        self,
        direction: Literal["d2h", "h2d"],
        nbytes: int,
        event: torch.cuda.Event | None,
        issued_at: float | None = None,
        *,
        start_event: torch.cuda.Event | None = None,
        bytes_copied: int | None = None,
        ready_event: torch.cuda.Event | None = None,
    ) -> None:
        self.direction = direction
        self.nbytes = nbytes
        self.bytes_copied = nbytes if bytes_copied is None else bytes_copied
        self._event = event  # recorded on the copy stream after the last copy
        self._start_event = start_event  # recorded on the copy stream before the first copy
        # After everything the transfer does on the device (its copies, a reload's baseline hash):
        # what wait(), done() and wait_stream() order ([Note: a handle orders the whole transfer]).
        self._ready = ready_event if ready_event is not None else event
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        self.issued_at = time.perf_counter() if issued_at is None else issued_at
        self._completed_at: float | None = None
        if self._ready is None:
            self._complete(time.perf_counter())

    @property
    def event(self) -> torch.cuda.Event | None:
        """The CUDA event recorded after the last copy (``None`` on the CPU or for a no-op)."""
        return self._event

    @property
    def ready_event(self) -> torch.cuda.Event | None:
        """The CUDA event recorded after everything the transfer does on the device: its copies
        and, for a reload, the baseline hash of ``skip_unchanged`` and the work of making a
        layer-wise reload resident (``None`` on the CPU or for a no-op). ``wait()``, ``done()`` and
        ``wait_stream()`` order this one.

        [Note: a handle orders the whole transfer]
        With ``skip_unchanged`` a whole-set reload hashes its storages on the
        current stream after its copies, as the baseline of [Note: unchanged
        storages]. When the handle ordered only the copies, a ``.data`` write on a
        side stream made after ``h.wait_stream(side)`` could land before the hash
        read the storage; the next offload found it unchanged and copied nothing,
        and the next reload brought the old bytes back (19 of 20 trials on one
        H200 at 0e8596e). So a handle's ordering covers everything the transfer
        queues on the device, the copies' event staying the copies' alone (its
        timing, ``seconds``). ``tests/gpu/test_stream_order_cuda.py``.
        """
        return self._ready

    def _complete(self, when: float) -> None:
        self._completed_at = when
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Calls ``fn(self)`` once the transfer is seen complete (now, if it already is).

        Completion is observed by ``wait()`` or ``done()``, on the thread that calls them.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        check_callable(fn, "add_done_callback(fn)")
        if self._completed_at is not None:
            fn(self)
        else:
            self._callbacks.append(fn)

    def done(self) -> bool:
        """True when every copy of the transfer has finished (never blocks)."""
        if self._completed_at is None and self._ready is not None and self._ready.query():
            self._complete(time.perf_counter())
        return self._completed_at is not None

    def wait(self) -> None:
        """Blocks the host until every copy of the transfer has finished.

        After an offload's ``wait()`` the host copies are safe to read; after a
        reload's, the device tensors are complete for any stream.
        """
        if self._completed_at is None:
            assert self._ready is not None
            self._ready.synchronize()
            self._complete(time.perf_counter())

    def wait_stream(self, stream: torch.cuda.Stream) -> None:
        """Makes ``stream`` wait for the transfer without blocking the host: for its copies and
        everything else it queued on the device ([Note: a handle orders the whole transfer]), so a
        write made on ``stream`` afterwards is never lost.

        ``reload()`` already does this for the stream that was current when it
        was called; use this to consume the state on another stream.

        Raises:
            TypeError: ``stream`` is not a stream (checked on the CPU too).
        """
        check_stream(stream, "wait_stream(stream)")
        if self._ready is not None:
            stream.wait_event(self._ready)

    @property
    def seconds(self) -> float | None:
        """Seconds the transfer took, once ``wait()`` or ``done()`` saw it complete.

        On a GPU the copy engine's time from the first copy to the last (CUDA
        events on the copy stream: waiting for the caller's pending kernels is
        not counted); on the CPU the host time of the synchronous copies.
        """
        if self._completed_at is None:
            return None
        if self._start_event is not None and self._event is not None:
            return self._start_event.elapsed_time(self._event) / 1e3
        return self._completed_at - self.issued_at

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"TransferHandle({self.direction}, {self.nbytes} bytes, {state})"


def done_future(value: object) -> Future:
    """A ``concurrent.futures.Future`` already holding ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut
