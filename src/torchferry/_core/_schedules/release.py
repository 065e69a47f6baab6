"""Swap's release schedule: outgoing storages freed as their copies land, for the incoming ones.

[Note: swap budget]
A plain offload releases its storages with ``record_stream``: the caching
allocator then hands a block out again only after an event recorded at
release time, that is after *all* the offload's copies (measured on an H200:
the incoming state took fresh memory, 1 GiB over a 256 MiB budget). So a swap
passes a :class:`ReleaseSchedule` to the outgoing ``offload()``, which keeps
its storages allocated and records D2H progress events (every 256 MiB). The
incoming ``reload()`` asks the schedule before each allocation; the schedule
waits for the progress event that covers enough outgoing bytes for the
incoming state, the outgoing bytes still in flight and everything else
allocated to stay within the budget, then releases the storages whose copies
are complete: their blocks are free at once, for the incoming storages. The
reload is handed that schedule as data, :attr:`ReleaseSchedule.gate` (an
``AllocGate`` of ``_transfer/gates``, which carries it out), not a callback.
Whatever is left is released (safely, with ``record_stream``) by
:meth:`ReleaseSchedule.release_rest`. Storages the offload skipped as
unchanged ([Note: unchanged storages]) are read by no copy: they are released
at once, and their bytes count as already gone. Storages a tensor the ferry
does not know views are never released ([Note: a storage shared with a
tensor the ferry does not know]): their bytes stay allocated.
"""

from __future__ import annotations

import torch

from .._transfer.copies import D2HIssued
from .._transfer.release import ReleaseRolledForward, undo_release
from .._transfer.gates import AllocGate, Pending, free_pending
from .._state.plan import Plan
from .._transfer.streams import TransferStreams, wait_event

__all__ = ["PROGRESS_EVERY", "ReleaseSchedule"]

PROGRESS_EVERY = 256 << 20  # bytes between D2H progress events


class ReleaseSchedule:
    """When the outgoing state of a swap gives its device memory back.

    Args:
        budget_bytes: device bytes everything allocated may reach during the
            swap, or ``None`` for no limit (storages are then released as in a
            plain offload, right away).
        base_bytes: bytes allocated on the device before the swap, the
            outgoing state included.
    """

    def __init__(self, budget_bytes: int | None, base_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.base_bytes = base_bytes
        self._freed = 0  # bytes released at once (storages skipped as unchanged)
        self._streams: TransferStreams | None = None
        self._gate: AllocGate | None = None  # once the outgoing storages are taken

    @property
    def gate(self) -> AllocGate | None:
        """What the incoming reload waits for and frees before each allocation (``issue_h2d``'s
        ``gate``): ``None`` until :meth:`hold` took the outgoing storages."""
        return self._gate

    @property
    def tracks(self) -> bool:
        """Whether the offload should keep its storages and record progress."""
        return self.budget_bytes is not None

    def hold(self, plan: Plan, sources: list[torch.Tensor], slots: list[torch.Tensor], issued: D2HIssued,
             streams: TransferStreams, unchanged: set[int] | frozenset[int] = frozenset(),
             kept: frozenset[int] = frozenset()) -> None:
        """Takes the outgoing storages (called by the offload, after its copies were queued);
        those in ``unchanged`` (not copied, read by no stream now) are released at once, all or
        nothing (``slots``: the pool views, for [Note: a release undone from the pool]). Nothing is
        taken if it raises, except :class:`ReleaseRolledForward` ([Note: a release rolled forward]):
        then everything is taken. Those in ``kept`` are neither taken nor released (as in
        ``release()``, the caller's stream waits for the copies first)."""
        after = issued.copied_after or [0] * len(sources)
        pending = [Pending(after[si], st, src) for si, (st, src) in enumerate(zip(plan.storages, sources, strict=False))
                   if si not in unchanged and si not in kept and src.numel()]
        unchanged = frozenset(unchanged) - kept
        if kept and streams.is_cuda and issued.event is not None:
            wait_event(streams.current(), issued.event)
        try:
            for si in unchanged:
                plan.storages[si].resize_(0)
        except BaseException as error:
            try:
                undo_release(plan, unchanged, slots, issued.event, error)
            except ReleaseRolledForward:  # they are all freed: the hold completes, then raises
                self._take(plan, streams, issued, unchanged, pending)
                raise
            raise
        self._take(plan, streams, issued, unchanged, pending)

    def _take(self, plan: Plan, streams: TransferStreams, issued: D2HIssued, unchanged: set[int] | frozenset[int],
              pending: list[Pending]) -> None:
        self._streams = streams
        self._freed += sum(plan.nbytes[si] for si in unchanged)
        room = None if self.budget_bytes is None else self.budget_bytes + self._freed - self.base_bytes  # base
        self._gate = AllocGate(room, issued.progress[-1][0] if issued.progress else 0,  # counts all of out
                               list(issued.progress), pending)

    def before_alloc(self, allocated: int) -> None:
        """What the incoming reload's :attr:`gate` does with its bytes allocated so far (the next storage
        included): waits for the outgoing copies the budget needs gone and frees their storages."""
        if self._gate is not None:
            self._gate.before_alloc(allocated)

    def release_rest(self) -> None:
        """Releases what is left, safely against the copies still in flight."""
        if self._gate is None:
            return
        streams = self._streams
        free_pending(self._gate, self._gate.pending, [],
                     record=streams.d2h if streams is not None and streams.is_cuda else None)
