"""The only place that creates CUDA streams and events.

[Note: torchferry streams]
Each device gets two copy streams (and a ``pack`` stream for the kernels that
gather and scatter packed small storages, see [Note: packing pipeline], and a
``gather`` stream for an offload's gathers that wait for no copy, see [Note:
small storages released without an event each]), created lazily on first use:

* ``d2h`` carries offload copies (device -> pinned host), so that they run on
  a copy engine beside compute instead of behind it on the current stream.
* ``h2d`` carries reload copies (pinned host -> device). It is separate from
  ``d2h`` because the GPU has one copy engine per direction: one state set can
  go out while another comes in (97.6 GB/s both ways against 55.5 / 55.3 GB/s one way,
  measured on one H200: ``link_peak_GBps`` in
  ``benchmarks/results/bench-pin-pinning_h200x1_2026-11-30.json``).

Hand-offs between streams always go through an event (FSDP2's
``_stream_utils`` does the same): a copy stream waits for the current stream
before it reads or writes tensors the current stream produced (prevents
copying stale values, or writing into a block the allocator just recycled from
pending current-stream work), and the current stream waits for the reload's
event before the next kernel (prevents reading a half-copied parameter).

[Note: stalls recorded]
Where a transfer is not hidden, the caller's stream waits for a copy event: a layer-wise reload's
unit, the optimizer state at ``step()``, a whole reload, a release behind its copies. How long it
waited is a device-side figure: inside :func:`record_stalls`, each such wait (:func:`wait_event`)
is bracketed by two timing events on the waiting stream, and the time between them is the
stall: the second runs once both the stream's earlier work and the copy are done, so their
difference is how long the copy held the stream up (0 when it was done first). Nothing is
synchronised to record it; :meth:`Stalls.seconds` reads the events once they completed. The
verl step bench reports it per phase beside the host time inside the offload and reload calls
(``benchmarks/verl_step``), so exposed time is attributed rather than only subtracted.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from .switch import SwitchPoints, interval

__all__ = ["Stalls", "TransferStreams", "record_stalls", "side_stream", "streams_for", "wait_event"]

_recording: contextvars.ContextVar[tuple[list[tuple[torch.cuda.Event, torch.cuda.Event]], ...]] = \
    contextvars.ContextVar("torchferry_stalls", default=())  # the open recordings' pairs, innermost last


class Stalls:
    """The waits recorded by one :func:`record_stalls` ([Note: stalls recorded])."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def count(self) -> int:
        """Waits recorded."""
        return len(self.pairs)

    def seconds(self) -> float:
        """Seconds the waiting streams were held up by copies, summed over the waits (blocks the host
        until the recorded events completed). 0.0 on the CPU or with no wait."""
        total = 0.0
        for before, after in self.pairs:
            after.synchronize()
            total += before.elapsed_time(after) / 1e3
        return total


@contextlib.contextmanager
def record_stalls() -> Iterator[Stalls]:
    """Within it, every wait of a stream for a transfer's event on this thread is timed on the device
    ([Note: stalls recorded]); nested uses record into the innermost still open. Leaving one closes that
    one only, also out of order (an outer one left before an inner one records nothing more)."""
    stalls = Stalls()
    _recording.set((*_recording.get(), stalls.pairs))
    try:
        yield stalls
    finally:
        _recording.set(tuple(p for p in _recording.get() if p is not stalls.pairs))


def wait_event(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """``stream.wait_event(event)``, timed inside :func:`record_stalls`."""
    open_ = _recording.get()
    if not open_:
        stream.wait_event(event)
        return
    pairs = open_[-1]
    before = torch.cuda.Event(enable_timing=True)
    before.record(stream)
    stream.wait_event(event)
    after = torch.cuda.Event(enable_timing=True)
    after.record(stream)
    pairs.append((before, after))


class TransferStreams:
    """The D2H and H2D streams of one device; ``None`` everywhere for the CPU.

    Attributes:
        switch_bytes: the interval of the streams' switch points (bytes; ``0``: none), ``None``: each
            direction's measured one (``switch.interval``); set by :func:`streams_for`.
    """

    def __init__(self, device: torch.device, switch_bytes: int | None = None) -> None:
        self.device = device
        self.switch_bytes = switch_bytes
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._pack: torch.cuda.Stream | None = None
        self._gather: torch.cuda.Stream | None = None
        self._switch: dict[str, SwitchPoints] = {}

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def d2h(self) -> torch.cuda.Stream:
        """Offload copies: device -> host, beside compute (see [Note: torchferry streams])."""
        if self._d2h is None:
            self._d2h = torch.cuda.Stream(self.device)
        return self._d2h

    @property
    def h2d(self) -> torch.cuda.Stream:
        """Reload copies: host -> device, on the other copy engine."""
        if self._h2d is None:
            self._h2d = torch.cuda.Stream(self.device)
        return self._h2d

    @property
    def pack(self) -> torch.cuda.Stream:
        """Gather/scatter kernels of packed small storages, beside the copies ([Note: packing pipeline])."""
        if self._pack is None:
            self._pack = torch.cuda.Stream(self.device)
        return self._pack

    @property
    def gather(self) -> torch.cuda.Stream:
        """An offload's gathers when every chunk has its own staging buffer: nothing on it ever
        waits for a copy, so the caller's stream can wait for it ([Note: small storages released
        without an event each])."""
        if self._gather is None:
            self._gather = torch.cuda.Stream(self.device)
        return self._gather

    def switch(self, direction: str) -> SwitchPoints:
        """The switch points of the ``"h2d"`` or ``"d2h"`` stream: every bulk copy on it goes
        through ``switch(direction).copy(dst, src)`` ([Note: switch points])."""
        if direction not in self._switch:
            every = interval(direction, self.switch_bytes) if self.is_cuda else 0  # the CPU: no copy engine
            self._switch[direction] = SwitchPoints(self.device, direction, every)
        return self._switch[direction]

    def set_switch_bytes(self, setting: int | None) -> None:
        """Sets :attr:`switch_bytes`, for the switch points made already too (their next copy)."""
        self.switch_bytes = setting
        if self.is_cuda:
            for direction, points in self._switch.items():
                points.every = interval(direction, setting)

    def current(self) -> torch.cuda.Stream:
        """The caller's current stream on this device."""
        return torch.cuda.current_stream(self.device)

    def event(self, stream: torch.cuda.Stream | None = None, *, timing: bool = False) -> torch.cuda.Event:
        """A new event recorded on ``stream`` (the current stream if ``None``)."""
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream if stream is not None else self.current())
        return ev


def side_stream(device: torch.device | None) -> torch.cuda.Stream:
    """A new stream of ``device`` for work a layer above issues beside the current stream (the dock's
    prefetch reloads, [Note: prefetch hand-off] in ``_dock``): every stream is made here."""
    return torch.cuda.Stream(device)


_per_device: dict[torch.device, TransferStreams] = {}


def streams_for(device: torch.device, switch_bytes: int | None = None) -> TransferStreams:
    """The process-wide :class:`TransferStreams` of ``device``: every ferry on a
    device shares its two copy streams, so their transfers queue on the copy
    engine instead of competing from several streams. ``switch_bytes``: the
    calling ferry's ``CoreSettings.switch_bytes``; the streams' switch points
    follow the ferry made last (ferries made from one environment agree)."""
    if device not in _per_device:
        _per_device[device] = TransferStreams(device)
    streams = _per_device[device]
    streams.set_switch_bytes(switch_bytes)
    return streams
