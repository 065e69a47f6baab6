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
are complete: their blocks are free at once, for the incoming storages.
Whatever is left is released (safely, with ``record_stream``) by
:meth:`ReleaseSchedule.release_rest`. Storages the offload skipped as
unchanged ([Note: unchanged storages]) are read by no copy: they are released
at once, and their bytes count as already gone. Storages a tensor the ferry
does not know views are never released ([Note: a storage shared with a
tensor the ferry does not know]): their bytes stay allocated.
"""

from __future__ import annotations

import torch

from .._transfer.copies import D2HIssued, ReleaseRolledForward, undo_release
from .._state.plan import Plan
from .._transfer.streams import TransferStreams

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
        self._progress: list[tuple[int, torch.cuda.Event]] = []
        self._pending: list[tuple[int, torch.UntypedStorage, torch.Tensor]] = []  # (bytes copied after it, ...)
        self._out_bytes = 0
        self._freed = 0  # bytes released at once (storages skipped as unchanged)
        self._streams: TransferStreams | None = None

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
        pending = [(after[si], st, src) for si, (st, src) in enumerate(zip(plan.storages, sources, strict=False))
                   if si not in unchanged and si not in kept and src.numel()]
        unchanged = frozenset(unchanged) - kept
        if kept and streams.is_cuda and issued.event is not None:
            streams.current().wait_event(issued.event)
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
              pending: list[tuple[int, torch.UntypedStorage, torch.Tensor]]) -> None:
        self._streams = streams
        self._progress = list(issued.progress)
        self._out_bytes = issued.progress[-1][0] if issued.progress else 0
        self._freed += sum(plan.nbytes[si] for si in unchanged)
        self._pending = pending

    def before_alloc(self, allocated: int) -> None:
        """Called by the incoming reload with its bytes allocated so far (the next storage included)."""
        if self.budget_bytes is None or not self._progress:
            return
        must_have_left = self.base_bytes + allocated - self.budget_bytes - self._freed  # base counts all of out
        if must_have_left <= 0:
            return
        for copied, event in self._progress:
            if copied >= min(must_have_left, self._out_bytes):
                event.synchronize()
                self._release(copied)
                return

    def _release(self, copied: int) -> None:
        self._free([e for e in self._pending if e[0] <= copied], [e for e in self._pending if e[0] > copied],
                   record=False)  # their copies are complete: free at once

    def release_rest(self) -> None:
        """Releases what is left, safely against the copies still in flight."""
        self._free(self._pending, [], record=self._streams is not None and self._streams.is_cuda)

    def _free(self, free: list[tuple[int, torch.UntypedStorage, torch.Tensor]],
              keep: list[tuple[int, torch.UntypedStorage, torch.Tensor]], *, record: bool) -> None:
        """Frees ``free`` and keeps ``keep`` pending; if freeing one raises, it and those after it
        stay pending too (the outgoing tensors view the pool: a storage freed is simply gone)."""
        for k, (_, storage, src) in enumerate(free):
            try:
                if record:
                    src.record_stream(self._streams.d2h)  # pyright: ignore[reportOptionalMemberAccess]  # record: streams set
                storage.resize_(0)
            except BaseException:
                self._pending = keep + free[k:]
                raise
        self._pending = keep
