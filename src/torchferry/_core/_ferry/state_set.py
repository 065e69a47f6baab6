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
tensors their parked device impls back. FSDP2's padded ``_sharded_param_data``
shares those storage objects, so it is valid again after reload. A storage that
a tensor the ferry does not know also views (a user's view or ``.detach()``) is
copied but not released, so that tensor stays readable ([Note: a storage shared
with a tensor the ferry does not know] in ``_state/holders.py``).
Tensor objects keep their Python identity and autograd metadata; their
addresses change, so CUDA graphs captured over them must be captured again
after a reload. ``torch.compile``d modules skip the forward guard (Dynamo does
not guard on hooks added after compilation): do not run them while offloaded.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from .._api.settings import CoreSettings
from .._host.budget import NodeLedger
from .._host.layout import HostLayout, HostViews
from .._host.pool import HostPool
from .._schedules.early import EarlyOffload
from .._schedules.prefetch import Group, Prefetch, PrefetchRun
from .._schedules.release import PROGRESS_EVERY, ReleaseSchedule
from .._schedules.unchanged import UnchangedStorages
from .._state.fsdp import comm_streams, repoint_sharded_data, resync_sharded_data
from .._state.holders import shared_storages
from .._state.parking import Parking
from .._state.plan import Plan, PlanCache, build_plan, fingerprint, refuse_unresizable, storage_bytes, to_allocate
from .._state.targets import Targets
from .._transfer.arena import ReloadArena
from .._transfer.copies import issue_d2h
from .._transfer.h2d import H2DIssued, issue_h2d
from .._transfer.gates import AllocGate, TailMark
from .._transfer.streams import TransferStreams, streams_for, wait_event
from .moves import OffloadIssued, OffloadMove, Offloaded, ReloadMove
from .reconcile import moved_away, reconcile

# See [Note: the reload's hash beside its copies]: the last copies a reload leaves to hide its
# baseline hash behind, as a fraction of its bytes (1/HASH_TAIL_DIV) and at least HASH_TAIL_MIN.
HASH_TAIL_DIV = 16
HASH_TAIL_MIN = 64 << 20


def _hash_tail_bytes(plan: Plan) -> int:
    return max(plan.state_bytes // HASH_TAIL_DIV, HASH_TAIL_MIN)

__all__ = ["StateSet"]

logger = logging.getLogger("torchferry")

_KEPT_NAMES = 8  # tensors named in the warning of a kept storage, at most


class StateSet:
    """A ferry's targets, device, streams, host pool and cached plan.

    Args:
        targets: the ferry's targets.
        device: the device, or ``None`` while no tensor tells it (an
            optimizer before its first step): decided at the first plan.
        max_pinned_bytes, host_budget_bytes, skip_unchanged: as for ``Ferry``.
        settings: the ferry's settings, handed to what acts on them (default: the core's defaults).
    """

    def __init__(self, targets: Targets, device: torch.device | None, *, max_pinned_bytes: int | None,
                 host_budget_bytes: int | None, skip_unchanged: bool = False,
                 settings: CoreSettings | None = None) -> None:
        self.settings = settings = settings if settings is not None else CoreSettings()
        self.targets = targets
        self.device_fixed = device is not None
        self._max_pinned_bytes = max_pinned_bytes
        self._host_budget_bytes = host_budget_bytes
        self._set_device(device if device is not None else torch.device("cpu"))
        self.cache: PlanCache | None = None
        self.parking: Parking | None = None
        self.unchanged = (UnchangedStorages(hash_choice=settings.hash, verify=settings.verify_skips) if skip_unchanged
                          else None)
        self.arena: ReloadArena | None = None  # see [Note: reload arena]
        self.early: EarlyOffload | None = None  # see [Note: offload during forward]
        self.warned_kept = False  # see _warn_kept(): once per ferry

    def _set_device(self, device: torch.device) -> None:
        self.device = device
        self.streams: TransferStreams = streams_for(device, self.settings.switch_bytes)
        cuda = device.type == "cuda"
        ledger = NodeLedger(folder=self.settings.ledger_dir, reserve=self.settings.host_reserve_bytes)
        self.pool = HostPool(pin=cuda, device=device.index if cuda else None, budget=self._host_budget_bytes,
                             ledger=ledger)
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
        if resync_sharded_data([t for t in targets if isinstance(t, torch.nn.Module)]):
            fp = fingerprint(targets)  # see [Note: FSDP2's shard buffer left by a submodule's move]
        plan = build_plan(targets, self.device if self.device_fixed else None)
        if not self.device_fixed and plan.tensors:
            self._set_device(plan.device)
            self.device_fixed = True
        cache = PlanCache(fp, plan, [storage_bytes(s, plan.device) for s in plan.storages])
        parking = Parking([r.tensor for r in plan.tensors], [r.name for r in plan.tensors])
        self._let_parking_go(carry=True)  # before the old plan's host views go
        self.host.forget()  # made for the old plan
        self._forget_unchanged(keep_carried=True)
        self.cache, self.parking = cache, parking  # together: see [Note: all or nothing]
        return plan

    def _cache_of(self, plan: Plan) -> PlanCache:
        """The cache entry of ``plan``, the plan just made or reused by :meth:`plan`."""
        cache = self.cache
        if cache is None or cache.plan is not plan:
            raise AssertionError("torchferry: internal error: the plan is not the cached one")
        return cache

    def reserve(self, background: bool) -> tuple[int, Future | None, bool]:
        """Plans the targets and allocates (and pins) the pool for them (``HostLayout.reserve``):
        the plan's state bytes, the future of a background pin (or ``None``), and whether the pool
        grew.

        Raises:
            As :meth:`HostLayout.reserve` (nothing allocated) and :func:`build_plan`.
        """
        before = self.pool.nbytes
        plan = self.plan()
        self._pool_for(plan)
        fut = self.host.reserve(plan, background=background)
        return plan.state_bytes, fut, self.pool.nbytes != before

    def device_views(self, plan: Plan) -> list[torch.Tensor] | None:
        """The cached plan's 1D uint8 device views (they follow ``resize_``), else ``None``."""
        return self.cache.device_views if self.cache is not None and self.cache.plan is plan else None

    def forget(self, carry: bool = False) -> None:
        """Drops the plan (and the device storages it holds), the parked objects and the host views;
        with ``carry``, the baseline of [Note: unchanged storages] stays for the next plan's offload
        ([Note: a baseline carried across a re-plan])."""
        self._let_parking_go(carry)
        self.cache = self.parking = None
        self.host.forget()
        self._forget_unchanged(keep_carried=carry)

    def _let_parking_go(self, carry: bool) -> None:
        """The plan and its parked objects are about to go: with ``carry`` its baseline stays for the next
        plan ([Note: a baseline carried across a re-plan]); its host twins (and what a caller kept of them)
        still view the pool and stay watched ([Note: host tensors of earlier plans], both in
        ``_schedules/unchanged.py``)."""
        if self.unchanged is None or self.cache is None or self.parking is None or not self.pool.ready():
            return
        if carry:
            self.unchanged.carry()
        self.unchanged.retire(self.cache.plan, self.parking.host_twins(), self.pool.block_id)

    def _pool_for(self, plan: Plan) -> None:
        """Before the pool may take a new block for ``plan``: a carried baseline's twins view the old one
        and would keep it mapped beside the new (and its slots are gone anyway)."""
        if self.unchanged is not None and not self.host.fits(plan):
            self.unchanged.drop_carried()
            self.unchanged.drop_retired()

    def forget_host(self) -> None:
        """Drops every view of the pool (host views and host twins) so that it can be unmapped."""
        self.host.forget()
        self._forget_unchanged()
        if self.unchanged is not None:
            self.unchanged.drop_retired()
        if self.parking is not None:
            self.parking.forget_host()

    # ------------------------------------------------------ unchanged storages
    def _forget_unchanged(self, keep_carried: bool = False) -> None:
        if self.unchanged is not None:
            self.unchanged.drop_rules(keep_carried)

    def forget_baseline(self) -> None:
        """Drops the baseline of [Note: unchanged storages] (a layer-wise reload starts a new one)."""
        if self.unchanged is not None:
            self.unchanged.forget()

    def _unchanged_now(self, plan: Plan, views: HostViews, early: EarlyOffload | None) -> set[int]:
        """Storages the offload may skip: their slots still hold their bytes (consumes the baseline)."""
        sources, parking = self.device_views(plan), self.parking
        if self.unchanged is None or sources is None or parking is None:
            return set()
        return self.unchanged.take(plan, views, sources, parking.host_versions(),
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
            kept = shared_storages(cache.plan)  # before anything moves
            unchanged = self._unchanged_now(cache.plan, hv, None)
            copies = issue_d2h(cache.plan, cache.device_views, hv, unchanged, self.streams)
            fp = fingerprint(targets)
            if fp == cache.fingerprint:
                self._warn_kept(cache.plan, kept)
                return OffloadIssued(cache.plan, hv, copies, [f[0] for f in fp], unchanged, kept)
            if copies.event is not None:
                copies.event.synchronize()  # the copies only wrote the pool; redo with a new plan
            # Hold nothing of the old plan's views: a growing pool must be able to
            # unmap the old block before it maps the new one (and the budget sees one).
            hv = cache = copies = None
            plan = self.plan(targets, fp)
        else:
            plan = self.plan()
        cache = self._cache_of(plan)
        kept = shared_storages(plan)  # before anything moves
        self._pool_for(plan)
        views = self.host.views(plan, cache=True)  # may raise (pool allocation): nothing moved yet
        early_copied = early.take(plan, views) if early is not None else set()  # during the forward
        unchanged = self._unchanged_now(plan, views, early)
        copies = issue_d2h(plan, cache.device_views, views, early_copied | unchanged, self.streams,
                           progress_every=progress_every)
        self._warn_kept(plan, kept)
        return OffloadIssued(plan, views, copies, [f[0] for f in cache.fingerprint], unchanged, kept)

    def _warn_kept(self, plan: Plan, kept: frozenset[int]) -> None:
        """Logs, once per ferry, the storages an offload keeps on the device ([Note: a storage
        shared with a tensor the ferry does not know])."""
        if not kept or self.warned_kept:
            return
        self.warned_kept = True
        names = [r.name for r in plan.tensors if r.storage_index in kept]
        more = f" and {len(names) - _KEPT_NAMES} more" if len(names) > _KEPT_NAMES else ""
        logger.warning(
            "torchferry: offload keeps %d bytes on %s: the storage of %s%s is shared with a tensor torchferry "
            "does not manage (a view, slice, .data, .detach() or state_dict() entry held elsewhere, or the base "
            "it was sliced from), which stays readable; drop that tensor (or pass it to Ferry(...) too) to free "
            "them at the next offload (logged once per ferry)",
            sum(plan.nbytes[si] for si in kept), plan.device, ", ".join(names[:_KEPT_NAMES]), more)

    def issue_reload(self, plan: Plan, views: HostViews, after: torch.cuda.Event | None,
                     gate: AllocGate | None = None, mark: TailMark | None = None) -> H2DIssued:
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
        return issue_h2d(plan, views, self.streams, device_views=self.device_views(plan), gate=gate, mark=mark)

    # ------------------------------------------------------------------ moves
    def _parking_of(self) -> Parking:
        if self.parking is None:
            raise AssertionError("torchferry: internal error: no parked tensors without a plan")
        return self.parking

    def drop_arena(self) -> None:
        """Gives the reload arena's fillers back (see [Note: reload arena])."""
        if self.arena is not None:
            self.arena.release()
            self.arena = None

    def disarm_early(self) -> EarlyOffload | None:
        """Disarms the offload during forward, if armed; returns it (its early copies count once)."""
        early, self.early = self.early, None
        if early is not None:
            early.disarm()
        return early

    def offload(self, schedule: ReleaseSchedule | None) -> OffloadMove:
        """Issues the D2H copies and points every tensor at its pool slot; the device storages are
        still allocated (:meth:`OffloadMove.finish` frees them, :meth:`OffloadMove.undo` reverts).

        The offload during forward, if armed, is disarmed and its early copies count.

        Args:
            schedule: a swap's release schedule (the storages go to it), or ``None``.

        Raises:
            As :meth:`issue_offload`; RuntimeError naming a tensor that could not be re-pointed
            (every tensor is back on the device; the copies only wrote the pool).
        """
        tracks = schedule is not None and schedule.tracks and self.streams.is_cuda
        issued = self.issue_offload(self.disarm_early(), PROGRESS_EVERY if tracks else None)
        parking = self._parking_of()
        move = OffloadMove(issued, self._cache_of(issued.plan).device_views, parking, self.streams,
                           schedule if tracks else None)
        parking.to_host(range(len(issued.plan.tensors)), issued.views.host_locals, key=issued.views)
        return move  # nothing after the re-pointing: the caller's try undoes it ([Note: all or nothing])

    def replaced(self, off: Offloaded) -> bool:
        """Whether the targets hold other tensors, or the set's tensors other bytes, than at the
        offload ([Note: state replaced while offloaded], [Note: storage swapped while offloaded])."""
        return self.targets.ids() != off.ids or bool(moved_away(off.views, self._parking_of()))

    def reload(self, off: Offloaded, schedule: ReleaseSchedule | None,
               after: torch.cuda.Event | None) -> ReloadMove | None:
        """Re-allocates every storage, issues the H2D copies (after the event ``after``, the ferry's
        own last offload), makes the current stream and FSDP2's comm streams wait for them, points
        the tensors back at their device impls and takes the baseline of [Note: unchanged
        storages]. ``None`` (nothing allocated) when :meth:`replaced`: reconcile instead.

        Args:
            off: what is offloaded.
            schedule: a swap's release schedule, asked before each allocation, or ``None``.
            after: see :meth:`issue_reload`.

        Raises:
            RuntimeError: out of device memory (naming the bytes; nothing allocated, the state is
                still offloaded), or a tensor could not be re-pointed (every step undone).
        """
        plan, cuda = off.plan, self.streams.is_cuda
        tracks = schedule is not None and schedule.tracks
        parking = self._parking_of()
        arena = (ReloadArena.seed(self.device, to_allocate(plan), self.settings, after) if cuda and not tracks
                 else None)
        move = ReloadMove(plan, parking, self.streams, arena, self.unchanged)
        hash_early = cuda and not tracks and self.unchanged is not None
        try:  # see [Note: all or nothing]
            move.copies = copies = self.issue_reload(
                plan, off.views, after, schedule.gate if schedule is not None and tracks else None,
                mark=TailMark(_hash_tail_bytes(plan), self._stage_rows(plan, off.views)) if hash_early else None)
            if self.replaced(off):  # checked while the copies are in flight
                move.undo()
                return None
            if move.arena is not None:  # every storage is allocated: the hash's temporaries go elsewhere
                move.arena.seal(plan.storages)
            early = self._hash_early(plan, off.views, copies) if hash_early else None
            if cuda:
                wait_event(self.streams.current(), copies.event)  # pyright: ignore[reportArgumentType]  # an event on a GPU
                for stream in comm_streams(plan.modules):  # also read by FSDP2's all-gathers
                    stream.wait_event(copies.event)  # pyright: ignore[reportArgumentType]  # an event on a GPU
            parking.to_device(range(len(plan.tensors)))
            move.repointed = True
            # See [Note: FSDP2's shard buffer after a move].
            repoint_sharded_data(plan.modules, parking.host_locals(range(len(plan.tensors))))
            self._take_baseline(plan, off.views, swapping=tracks, early=early)
            if cuda and self.unchanged is not None:  # see [Note: a handle orders the whole transfer]
                move.ready = self.streams.event()  # on the current stream, after the hash's kernels
        except BaseException as e:
            move.undo()
            if isinstance(e, torch.OutOfMemoryError):
                raise RuntimeError(
                    f"torchferry: reload needs {plan.state_bytes} bytes on {self.device} and ran out of "
                    "device memory (free memory, e.g. the rollout engine's KV cache, and call reload() "
                    "again); the state is still offloaded, nothing was lost"
                ) from e
            raise
        return move

    def _stage_rows(self, plan: Plan, views: HostViews):
        """What the reload uploads for the early hash at its mark (``issue_h2d``'s ``mark.rows``)."""
        if self.unchanged is None or self.device_views(plan) is None:
            return None
        return self.unchanged.stage_rows(plan, views)

    def _hash_early(self, plan: Plan, views: HostViews, copies: H2DIssued) -> list[int] | None:
        """Starts the baseline with the storages copied before ``copies.early``, on the current
        stream once that event passed ([Note: the reload's hash beside its copies]); the ones it
        hashed, or ``None`` (no early event: all are hashed after the last copy)."""
        sources = self.device_views(plan)
        if copies.early is None or self.unchanged is None or sources is None:
            return None
        event, storages, staged = copies.early
        wait_event(self.streams.current(), event)
        self.unchanged.copied_in(plan, views, sources, storages, fresh=True, staged=staged)
        return storages

    def _take_baseline(self, plan: Plan, views: HostViews, *, swapping: bool, early: list[int] | None = None) -> None:
        """The baseline of [Note: unchanged storages] after a plain reload (``early``: the storages
        :meth:`_hash_early` hashed already); none under a swap with a budget (the hash's
        temporaries would exceed it)."""
        if self.unchanged is None:
            return
        if swapping:
            self.unchanged.forget()
            return
        sources = self.device_views(plan)
        if sources is not None:
            self.unchanged.reloaded(plan, views, sources, self._parking_of().host_versions(), early)

    def reconcile(self, off: Offloaded, after: torch.cuda.Event | None) -> int:
        """Brings back what the targets still hold after a replacement (synchronously, all or
        nothing: :func:`reconcile`); returns the bytes moved. The caller then drops the plan
        (:meth:`forget`): the targets are planned again at the next offload."""
        return reconcile(off.plan, off.views, self._parking_of(), self.targets.live(), self.streams,
                         self.device_views(off.plan), after)

    def arm_early(self, run: PrefetchRun | None) -> None:
        """Arms an offload during forward (:meth:`EarlyOffload.arm_for`) over the resident plan, or
        over ``run``'s, a layer-wise reload under way (each unit is resident before its forward);
        nothing where it does not apply.

        Raises:
            RuntimeError, HostBudgetError: the pool could not be allocated (the hooks must not
                fail, so it is allocated now); nothing armed.
        """
        if run is not None:
            plan, views = run.plan, run.views
        else:
            plan = self.plan()
            self._pool_for(plan)
            views = self.host.views(plan, cache=True)
        if self.unchanged is not None:  # its copies write slots a carried baseline would trust
            self.unchanged.drop_carried()
        self.early = EarlyOffload.arm_for(plan, views, self.device_views(plan), self.streams, self.unchanged, run)

    def prefetch_run(self, off: Offloaded, groups: list[Group], policy: Prefetch,
                     after: torch.cuda.Event | None) -> PrefetchRun:
        """A layer-wise reload of ``off`` (not begun); the baseline of [Note: unchanged storages]
        is dropped, its groups take a new one as they are copied."""
        self.forget_baseline()
        return PrefetchRun(off.plan, off.views, self._parking_of(), self.device_views(off.plan), groups, policy,
                           self.streams, after, self.unchanged, settings=self.settings)
