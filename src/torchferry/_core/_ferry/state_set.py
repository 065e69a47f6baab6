"""The whole-set schedule: a ferry's targets planned, their pool laid out, all copies issued at once.

:class:`StateSet` owns what one ferry moves and where it goes: the targets,
the device and its streams, the host pool and its layout, the cached plan
(see [Note: cached plan]) and the parked tensor objects (see [Note: parked
TensorImpls]). It issues the whole-set D2H and H2D copies; residency, guards
and handles are the ``Ferry``'s, above it.

[Note: storage moves keep every tensor object]
The ferry moves ``UntypedStorage`` bytes, never tensor objects. On offload it
copies each device storage into its slot of the host pool (``_transfer/copies``), gives
every tensor it knows a CPU impl viewing that slot while parking the device
impl (``_state/parking``, [Note: parked TensorImpls]), and releases the device
storage with ``resize_(0)``: the storage *object* is kept. On reload it
``resize_``s the same storage objects, copies the bytes back and gives the
tensors their parked device impls back. Aliases the ferry does not know
(FSDP2's padded ``_sharded_param_data``, a user's views) share those storage
objects, so they are valid again after reload; while offloaded their storage
is empty and they must not be used (making a new view of them raises, but a
kernel reading them reads released memory: undefined, possibly a crash).
Tensor objects keep their Python identity and autograd metadata; their
addresses change, so CUDA graphs captured over them must be captured again
after a reload. ``torch.compile``d modules skip the forward guard (Dynamo does
not guard on hooks added after compilation): do not run them while offloaded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._transfer.copies import D2HIssued, H2DIssued, issue_d2h, issue_h2d
from .._schedules.early import EarlyOffload
from .._host.layout import HostLayout, HostViews
from .._state.plan import Plan, PlanCache, build_plan, fingerprint, refuse_unresizable, storage_bytes
from .._host.pool import HostPool
from .._state.parking import Parking
from .._transfer.streams import TransferStreams, streams_for
from .._state.targets import Targets
from .._schedules.unchanged import UnchangedStorages

__all__ = ["OffloadIssued", "Offloaded", "StateSet"]


class OffloadIssued(NamedTuple):
    """What :meth:`StateSet.issue_offload` did: the plan, its pool views, the copies, and the
    ``id`` of every target tensor at that time (see [Note: state replaced while offloaded])."""

    plan: Plan
    views: HostViews
    copies: D2HIssued
    ids: list[int]
    unchanged: set[int]  # skipped: their slots already hold their bytes ([Note: unchanged storages])

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


class StateSet:
    """A ferry's targets, device, streams, host pool and cached plan.

    Args:
        targets: the ferry's targets.
        device: the device, or ``None`` while no tensor tells it (an
            optimizer before its first step): decided at the first plan.
        max_pinned_bytes, host_budget_bytes, skip_unchanged: as for ``Ferry``.
    """

    def __init__(self, targets: Targets, device: torch.device | None, *, max_pinned_bytes: int | None,
                 host_budget_bytes: int | None, skip_unchanged: bool = False) -> None:
        self.targets = targets
        self.device_fixed = device is not None
        self._max_pinned_bytes = max_pinned_bytes
        self._host_budget_bytes = host_budget_bytes
        self._set_device(device if device is not None else torch.device("cpu"))
        self.cache: PlanCache | None = None
        self.parking: Parking | None = None
        self.unchanged = UnchangedStorages() if skip_unchanged else None

    def _set_device(self, device: torch.device) -> None:
        self.device = device
        self.streams: TransferStreams = streams_for(device)
        cuda = device.type == "cuda"
        self.pool = HostPool(pin=cuda, device=device.index if cuda else None, budget=self._host_budget_bytes)
        self.host = HostLayout(self.pool, self._max_pinned_bytes)

    # ------------------------------------------------------------------- plan
    def plan(self, targets: list[object] | None = None, fp: list | None = None) -> Plan:
        """The plan of the targets now (resharded): the cached one if its fingerprint still holds.

        Raises:
            As :func:`build_plan`.
        """
        if targets is None:
            targets = self.targets.resharded()
        if fp is None:
            fp = fingerprint(targets)
        if self.cache is not None and fp == self.cache.fingerprint:
            return self.cache.plan
        plan = build_plan(targets, self.device if self.device_fixed else None)
        if not self.device_fixed and plan.tensors:
            self._set_device(plan.device)
            self.device_fixed = True
        cache = PlanCache(fp, plan, [storage_bytes(s, plan.device) for s in plan.storages])
        parking = Parking([r.tensor for r in plan.tensors], [r.name for r in plan.tensors])
        self.host.forget()  # made for the old plan
        self._forget_unchanged()
        self.cache, self.parking = cache, parking  # together: see [Note: all or nothing]
        return plan

    def device_views(self, plan: Plan) -> list[torch.Tensor] | None:
        """The cached plan's 1D uint8 device views (they follow ``resize_``), else ``None``."""
        return self.cache.device_views if self.cache is not None and self.cache.plan is plan else None

    def forget(self) -> None:
        """Drops the plan (and the device storages it holds), the parked objects and the host views."""
        self.cache = self.parking = None
        self.host.forget()
        self._forget_unchanged()

    def forget_host(self) -> None:
        """Drops every view of the pool (host views and host twins) so that it can be unmapped."""
        self.host.forget()
        self._forget_unchanged()
        if self.parking is not None:
            self.parking.forget_host()

    # ------------------------------------------------------ unchanged storages
    def _forget_unchanged(self) -> None:
        if self.unchanged is not None:
            self.unchanged.drop_rules()

    def reloaded(self, plan: Plan, views: HostViews, *, swapping: bool = False) -> None:
        """Takes the baseline of [Note: unchanged storages] after a plain reload (the current stream
        waited for its copies, no kernel queued since). Nothing under a swap with a budget (the
        hash's temporaries would exceed it) or with ``skip_unchanged`` off."""
        if self.unchanged is None:
            return
        if swapping:
            self.unchanged.forget()
            return
        self.unchanged.copied_in(plan, views, self.device_views(plan))  # pyright: ignore[reportArgumentType]  # device_views(plan) is a list once the plan exists
        self.unchanged.resident(plan, views, self.parking.host_versions())

    def group_copied(self, plan: Plan, views: HostViews, group) -> None:
        """A layer-wise reload's group (``prefetch.Group``) was just copied in on the current stream."""
        if self.unchanged is not None:
            self.unchanged.copied_in(plan, views, self.device_views(plan), group.storages)  # pyright: ignore[reportArgumentType]  # device_views(plan) is a list once the plan exists

    def group_resident(self, plan: Plan, views: HostViews, group) -> None:
        """A layer-wise reload's group was made resident: its version counters are the baseline's."""
        if self.unchanged is not None:
            self.unchanged.resident(plan, views, self.parking.host_versions(group.tensors), group.tensors)

    def forget_baseline(self) -> None:
        """Drops the baseline of [Note: unchanged storages] (a layer-wise reload starts a new one)."""
        if self.unchanged is not None:
            self.unchanged.forget()

    def baseline(self) -> set[int] | frozenset[int]:
        """Storages holding a baseline hash now (live; empty with ``skip_unchanged`` off)."""
        return self.unchanged.baseline if self.unchanged is not None else frozenset()

    def _unchanged_now(self, plan: Plan, views: HostViews, early: EarlyOffload | None) -> set[int]:
        """Storages the offload may skip: their slots still hold their bytes (consumes the baseline)."""
        if self.unchanged is None:
            return set()
        return self.unchanged.take(plan, views, self.device_views(plan), self.parking.host_versions(),  # pyright: ignore[reportArgumentType]  # device_views(plan) is a list once the plan exists
                                   early.copied if early is not None else ())

    # ----------------------------------------------------------------- copies
    def issue_offload(self, early: EarlyOffload | None, progress_every: int | None) -> OffloadIssued:
        """Plans (or reuses the cached plan) and issues the D2H copies. Nothing is re-pointed yet.

        [Note: optimistic offload] Checking that the cached plan still holds
        costs about 1 us per tensor, on the critical path before the first
        copy (4096 small tensors: milliseconds against 20 ms of DMA). When the
        cached plan's storages all still have their sizes (so reading them is
        safe), its copies are issued first and the full check runs while they
        are in flight; if it fails, the copies are waited for (they only wrote
        the pool) and the offload starts over with a new plan.

        Args:
            early: an armed offload during forward (disarmed here), or ``None``.
            progress_every: D2H progress events every this many bytes (swap).

        Raises:
            RuntimeError, HostBudgetError: the pool could not be allocated;
                nothing was copied. As :func:`build_plan` if the targets changed.
        """
        cache = self.cache
        hv = self.host.current(cache.plan) if cache is not None else None
        if (hv is not None and early is None and progress_every is None
                and all(st.nbytes() == n for st, n in zip(cache.plan.storages, cache.plan.nbytes, strict=False))):
            targets = self.targets.resharded()
            same = self._unchanged_now(cache.plan, hv, None)
            copies = issue_d2h(cache.plan, cache.device_views, hv, same, self.streams)
            fp = fingerprint(targets)
            if fp == cache.fingerprint:
                return OffloadIssued(cache.plan, hv, copies, [f[0] for f in fp], same)
            if copies.event is not None:
                copies.event.synchronize()  # the copies only wrote the pool; redo with a new plan
            # Hold nothing of the old plan's views: a growing pool must be able to
            # unmap the old block before it maps the new one (and the budget sees one).
            hv = cache = copies = None
            plan = self.plan(targets, fp)
        else:
            plan = self.plan()
        fp = self.cache.fingerprint
        views = self.host.views(plan, cache=True)  # may raise (pool allocation): nothing moved yet
        skip = early.take(plan, views) if early is not None else set()  # copied during the forward
        same = self._unchanged_now(plan, views, early)
        copies = issue_d2h(plan, self.device_views(plan), views, skip | same, self.streams,  # pyright: ignore[reportArgumentType]  # device_views(plan) is a list once the plan exists
                           progress_every=progress_every)
        return OffloadIssued(plan, views, copies, [f[0] for f in fp], same)

    def issue_reload(self, plan: Plan, views: HostViews, after: torch.cuda.Event | None,
                     before_alloc=None) -> H2DIssued:
        """Re-allocates every storage and issues the H2D copies (after the event ``after``).

        ``after`` is the ferry's own last offload: the D2H stream is shared by
        every ferry of the device, and waiting for all of it serialised a
        swap's reload behind the other ferry's offload (measured on 2 H200s:
        1.78 s for a swap of 2 x 45.7 GB whose two directions took 0.85 and
        0.91 s of copy-engine time).

        Raises:
            torch.OutOfMemoryError: nothing stays allocated.
            RuntimeError: a storage is no longer resizable (:func:`refuse_unresizable`); nothing allocated.
        """
        refuse_unresizable(plan)  # see [Note: NumPy views mark storages not resizable]
        if self.streams.is_cuda and after is not None:
            self.streams.h2d.wait_event(after)  # the slots may still be filling
        return issue_h2d(plan, views, self.streams, device_views=self.device_views(plan), before_alloc=before_alloc)
