"""The records of one whole-set move: what an offload issued, what a ferry holds while offloaded,
and the two moves in progress (:class:`OffloadMove`, :class:`ReloadMove`), each with the one step
that finishes it or the undo that takes it back ([Note: all or nothing]).

:class:`~torchferry._core._ferry.state_set.StateSet` makes them; the ``Ferry`` records residency
and the handle between making one and finishing it, so that a failure there is undone too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._api.handle import TransferHandle
from .._host.layout import HostViews
from .._schedules.release import ReleaseSchedule
from .._schedules.unchanged import UnchangedStorages
from .._state.parking import Parking
from .._state.plan import Plan
from .._transfer.arena import ReloadArena
from .._transfer.copies import D2HIssued, undo_allocations
from .._transfer.h2d import H2DIssued
from .._transfer.release import ReleaseRolledForward, release
from .._transfer.streams import TransferStreams

__all__ = ["OffloadIssued", "OffloadMove", "Offloaded", "ReloadMove"]


class OffloadIssued(NamedTuple):
    """What :meth:`StateSet.issue_offload` did: the plan, its pool views, the copies, and the
    ``id`` of every target tensor at that time (see [Note: state replaced while offloaded])."""

    plan: Plan
    views: HostViews
    copies: D2HIssued
    ids: list[int]
    unchanged: set[int]  # not copied at all: their slots hold their bytes ([Note: unchanged storages])
    # copied but not released: a tensor the ferry does not know views them ([Note: a storage shared
    # with a tensor the ferry does not know])
    kept: frozenset[int] = frozenset()

    @property
    def bytes_copied(self) -> int:
        """Bytes this offload copies D2H (early copies included, unchanged storages not)."""
        return self.plan.state_bytes - sum(self.plan.nbytes[si] for si in self.unchanged)


class Offloaded(NamedTuple):
    """What a ferry holds while its state is on the host: the plan, its pool views, and the ids
    of the tensors the targets held at the offload (see [Note: state replaced while offloaded])."""

    plan: Plan
    views: HostViews
    ids: list[int]
    kept: frozenset[int] = frozenset()  # storages left allocated (see :class:`OffloadIssued`)


class OffloadMove:
    """An offload whose D2H copies are issued and whose tensors view the pool already.

    :meth:`finish` frees the device storages (or hands them to a swap's schedule): the last step,
    all or nothing itself ([Note: a release undone from the pool]). :meth:`undo`, before that or
    after a :meth:`finish` that raised, gives every tensor its device impl back (the copies only
    wrote the pool).
    """

    def __init__(self, issued: OffloadIssued, sources: list[torch.Tensor], parking: Parking,
                 streams: TransferStreams, schedule: ReleaseSchedule | None) -> None:
        self.issued, self._sources, self._parking = issued, sources, parking
        self._streams, self._schedule = streams, schedule
        self.released: torch.cuda.Event | None = None  # see release(): set by finish() on a GPU
        self.done = False  # the storages are freed (see finish())

    @property
    def offloaded(self) -> Offloaded:
        return Offloaded(self.issued.plan, self.issued.views, self.issued.ids, self.issued.kept)

    def handle(self, issued_at: float) -> TransferHandle:
        """The handle of the D2H copies (``issued_at``: ``time.perf_counter()`` at the call)."""
        i = self.issued
        return TransferHandle("d2h", i.plan.state_bytes, i.copies.event, issued_at,
                              start_event=i.copies.start, bytes_copied=i.bytes_copied)

    def undo(self) -> None:
        self._parking.to_device(range(len(self.issued.plan.tensors)))

    def finish(self) -> None:
        """Frees the storages; :attr:`done` once they are freed, also when it then raises.

        Raises:
            BaseException: what freeing raised, after its undo (not :attr:`done`: :meth:`undo` next),
                or, where the undo failed too, after the release was completed ([Note: a release rolled
                forward]; :attr:`done`: the caller completes the offload, then lets it pass).
        """
        i = self.issued
        try:
            if self._schedule is not None:  # see [Note: swap budget]
                self._schedule.hold(i.plan, self._sources, i.views.slots, i.copies, self._streams, i.unchanged,
                                    i.kept)
            else:
                self.released = release(i.plan, self._sources, i.views.slots, self._streams, i.copies.event,
                                        gathered=i.copies.gathered, kept=i.kept)
        except ReleaseRolledForward as rolled:
            self.done = True
            raise rolled.error from rolled.undo_error
        self.done = True


class ReloadMove:
    """A whole-set reload: storages re-allocated, H2D copies issued, tensors re-pointed (the
    current stream waits for the copies), the baseline of [Note: unchanged storages] taken.

    :meth:`undo` takes each step back in reverse, whichever were reached (idempotent).
    """

    def __init__(self, plan: Plan, parking: Parking, streams: TransferStreams, arena: ReloadArena | None,
                 unchanged: UnchangedStorages | None) -> None:
        self.plan, self._parking, self._streams = plan, parking, streams
        self.arena, self._unchanged = arena, unchanged
        self.copies: H2DIssued | None = None
        self.repointed = False
        self.ready: torch.cuda.Event | None = None  # see [Note: a handle orders the whole transfer]

    def handle(self, issued_at: float) -> TransferHandle:
        copies = self.copies
        return TransferHandle("h2d", self.plan.state_bytes, copies.event if copies is not None else None, issued_at,
                              start_event=copies.start if copies is not None else None, ready_event=self.ready)

    def undo(self) -> None:
        if self._unchanged is not None:
            self._unchanged.forget()
        if self.repointed:
            self._parking.revert_to_device(range(len(self.plan.tensors)))
            self.repointed = False
        if self.copies is not None:  # not a storage the offload kept: the reload did not allocate it
            undo_allocations(self.plan, self.copies.allocated, self._streams)
            self.copies = None
        if self.arena is not None:
            self.arena.release()
            self.arena = None
