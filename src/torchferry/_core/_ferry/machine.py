"""The residency state machine under :class:`~torchferry.Ferry`: what a ferry records (where its
state is, what is offloaded, the last handle, the layer-wise reload under way) and the steps of a
reload that change those records: a plain reload, the reconcile of state replaced while offloaded
([Note: state replaced while offloaded] in ``_ferry/reconcile``), and the start and the hand-over of
a layer-wise reload ([Note: prefetch reload] in ``_schedules/prefetch``). Each step records its
decisions last, under a :class:`Rollback` ([Note: one rollback])."""

from __future__ import annotations

import logging
import time

import torch

from .._api.handle import TransferHandle
from .._api.residency import Residency
from .._api.stats import StatsRecorder
from .._schedules.prefetch import Group, Prefetch, PrefetchRun
from .._schedules.release import ReleaseSchedule
from .._state.fsdp import resync_sharded_data
from .._state.targets import Targets
from .._transfer.copies import transfer_range
from .guards import OffloadGuards
from .misuse import NotCopyable, OneMover
from .moves import Offloaded
from .pin_ahead import PinAhead
from .rollback import Rollback
from .state_set import StateSet
from .watch import ResidentWatch

__all__ = ["ResidencyMachine"]

logger = logging.getLogger("torchferry")


class ResidencyMachine(NotCopyable):
    """A ferry's records and the reload steps that change them; :class:`~torchferry.Ferry` sets the records up
    in its constructor and is the public face over them."""

    _targets: Targets
    _set: StateSet
    _guards: OffloadGuards
    _offloaded: Offloaded | None
    _residency: Residency
    _last: TransferHandle | None  # the last TransferHandle
    _prefetch: PrefetchRun | None  # see [Note: prefetch reload]
    _state_bytes: int
    _recorder: StatsRecorder
    _released: tuple[object, torch.cuda.Event | None]  # (d2h handle, its release event)
    _closed: bool
    _mover: OneMover  # see [Note: one thread moves a ferry]
    _pin_ahead: PinAhead | None
    _watch: ResidentWatch

    _streams = property(lambda self: self._set.streams)
    _pool = property(lambda self: self._set.pool)

    @property
    def residency(self) -> Residency:
        """Where the state is now (a plain read: nothing is moved or waited for); an in-flight
        state reads as final once its copies are done (``TransferHandle.done()``)."""
        r = self._residency
        last = self._last
        run = self._prefetch
        if run is not None and run.finished:  # handed over at the next call that moves state
            r = Residency.H2D_IN_FLIGHT if self._streams.is_cuda else Residency.DEVICE
            last = run.handle()
        if r is Residency.D2H_IN_FLIGHT and last is not None and last.done():
            return Residency.HOST
        if r is Residency.H2D_IN_FLIGHT and last is not None and last.done():
            return Residency.DEVICE
        return r

    @property
    def device(self) -> torch.device:
        """The device the state lives on when resident."""
        return self._set.device

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("torchferry: this ferry is closed; make a new Ferry")

    def _handle_or_noop(self, direction: str) -> TransferHandle:
        if self._last is not None:
            return self._last
        return TransferHandle(direction, 0, None)  # type: ignore[arg-type]

    def _arm_watch(self, plan) -> None:  # see [Note: state dropped while resident] in watch.py
        if plan.has_grads:  # else no hook to install: spares a walk of every parameter per reload
            self._watch.arm(plan.modules, [r.tensor for r in plan.tensors])

    def _issued(self, handle: TransferHandle) -> TransferHandle:
        self._last = handle
        self._guards.pending = handle  # see [Note: state_dict() waits for the offload] in guards.py
        self._recorder.issued(handle)
        return handle

    def _own_offload_event(self) -> torch.cuda.Event | None:
        """This ferry's last offload event (only this ferry's, see ``StateSet.issue_reload``); after
        its release, the event recorded then ([Note: a reload takes the blocks its offload freed])."""
        latest = self._recorder.latest("d2h")
        handle, released = self._released
        if latest is handle and released is not None:
            return released
        return getattr(latest, "event", None)

    # ----------------------------------------------------------------- reload
    def _reload_all(self, off: Offloaded, schedule: ReleaseSchedule | None) -> TransferHandle:
        issued_at = time.perf_counter()
        rollback = Rollback(self, guards=off.plan)
        with transfer_range("h2d", off.plan.state_bytes):
            with rollback:  # see [Note: one rollback]
                move = self._set.reload(off, schedule, self._own_offload_event())
                if move is not None:
                    rollback.undo = move.undo
                    handle = self._issued(move.handle(issued_at))
                    self._guards.remove()
                    self._offloaded = None
                    self._set.arena = move.arena
                    self._residency = Residency.H2D_IN_FLIGHT if self._streams.is_cuda else Residency.DEVICE
            if move is None:  # replaced while offloaded: see [Note: state replaced while offloaded]
                return self._reconcile(off)
        self._arm_watch(off.plan)
        logger.debug("reload: %d bytes in %d storages to %s",
                     off.plan.state_bytes, len(off.plan.storages), self.device)
        return handle

    def _reconcile(self, off: Offloaded) -> TransferHandle:
        """Brings back what the targets still hold after a replacement; the state is then resident.
        All or nothing: ``reconcile`` undoes itself, and nothing after it can tear the state."""
        with Rollback(self, guards=off.plan):  # see [Note: one rollback]
            self._guards.remove()
            nbytes = self._set.reconcile(off, self._own_offload_event())
            self._offloaded = None
            self._residency = Residency.DEVICE
        handle = self._issued(TransferHandle("h2d", nbytes, None))
        self._set.forget()  # re-planned at the next offload (a forget cut short is redone there)
        # A submodule moved while offloaded (not a unit of its own: ``.to()`` below the root unit) left
        # FSDP2's buffers over the storages reconcile just brought back: FSDP2 would all-gather the bytes
        # of the offload until the next plan re-points them. Re-point them now, while resident, as the
        # next plan would ([Note: FSDP2's shard buffer left by a submodule's move]); a failure here leaves
        # the state resident and is redone by that plan.
        resync_sharded_data(off.plan.modules)
        return handle

    # --------------------------------------------------------------- prefetch
    def _start_prefetch(self, off: Offloaded, groups: list[Group], policy: Prefetch) -> TransferHandle:
        rollback = Rollback(self, guards=off.plan)
        with rollback:  # see [Note: one rollback]
            run = self._set.prefetch_run(off, groups, policy, self._own_offload_event())
            rollback.undo = run.abort
            self._guards.remove()
            self._prefetch = run
            self._residency = Residency.PREFETCHING
            run.begin()
            handle = run.handle()
            self._last = handle
        self._arm_watch(off.plan)
        return handle

    def _complete_prefetch(self) -> TransferHandle | None:
        """Completes a layer-wise reload under way, or hands over one that finished."""
        if self._prefetch is None:
            return None
        self._prefetch.finish()  # idempotent
        return self._end_prefetch()

    def _end_prefetch(self) -> TransferHandle:
        run = self._prefetch
        assert run is not None
        # everything that may raise first, then the records together: a failure leaves the run to a retry
        residency = Residency.H2D_IN_FLIGHT if self._streams.is_cuda else Residency.DEVICE
        handle = run.handle()
        self._prefetch, self._offloaded, self._residency = None, None, residency
        return self._issued(handle)
