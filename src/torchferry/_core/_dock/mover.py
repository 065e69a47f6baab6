"""The dock's moves: evictions, loads, sleeps, wakes and swaps as its engine decided them, and their record.

:class:`Mover` carries them out for one :class:`~torchferry._core._dock.engine.DockEngine`, which decides
them and holds it. Its budget arithmetic is the execution view of [Note: dock accounting] (in ``engine``): a
set counts until its D2H copies are complete, and a load or wake waits for the oldest outgoing sets
(:meth:`Mover.wait_room`) until its bytes fit.

[Note: prefetch hand-off]
``Ferry.reload()`` makes the caller's current stream wait for its copies.
Called on the compute stream, a prefetch would hold back every kernel queued
after it until the whole set had arrived: no overlap. So prefetch reloads run
with the dock's own stream current; the compute stream does not wait, and the
storages come from that stream's blocks, which no other work touches.
Before a prefetched set is used, or evicted, the compute stream is made to
wait for the reload (``handle.wait_stream``): ``use()``, ``acquire()``,
``require()``, ``wait()`` and eviction do it. Without it a forward would read
half-copied parameters, and an offload (whose D2H copies wait only for the
current stream) would copy bytes that had not arrived yet. FSDP2's all-gather
streams wait for the reload by themselves (``Ferry.reload``). Do not move a
docked set behind the dock's back while a prefetch may be in flight; call
``dock.wait()`` first.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from .._api.handle import TransferHandle
from .._api.residency import Residency
from .._ferry.interrupts import interrupts_deferred
from .._ferry.swap import swap_if_fits
from .._transfer.streams import side_stream
from .measure import kept_bytes, measured
from .records import Move, _Claimant, _Set
from .schedule import held

__all__ = ["Mover"]

logger = logging.getLogger("torchferry")

_MOVES_KEPT = 4096


class Mover:
    """Carries out one dock's moves and keeps their record: the sets still leaving, the counts, the last moves.

    Args:
        budget_bytes: the dock's budget.
        sets: the engine's state sets by name (the same dict: the mover reads it, never changes it).
        claimants: the engine's claimants by name (likewise).
        device: the state sets' device, or ``None`` until the first set (the engine sets :attr:`device`).
    """

    def __init__(self, budget_bytes: int, sets: dict[str, _Set], claimants: dict[str, _Claimant],
                 device: torch.device | None) -> None:
        self.device = device
        self.counts = collections.Counter()
        self.moves: collections.deque[Move] = collections.deque(maxlen=_MOVES_KEPT)
        self.leaving: list[str] = []  # sets whose offload may still be copying, oldest first
        self._budget = budget_bytes
        self._sets = sets
        self._claimants = claimants
        self._stream: torch.cuda.Stream | None = None  # see [Note: prefetch hand-off]
        self._seq = 0

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def measure(self, s: _Set) -> int:
        """Measures ``s`` now (see [Note: a set counts its bytes now]); returns its bytes."""
        s.nbytes, s.storages = measured(s.ferry)
        return s.nbytes

    def _held_now(self) -> int:
        """Bytes on the device now: outgoing sets count until their copies are complete."""
        return held(self._sets.values(), self._claimants.values(), physical=True)

    def _log(self, kind: str, name: str, nbytes: int, handle: TransferHandle | None, *, background: bool,
             swapped: bool = False) -> None:
        self.moves.append(Move(self._seq, kind, name, nbytes, handle, background, swapped,  # type: ignore[arg-type]
                               time.perf_counter() if handle is None else handle.issued_at))
        self._seq += 1
        logger.debug("dock: %s %s (%d bytes)%s%s", kind, name, nbytes, " in the background" if background else "",
                     " by swap" if swapped else "")

    def _side_stream(self) -> torch.cuda.Stream:
        # The stream prefetch reloads are issued with, so the compute stream does not wait for them
        # (see [Note: prefetch hand-off]).
        if self._stream is None:
            self._stream = side_stream(self.device)
        return self._stream

    def hand_off(self, s: _Set) -> None:
        """Makes the current stream wait for a prefetch reload (see [Note: prefetch hand-off])."""
        if s.side:
            assert s.handle is not None
            s.handle.wait_stream(torch.cuda.current_stream(self.device))
            s.side = False

    def prune_leaving(self) -> None:
        """Forgets the outgoing sets whose copies are complete."""
        self.leaving = [n for n in self.leaving if self._sets[n].ferry.residency is Residency.D2H_IN_FLIGHT]

    def forget(self, name: str) -> None:
        """Stops tracking ``name`` (the engine dropped it)."""
        self.leaving = [n for n in self.leaving if n != name]

    def wait_room(self, nbytes: int) -> None:
        """Waits for outgoing sets, oldest first, until ``nbytes`` more fit physically."""
        self.prune_leaving()
        while self.leaving and self._held_now() + nbytes > self._budget:
            s = self._sets[self.leaving.pop(0)]
            h = s.handle if s.handle is not None and s.handle.direction == "d2h" else None
            if h is None:  # offloaded behind the dock's back: its last handle is that offload's
                h = getattr(s.ferry, "last_handle", None) or s.ferry.offload()  # offload(): a no-op returning it
            h.wait()
            self.counts.update(waits=1)
            self.prune_leaving()

    def fits_now(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit physically now (outgoing sets whose copies are done are let go)."""
        self.prune_leaving()
        return self._held_now() + nbytes <= self._budget

    @interrupts_deferred  # the move and its record together ([Note: all or nothing])
    def evict(self, s: _Set, *, background: bool) -> None:
        """Offloads ``s`` ([Note: released without a copy] in ``engine``); it counts until its copies are done."""
        self.hand_off(s)
        h = s.ferry.offload()
        s.handle, s.prefetched = h, False
        self.measure(s)  # the offload planned what it moved
        self.leaving.append(s.name)
        self.counts.update(evictions=1, bytes_evicted=h.nbytes, prefetch_evictions=int(background))
        self._log("evict", s.name, h.nbytes, h, background=background)

    @interrupts_deferred  # the move and its record together ([Note: all or nothing])
    def adopt(self, s: _Set) -> None:
        """Takes in an evicted set holding state on the device again ([Note: state loaded behind the dock's back]
        in ``measure``): ``reload()`` reconciles it (what is on the device stays there); resident from now."""
        h = s.ferry.reload()
        s.handle, s.prefetched, s.side = h, False, False
        self.forget(s.name)
        self.measure(s)
        self.counts.update(adoptions=1)
        logger.debug("dock: %s holds state loaded behind the dock's back; counted resident (%d bytes)",
                     s.name, s.nbytes)

    @interrupts_deferred  # the move and its record together ([Note: all or nothing])
    def load(self, s: _Set, *, background: bool) -> None:
        """Reloads ``s``; in the background (a prefetch) on the dock's stream (see [Note: prefetch hand-off])."""
        if background and self._cuda:
            with torch.cuda.stream(self._side_stream()):
                h = s.ferry.reload()
            s.side = True
        else:
            h = s.ferry.reload()
        s.handle, s.prefetched = h, background
        self.measure(s)
        self.counts.update(loads=1, bytes_loaded=h.nbytes, prefetch_loads=int(background))
        self._log("load", s.name, h.nbytes, h, background=background)

    def sleep(self, c: _Claimant, *, background: bool) -> None:
        """Calls the claimant's ``sleep()``."""
        assert c.sleep is not None
        c.sleep()
        c.awake = False
        self.counts.update(sleeps=1)
        self._log("sleep", c.name, c.nbytes, None, background=background)

    def wake(self, c: _Claimant) -> None:
        """Calls the claimant's ``wake()`` once its bytes fit physically."""
        assert c.wake is not None
        self.wait_room(c.nbytes)
        if c.empty_cache and self._cuda:
            torch.cuda.empty_cache()
        c.wake()
        c.awake = True
        self.counts.update(wakes=1)
        self._log("wake", c.name, c.nbytes, None, background=False)

    def _settle_allocator(self) -> None:
        """Lets the caching allocator free blocks whose copies are done, so ``memory_allocated`` is current.

        Blocks released with ``record_stream`` stay counted until the
        allocator processes their events, which it does at its next
        allocation; a 1-byte allocation is that allocation.
        """
        if self._cuda:
            torch.empty(1, dtype=torch.uint8, device=self.device)

    @interrupts_deferred  # the move and its record together ([Note: all or nothing])
    def swap(self, out: _Set, into: _Set) -> None:
        """One set out and one in on both copy engines; ``into`` waits only for the bytes it needs."""
        out_bytes, in_bytes = out.nbytes, into.nbytes - kept_bytes(into.ferry)  # kept: on the device already
        self.wait_room(in_bytes - out_bytes)  # other outgoing sets first
        self.hand_off(out)
        budget = None
        if self._cuda:
            self._settle_allocator()
            budget = torch.cuda.memory_allocated(self.device) + self._budget - self._held_now()
        swapped = swap_if_fits(out.ferry, into.ferry, budget)  # one measurement for the question and the swap
        if swapped is None:
            # The budget counts memory_allocated(), which also holds memory the dock does not know
            # (another thread's, inside a use()): one after the other instead.
            logger.debug("dock: swap(%s, %s) does not fit; evicting then loading", out.name, into.name)
            self.evict(out, background=False)
            self.wait_room(in_bytes)
            self.load(into, background=False)
            return
        h_out, h_in = swapped
        out.handle, out.prefetched = h_out, False
        into.handle, into.prefetched = h_in, False
        self.measure(out)
        self.measure(into)
        self.leaving.append(out.name)
        self.counts.update(evictions=1, loads=1, swaps=1, bytes_evicted=h_out.nbytes, bytes_loaded=h_in.nbytes)
        self._log("evict", out.name, h_out.nbytes, h_out, background=False, swapped=True)
        self._log("load", into.name, h_in.nbytes, h_in, background=False, swapped=True)
