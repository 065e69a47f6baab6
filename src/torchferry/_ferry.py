"""The transfer engine: offload a state set to the host pool and reload it.

[Note: storage moves keep every tensor object]
The ferry moves ``UntypedStorage`` bytes, never tensor objects. On offload it
copies each device storage into its slot of the host pool, re-points every
tensor it knows at a view of that slot (same dtype, size, stride, offset), and
releases the device storage with ``resize_(0)``: the storage *object* is kept.
On reload it ``resize_``s the same storage objects, copies the bytes back and
re-points the tensors at them. Aliases the ferry does not know (FSDP2's padded
``_sharded_param_data``, a user's views) share those storage objects, so they
are valid again after reload; while offloaded their storage is empty and they
must not be used (making a new view of them raises, but a kernel reading them
reads released memory: undefined, possibly a crash). Tensor objects keep their
Python identity; their addresses change, so CUDA graphs captured over them
must be captured again after a reload. ``torch.compile``d modules skip the
forward guard (Dynamo does not guard on hooks added after compilation): do not
run them while offloaded.

[Note: release is safe against the in-flight copy]
The D2H copies read a storage on the D2H stream while the caller's stream
carries on. Before ``resize_(0)`` frees the block we ``record_stream`` it on the
D2H stream, so the caching allocator does not hand it to the caller's stream
until the copy has finished (otherwise a new allocation could overwrite bytes
not yet copied: silent corruption of the offloaded state).

[Note: reload allocates on the caller's stream]
Reload re-allocates each storage on the caller's (current) stream, the stream
that will use it, and the H2D stream first waits for everything already queued
there: the block may have been freed by pending current-stream work, and
writing it before that work ran would corrupt it. The current stream then
waits for the H2D event, so the next kernel sees complete data without a host
sync. Allocation and copies are interleaved per storage so the copy engine
starts while the host is still allocating.

[Note: offload during forward]
In a forward-only phase (log-probabilities) an FSDP unit's sharded state is
not touched again once its forward is done, so ``offload_during_forward()``
registers a forward hook per unit that queues the unit's D2H copies right
then (on the D2H stream, after the kernels queued so far), while later units
compute. ``offload()`` then copies only what is left (units not run, packed
small storages, anything written since its copy) before re-pointing and
releasing everything at once, so the all-or-nothing and release rules above
are unchanged. Writes after a unit's copy are caught by version counters,
and any optimizer step (a global step pre-hook) invalidates every early copy:
a DTensor's ``_foreach_`` updates bump no version counter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from concurrent.futures import Future
from collections.abc import Callable

import torch
from torch import nn

from ._device_alloc import ReloadArena
from ._guards import OffloadGuards
from ._handle import TransferHandle
from ._plan import Plan, build_plan, fingerprint, fsdp_modules
from ._prefetch import Group, Prefetch, forward_prefetch_units, fsdp_comm_streams, group_plan, lazy_init_done
from ._packing import PackChunk, layout, pack_to_host, unpack_from_host
from ._host_budget import budget_from_env
from ._pool import HostPool
from ._repoint import Repointer, view_on
from ._residency import Residency
from ._stats import TransferStats
from ._streams import streams_for

__all__ = ["Ferry"]

logger = logging.getLogger("torchferry")

_PROGRESS_CHUNK = 256 << 20  # bytes between D2H progress events when swap() tracks them


@contextlib.contextmanager
def _transfer_range(direction: str, nbytes: int):
    """Profiler ranges ``torchferry::d2h`` / ``torchferry::h2d``, and inside, one naming the bytes.

    ``record_function``'s ``args`` string does not reach Chrome/Perfetto
    traces (checked with torch 2.13), so the bytes go into a nested range's
    name: ``torchferry::d2h bytes=123``.
    """
    with torch.profiler.record_function(f"torchferry::{direction}"), \
            torch.profiler.record_function(f"torchferry::{direction} bytes={nbytes}"):
        yield


def _done_future(value: object) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _pin_boundary(offsets: list[int], nbytes: list[int], chunks: list[PackChunk], cap: int) -> int:
    """The largest pool prefix of at most ``cap`` bytes that ends where a copy ends.

    Copies (a large storage's slot, a packed chunk) never straddle the
    boundary: each lies wholly in pinned or wholly in pageable memory.
    """
    packed = {si for ch in chunks for si in ch.storages}
    ends = [o + n for si, (o, n) in enumerate(zip(offsets, nbytes)) if n and si not in packed]
    ends += [ch.pool_offset + ch.nbytes for ch in chunks]
    return max((e for e in ends if e <= cap), default=0)


def _storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """1D ``torch.uint8`` tensor over all of ``storage``'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Offloaded:
    """What a ferry holds while its state is on the host."""

    def __init__(self, plan: Plan, repointer: Repointer, device_locals: list[torch.Tensor],
                 slots: list[torch.Tensor], chunks: list[PackChunk], pool_chunks: list[torch.Tensor]) -> None:
        self.plan = plan
        self.repointer = repointer
        self.device_locals = device_locals  # the tensors' device data, to point back at
        self.slots = slots  # 1D uint8 pool views, one per storage
        self.chunks = chunks  # small storages, moved in batches (see _packing)
        self.pool_chunks = pool_chunks  # 1D uint8 pool views, one per chunk


class _HostViews:
    """The pool views of one plan and pool block, reused every cycle while both stay.

    Attributes:
        plan, block: the plan and pool block they were made for.
        slots: 1D uint8 pool views, one per storage.
        pool_chunks: 1D uint8 pool views, one per packed chunk.
        chunks: the packed chunks of the layout.
        packed: indices of the packed storages.
        host_locals: per ``plan.tensors`` entry, a view of its slot shaped like its local tensor.
    """

    def __init__(self, plan: Plan, block: int, slots: list[torch.Tensor], pool_chunks: list[torch.Tensor],
                 chunks: list[PackChunk], host_locals: list[torch.Tensor]) -> None:
        self.plan = plan  # held, so that no other plan can be mistaken for it
        self.block = block
        self.slots = slots
        self.pool_chunks = pool_chunks
        self.chunks = chunks
        self.packed = {si for ch in chunks for si in ch.storages}
        self.host_locals = host_locals


# Ferries with a layer-wise reload under way. While any is, every optimizer's
# step first completes them all: a step must not update parameters still on
# the host (an optimizer outside the ferry, a unit its forward skipped).
_prefetching_ferries: dict[int, Ferry] = {}
_global_step_hook: list = []


def _complete_all_prefetches(optimizer: object, args: object, kwargs: object) -> None:
    for ferry in list(_prefetching_ferries.values()):
        if ferry._prefetching is not None:
            ferry._finish_prefetch()


def _install_global_step_hook() -> None:
    if not _global_step_hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _global_step_hook.append(register_optimizer_step_pre_hook(_complete_all_prefetches))


def _remove_global_step_hook_if_idle() -> None:
    if not _prefetching_ferries and _global_step_hook:
        _global_step_hook.pop().remove()


class _EarlyOffload:
    """What a ferry holds while ``offload_during_forward`` is armed."""

    def __init__(self, plan: Plan, groups: list[Group], packed: set[int]) -> None:
        self.plan = plan
        self.groups = groups
        self.packed = packed  # packed storages: left to the final offload (one DMA per chunk)
        self.versions: dict[int, list[int]] = {}  # group index -> its tensors' versions at copy time
        self.hooks: list = []
        self.invalidated = False  # an optimizer stepped since: every early copy may be stale


_armed_ferries: dict[int, Ferry] = {}
_armed_step_hook: list = []


def _invalidate_early_copies(optimizer: object, args: object, kwargs: object) -> None:
    for ferry in list(_armed_ferries.values()):
        if ferry._early is not None:
            ferry._early.invalidated = True


def _tensor_versions(tensors: list[torch.Tensor]) -> list[int]:
    """Version counters (bumped by every in-place write) of tensors, DTensor local shards included.

    A DTensor's in-place ops bump the outer counter (zero_, mul_) or neither
    (the _foreach_ ops, which optimizers use): both are read, and optimizer
    steps are caught apart (step pre-hooks).
    """
    return [t._version + (t._local_tensor._version if hasattr(t, "_local_tensor") else 0) for t in tensors]


class _Prefetching:
    """What a ferry holds while a layer-wise reload is under way."""

    def __init__(self, off: _Offloaded, groups: list[Group], policy: Prefetch) -> None:
        self.off = off
        self.groups = groups
        self.policy = policy
        self.issued = 0  # groups issued, in order
        self.events: list[torch.cuda.Event | None] = []  # per issued group, on the H2D stream
        self.versions: list[list[int]] = []  # per issued group: its host tensors' versions at issue
        self.resident: set[int] = set()  # groups whose tensors point at the device again
        self.allocated: list[int] = []  # storage indices re-allocated so far
        self.hooks: list = []
        self.start: torch.cuda.Event | None = None
        self.arena: ReloadArena | None = None
        self.issued_at = 0.0
        self.comm_streams: list[torch.cuda.Stream] = []  # FSDP2's all-gather streams, see fsdp_comm_streams


class Ferry:
    """Moves a set of training state between its GPU and a pinned host pool.

    Args:
        *targets: ``nn.Module``s (parameters, buffers, ``.grad``s), optimizers
            (every tensor in ``optimizer.state``, ``step`` included, where it
            is on the device) and tensors. FSDP2 modules are resharded before
            each offload, so the sharded DTensor parameters are what moves.
            Modules and optimizers are held by weak reference.
        device: the device the state lives on; inferred if ``None``. With
            ``"cpu"`` (or when every tensor is on the CPU) the same moves run
            synchronously into an unpinned pool, so CPU tests exercise
            everything but DMA and pinning.
        max_pinned_bytes: pin at most this many bytes of the host pool (at a
            copy boundary); the rest stays pageable: slower copies (the CUDA
            driver stages them) and ``is_pinned()`` False for the tensors
            there, but it runs where pinning all of it would not fit.
            ``None``: pin the whole pool.
        host_budget_bytes: bytes that the host pools of all processes on this
            node may hold together (checked through a node-wide ledger before
            every pool allocation, see [Note: host budget]); default
            ``TORCHFERRY_HOST_BUDGET_BYTES``, else only the node's free memory.

    Raises:
        ValueError: no targets, tensors on several devices, or a negative or
            non-integer byte count.
        TypeError: a target that is not a module, optimizer or tensor.
        NotImplementedError: meta tensors, non-strided tensors, tensor
            subclasses other than DTensor, storages that cannot be resized.

    Example::

        ferry = torchferry.Ferry(model, optimizer)
        ferry.offload()            # D2H on its own stream; GPU memory released
        torch.cuda.empty_cache()   # return it to the driver (e.g. for rollout)
        ...
        ferry.reload()             # H2D; the current stream waits for it
        loss = model(batch).sum()  # no host sync needed

    The tensor objects keep their identity across cycles; their addresses
    change, so CUDA graphs captured over them must be re-captured after a
    reload (see [Note: storage moves keep every tensor object]).
    """

    def __init__(self, *targets: object, device: torch.device | str | None = None,
                 max_pinned_bytes: int | None = None, host_budget_bytes: int | None = None) -> None:
        for name, value in (("max_pinned_bytes", max_pinned_bytes), ("host_budget_bytes", host_budget_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"torchferry: {name} must be an int >= 0 (bytes) or None, got {value!r}")
        plan = build_plan(targets, device)  # validates every target now
        self._max_pinned_bytes = max_pinned_bytes
        self._host_budget_bytes = budget_from_env() if host_budget_bytes is None else host_budget_bytes
        self.device: torch.device = plan.device
        # With no tensor yet (an optimizer before its first step) and no device
        # given, the device is decided at the first offload, not guessed now.
        self._device_fixed = device is not None or bool(plan.tensors)
        self._targets: list[object] = [
            weakref.ref(t) if isinstance(t, (nn.Module, torch.optim.Optimizer)) else t for t in targets
        ]
        self._streams = streams_for(self.device)
        self._pool = self._new_pool()
        self._guards = OffloadGuards(lambda: repr(self))
        self._layout: tuple[tuple, list[int], int, list[PackChunk]] | None = None  # (signature, offsets, bytes, chunks)
        # The last plan, its fingerprint and 1D uint8 views over its device storages
        # (valid across cycles: the storage objects are kept), see [Note: cached plan].
        self._cached: tuple[list, Plan, list[torch.Tensor]] | None = None
        self._host_cache: _HostViews | None = None  # host views of the cached plan
        self._offloaded: _Offloaded | None = None
        self._state = Residency.DEVICE
        self._last: TransferHandle | None = None
        self._arena: ReloadArena | None = None  # see [Note: reload arena]
        self._prefetching: _Prefetching | None = None  # see [Note: prefetch reload]
        self._early: _EarlyOffload | None = None  # see [Note: offload during forward]
        # Used by swap(): D2H progress events of the last offload, (bytes copied, event),
        # and a callback before each reload allocation with the bytes allocated so far.
        self._track_progress = False
        self._progress: list[tuple[int, torch.cuda.Event]] = []
        self._before_alloc: Callable[[int], None] | None = None
        self._pending_release: list[tuple[int, torch.UntypedStorage, torch.Tensor]] = []  # (bytes copied after it, ...)
        self._state_bytes = plan.state_bytes
        self._stats = TransferStats()
        self._latest: dict[str, TransferHandle] = {}  # the last handle of each direction
        self._closed = False

    # ------------------------------------------------------------------ state
    @property
    def residency(self) -> Residency:
        """Where the state is now; in-flight states turn final once their copies are done."""
        if self._state in (Residency.D2H_IN_FLIGHT, Residency.H2D_IN_FLIGHT):
            assert self._last is not None
            if self._last.done():
                self._state = Residency.HOST if self._state is Residency.D2H_IN_FLIGHT else Residency.DEVICE
        return self._state

    @property
    def stats(self) -> TransferStats:
        """Last and cumulative transfer figures (see :class:`TransferStats`)."""
        return self._stats

    def _issued(self, direction: str, nbytes: int) -> None:
        kind = "offload" if direction == "d2h" else "reload"
        st = self._stats
        self._stats = dataclasses.replace(
            st,
            **{f"{kind}s": getattr(st, f"{kind}s") + 1,
               f"bytes_{kind}ed": getattr(st, f"bytes_{kind}ed") + nbytes,
               f"last_{kind}_bytes": nbytes, f"last_{kind}_s": None},
        )

    def _completed(self, handle: TransferHandle) -> None:
        kind = "offload" if handle.direction == "d2h" else "reload"
        seconds = handle.seconds or 0.0
        st = self._stats
        changes = {f"{kind}_seconds": getattr(st, f"{kind}_seconds") + seconds}
        if handle is self._latest.get(handle.direction):
            changes[f"last_{kind}_s"] = seconds
        self._stats = dataclasses.replace(st, **changes)
        logger.debug("%s done: %d bytes in %.6f s (%.2f GB/s) on %s", kind, handle.nbytes, seconds,
                     handle.nbytes / seconds / 1e9 if seconds else float("nan"), self.device)

    @property
    def state_bytes(self) -> int:
        """Bytes of the unique storages in the last plan (what one transfer moves)."""
        return self._state_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds (pinned when the device is a GPU)."""
        return self._pool.nbytes

    @property
    def pinned(self) -> bool:
        """Whether the whole host pool is page-locked (GPU ferries once allocated, unless
        ``max_pinned_bytes`` kept part of it pageable)."""
        return self._pool.pin and self._pool.nbytes > 0 and self._pool.pinned_bytes == self._pool.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the host pool that are page-locked (registered with CUDA)."""
        return self._pool.pinned_bytes if self._pool.pin else 0

    def _new_pool(self) -> HostPool:
        cuda = self.device.type == "cuda"
        return HostPool(pin=cuda, device=self.device.index if cuda else None, budget=self._host_budget_bytes)

    def __repr__(self) -> str:
        return (
            f"Ferry(device={self.device}, residency={self._state.name}, "
            f"state_bytes={self._state_bytes}, host_bytes={self.host_bytes})"
        )

    def _live_targets(self) -> list[object]:
        out = []
        for t in self._targets:
            if isinstance(t, weakref.ref):
                obj = t()
                if obj is None:
                    raise RuntimeError("torchferry: a module or optimizer target of this ferry was garbage collected")
                out.append(obj)
            else:
                out.append(t)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("torchferry: this ferry is closed; make a new Ferry")

    def _done_handle(self, direction: str) -> TransferHandle:
        return self._last if self._last is not None else TransferHandle(direction, 0, None)  # type: ignore[arg-type]

    # ------------------------------------------------------------------- pool
    @torch.no_grad()
    def reserve_host(self, *, background: bool = False) -> float | Future:
        """Plans the state now and allocates (and pins) the host pool for it.

        Optional: ``offload()`` does this on first use. Calling it ahead, e.g.
        at setup, keeps the one-time cost of pinning out of the first offload.
        With ``background=True`` the pages are touched and pinned in a
        background thread while training goes on; an ``offload()`` that comes
        first waits for it (and is then correct, only later). The node's host
        budget is checked here, before anything is allocated (see
        [Note: host budget]).

        Args:
            background: return at once and pin in a background thread.

        Returns:
            Host seconds spent allocating, touching and pinning (0.0 when the
            pool already fits the state); with ``background``, a
            ``concurrent.futures.Future`` of those seconds.

        Raises:
            HostBudgetError: (a ``RuntimeError``) the node's budget or free
                memory cannot hold the pool; nothing was allocated.
            RuntimeError: host memory could not be allocated or pinned (with
                ``background``, raised by the future and by the next offload).
        """
        self._check_open()
        if self._prefetching is not None:
            self._finish_prefetch()
        if self.residency.on_host:
            return _done_future(0.0) if background else 0.0
        before = self._pool.nbytes
        plan = self._plan_now()
        _, _, fut = self._slot_offsets(plan, background=background)
        self._state_bytes = plan.state_bytes
        if background:
            return fut if fut is not None else _done_future(0.0)
        return self._pool.pin_seconds if self._pool.nbytes != before else 0.0

    @torch.no_grad()
    def offload_during_forward(self) -> None:
        """Arms an offload in pieces: each FSDP unit's state starts its D2H copy as soon as its
        forward in the next forward pass is done; the next ``offload()`` then only copies the
        rest and releases everything (see [Note: offload during forward]).

        For forward-only phases (log-probabilities of the actor or the reference
        model): by the end of the forward most of the state is already on the
        host and ``offload()`` returns sooner. Can be armed right after
        ``reload(prefetch=...)``: both overlap the same forward. The state stays resident and
        usable until ``offload()``; a unit whose tensors are written after its
        copy by in-place ops or any optimizer step is copied again by
        ``offload()``. Writes the version counters do not see are lost: through
        ``.data`` (``w.data.copy_(...)``) or by ``_foreach_`` ops on DTensors
        outside an optimizer step (an EMA update): do not write the state
        between the forward and ``offload()``. State holding gradients, and a
        model without FSDP2 units (or before FSDP2's lazy init), is not armed:
        ``offload()`` is then plain.

        Raises:
            RuntimeError: the ferry is closed; or the host pool could not be
                allocated (nothing moved).
            HostBudgetError: the node's host budget cannot hold the pool.
        """
        self._check_open()
        self._disarm_early()
        if self._prefetching is not None:
            # Armed during a layer-wise reload: each unit is resident before its
            # forward, and the plan is the one the reload brings back.
            plan = self._prefetching.off.plan
        elif self.residency.on_host:
            return
        else:
            plan = self._plan_now()
        if any(r.name.endswith(".grad") for r in plan.tensors):
            return  # gradients are written by _foreach_ ops (clipping) that no version counter sees
        views = self._host_views(plan)  # the pool, now: the hooks must not fail
        groups = [g for g in (group_plan(plan) if lazy_init_done(plan) else []) if g.unit is not None]
        if not groups:
            return
        early = self._early = _EarlyOffload(plan, groups, views.packed)
        for gi, g in enumerate(groups):
            early.hooks.append(g.unit.register_forward_hook(self._early_hook(gi)))
        _armed_ferries[id(self)] = self
        if not _armed_step_hook:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _armed_step_hook.append(register_optimizer_step_pre_hook(_invalidate_early_copies))

    def _early_hook(self, gi: int):
        def hook(module: nn.Module, args: object, output: object) -> None:
            early = self._early
            if early is None or gi in early.versions or early.invalidated:
                return
            plan, views, sources = early.plan, self._host_cache, self._sources(early.plan)
            if views is None or views.plan is not plan:
                return  # the pool changed since arming: offload() copies everything
            g = early.groups[gi]
            early.versions[gi] = _tensor_versions([plan.tensors[i].tensor for i in g.tensors])
            with _transfer_range("d2h", g.nbytes):
                if self._streams.is_cuda:
                    d2h = self._streams.d2h
                    d2h.wait_stream(self._streams.current())  # after the unit's kernels
                    with torch.cuda.stream(d2h):
                        for si in g.storages:
                            if plan.nbytes[si] and si not in early.packed:
                                views.slots[si].copy_(sources[si], non_blocking=True)
                else:
                    for si in g.storages:
                        if plan.nbytes[si] and si not in early.packed:
                            views.slots[si].copy_(sources[si])

        return hook

    def _disarm_early(self) -> _EarlyOffload | None:
        early, self._early = self._early, None
        if early is not None:
            for h in early.hooks:
                h.remove()
            _armed_ferries.pop(id(self), None)
            if not _armed_ferries and _armed_step_hook:
                _armed_step_hook.pop().remove()
        return early

    def _take_early_copies(self, plan: Plan) -> set[int]:
        """Storage indices whose early D2H copies still hold their current bytes (disarms)."""
        early = self._disarm_early()
        if early is None or early.plan is not plan or early.invalidated:
            return set()
        valid: set[int] = set()
        for gi, versions in early.versions.items():
            g = early.groups[gi]
            if _tensor_versions([plan.tensors[i].tensor for i in g.tensors]) == versions:
                valid.update(si for si in g.storages if si not in early.packed)
        return valid

    def release_host(self) -> None:
        """Returns the host pool to the OS now, keeping the ferry usable.

        For a ferry whose state stays resident for a while (a model no longer
        colocated, a phase without offloads): its pinned memory goes back to
        the node (and to the node's host budget). The next ``offload()`` (or
        ``reserve_host()``) allocates and pins a pool again.

        Raises:
            RuntimeError: the state is offloaded (the pool holds it): call
                ``reload()`` first; or the ferry is closed.
        """
        self._check_open()
        self._drop_pool("release_host()")

    def _drop_pool(self, what: str) -> None:
        """Returns the pool to the OS; the state must be (or become) resident."""
        if self._prefetching is not None:
            self._finish_prefetch()
        if self.residency.on_host:
            raise RuntimeError(f"torchferry: {what} while the state is offloaded would lose it; call reload() first")
        if self._last is not None:
            self._last.wait()  # the pool may still be read by an H2D copy
        self._disarm_early()
        self._host_cache = None  # its views would keep the block mapped
        self._pool.release()

    # ---------------------------------------------------------------- offload
    @torch.no_grad()
    def offload(self) -> TransferHandle:
        """Copies the state to the host pool and releases its device memory.

        The copies run on the D2H stream after the current stream's pending
        work. When this returns, the known tensors are CPU tensors viewing the
        pinned pool (``device.type == "cpu"``, ``is_pinned()``), and the device
        storages are empty (their blocks go back to the caching allocator once
        the copies finish; ``torch.cuda.empty_cache()`` returns them to the
        driver). Read the tensors on the host only after ``handle.wait()``.
        A no-op (returning the last handle) when already offloaded.

        Returns:
            A :class:`TransferHandle` for the D2H copies.

        Raises:
            RuntimeError: host memory for the pool could not be allocated or
                pinned, a tensor cannot be re-pointed, or the ferry is closed.
                The state is then left on the device, unchanged.
            ValueError, TypeError, NotImplementedError: as for the constructor,
                if the targets changed since.
        """
        self._check_open()
        if self.residency.on_host:
            return self._done_handle("d2h")
        if self._prefetching is not None:
            self._finish_prefetch()
        cuda = self._streams.is_cuda
        issued_at = time.perf_counter()
        with _transfer_range("d2h", self._state_bytes):
            plan, views, event, start, copied_after = self._plan_and_issue_d2h()
            slots = views.slots
            sources = self._sources(plan)
            nbytes = plan.state_bytes
            d2h = self._streams.d2h if cuda else None
            repointer = Repointer([r.tensor for r in plan.tensors], [r.name for r in plan.tensors])
            host_locals = views.host_locals
            if not host_locals and plan.tensors:
                host_locals = [view_on(r.local, slots[r.storage_index]) for r in plan.tensors]
                if views is self._host_cache:
                    views.host_locals = host_locals
            try:
                self._guards.install(plan.modules, plan.optimizers)
                device_locals = repointer.apply(host_locals)  # all or nothing
            except BaseException:
                self._guards.remove()
                raise
            self._offloaded = _Offloaded(plan, repointer, device_locals, slots, views.chunks, views.pool_chunks)
            self._state = Residency.D2H_IN_FLIGHT if cuda else Residency.HOST
            self._issued("d2h", nbytes)
            handle = self._last = self._latest["d2h"] = TransferHandle("d2h", nbytes, event, issued_at,
                                                                        start_event=start)
            handle.add_done_callback(self._completed)
            # See [Note: release is safe against the in-flight copy].
            self._pending_release = []
            for si, (src, storage) in enumerate(zip(sources, plan.storages)):
                if cuda and src.numel():
                    if self._track_progress:  # swap(): released by _release_copied, see [Note: swap budget]
                        self._pending_release.append((copied_after[si], storage, src))
                        continue
                    src.record_stream(d2h)
                storage.resize_(0)
            if self._arena is not None:
                self._arena.release()
                self._arena = None
        self._state_bytes = nbytes
        logger.debug("offload: %d bytes in %d storages from %s", nbytes, len(plan.storages), self.device)
        return handle

    def _plan_and_issue_d2h(self):
        """Plans (or reuses the cached plan) and issues the D2H copies. Nothing is re-pointed yet.

        [Note: optimistic offload] Checking that the cached plan still holds
        costs about 1 us per tensor, on the critical path before the first
        copy (4096 small tensors: milliseconds against 20 ms of DMA). When the
        cached plan's storages all still have their sizes (so reading them is
        safe), its copies are issued first and the full check runs while they
        are in flight; if it fails, the copies are waited for (they only wrote
        the pool) and the offload starts over with a new plan.

        Returns:
            ``(plan, views, event, start, copied_after)``.
        """
        cached = self._cached
        hv = self._host_cache
        if (cached is not None and self._early is None and not self._track_progress
                and hv is not None and hv.plan is cached[1] and hv.block == self._pool.block_id
                and all(st.nbytes() == n for st, n in zip(cached[1].storages, cached[1].nbytes))):
            targets = self._resharded_targets()
            plan, views = cached[1], self._host_cache
            event, start, copied_after = self._issue_d2h(plan, views, set())
            fp = fingerprint(targets)
            if fp == cached[0]:
                return plan, views, event, start, copied_after
            if event is not None:
                event.synchronize()  # the copies only wrote the pool; redo with a new plan
            # Hold nothing of the old plan's views: a growing pool must be able to
            # unmap the old block before it maps the new one (and the budget sees one).
            plan = views = hv = cached = None
            plan = self._plan_now(targets, fp)
        else:
            plan = self._plan_now()
        views = self._host_views(plan)  # may raise (pool allocation): nothing moved yet
        early = self._take_early_copies(plan)  # storages already copied during the forward
        event, start, copied_after = self._issue_d2h(plan, views, early)
        return plan, views, event, start, copied_after

    def _issue_d2h(self, plan: Plan, views: _HostViews, early: set[int]):
        """Queues the D2H copies of ``plan`` into ``views`` (skipping ``early``); returns
        ``(final event, start event, bytes copied after each storage or None)``."""
        slots, chunks, pool_chunks, packed = views.slots, views.chunks, views.pool_chunks, views.packed
        sources = self._sources(plan)
        large = [si for si, src in enumerate(sources) if src.numel() and si not in packed and si not in early]
        if not self._streams.is_cuda:
            for si in large:
                slots[si].copy_(sources[si])
            pack_to_host(chunks, sources, pool_chunks, self.device)
            return None, None, None
        d2h = self._streams.d2h
        d2h.wait_stream(self._streams.current())  # copy what pending kernels write
        start = self._streams.event(d2h, timing=True)
        self._progress, copied, mark = [], 0, 0
        copied_after = [0] * len(sources) if self._track_progress else None  # bytes, per storage
        with torch.cuda.stream(d2h):
            for si in large:
                slots[si].copy_(sources[si], non_blocking=True)
                copied += plan.nbytes[si]
                if copied_after is not None:
                    copied_after[si] = copied
                    if copied - mark >= _PROGRESS_CHUNK:
                        self._progress.append((copied, self._streams.event(d2h)))
                        mark = copied
            pack_to_host(chunks, sources, pool_chunks, self.device, self._streams)
        copied += sum(ch.nbytes for ch in chunks)
        if copied_after is not None:
            for ch in chunks:  # the packed ones are complete at the final event only
                for si in ch.storages:
                    copied_after[si] = copied
        event = self._streams.event(d2h, timing=True)
        if self._track_progress:
            self._progress.append((copied, event))
        return event, start, copied_after

    def _wait_own_offload(self, stream: torch.cuda.Stream) -> None:
        """Makes ``stream`` wait for this ferry's last offload copies (its slots' bytes).

        Only this ferry's: the D2H stream is shared by every ferry of the
        device, and waiting for all of it serialised a swap's reload behind the
        other ferry's offload (measured on 2 H200s: 1.78 s for a swap of 2 x 45.7
        GB whose two directions took 0.85 and 0.91 s of copy-engine time).
        """
        last = self._latest.get("d2h")
        if last is not None and last._event is not None:
            stream.wait_event(last._event)

    def _release_copied(self, copied: int | None) -> None:
        """Releases the storages a tracked offload kept (see [Note: swap budget]).

        Args:
            copied: D2H bytes known to be complete (an event was synchronized):
                storages copied within them are released at once. ``None``:
                release all that are left, safely against their in-flight copies.
        """
        keep = []
        for after, storage, src in self._pending_release:
            if copied is not None and after > copied:
                keep.append((after, storage, src))
                continue
            if copied is None:
                src.record_stream(self._streams.d2h)
            storage.resize_(0)
        self._pending_release = keep

    def _resharded_targets(self) -> list[object]:
        """The live targets, their FSDP units resharded (the sharded parameters registered)."""
        targets = self._live_targets()
        for m in targets:
            if isinstance(m, nn.Module):
                for unit in fsdp_modules(m):
                    unit.reshard()  # register the sharded parameters, free unsharded ones
        return targets

    def _plan_now(self, targets: list[object] | None = None, fp: list | None = None) -> Plan:
        """The plan of the targets now: the cached one if its fingerprint still holds.

        ``targets`` (resharded) and their fingerprint ``fp`` may be passed when
        the caller has them already.
        """
        if targets is None:
            targets = self._resharded_targets()
        # [Note: cached plan] Planning checks every tensor (10-40 us each); a
        # fingerprint of the tensors, storages, sizes and addresses (about 1 us
        # each) tells whether the last plan still holds, which it does every
        # steady cycle. 4096 small tensors cost 100-230 ms to plan on a CI host.
        if fp is None:
            fp = fingerprint(targets)
        if self._cached is not None and fp == self._cached[0]:
            return self._cached[1]
        plan = build_plan(targets, self.device if self._device_fixed else None)
        if not self._device_fixed and plan.tensors:
            self.device = plan.device
            self._streams = streams_for(self.device)
            self._pool = self._new_pool()
            self._device_fixed = True
        self._cached = (fp, plan, [_storage_bytes(s, self.device) for s in plan.storages])
        self._host_cache = None  # made for the old plan
        return plan

    def _sources(self, plan: Plan) -> list[torch.Tensor]:
        """1D uint8 device views over ``plan``'s storages (cached with the plan).

        A view made while a storage is released is empty: call this with the
        storages allocated, or use the cached views (they follow ``resize_``).
        """
        if self._cached is not None and self._cached[1] is plan:
            return self._cached[2]
        return [_storage_bytes(s, self.device) for s in plan.storages]

    def _device_view(self, plan: Plan, si: int) -> torch.Tensor:
        """1D uint8 view over ``plan.storages[si]``, which must be allocated."""
        if self._cached is not None and self._cached[1] is plan:
            return self._cached[2][si]
        return _storage_bytes(plan.storages[si], self.device)

    def _host_views(self, plan: Plan) -> _HostViews:
        """Pool views for ``plan`` (reserving the pool), cached for the cached plan.

        Raises:
            RuntimeError: host memory for the pool could not be allocated or pinned.
        """
        offsets, chunks, _ = self._slot_offsets(plan)
        block = self._pool.block_id
        cached = self._cached is not None and self._cached[1] is plan
        hv = self._host_cache
        if cached and hv is not None and hv.plan is plan and hv.block == block:
            return hv
        self._host_cache = None
        slots = [self._pool.view(o, n) for o, n in zip(offsets, plan.nbytes, strict=True)]
        pool_chunks = [self._pool.view(ch.pool_offset, ch.nbytes) for ch in chunks]
        hv = _HostViews(plan, block, slots, pool_chunks, chunks, [])
        self._host_cache = hv if cached else None
        return hv

    def _slot_offsets(self, plan: Plan, *, background: bool = False) -> tuple[list[int], list[PackChunk], object]:
        """The plan's pool layout; reserves the pool. Returns ``(offsets, chunks, future)``."""
        sig = plan.signature()
        if self._layout is not None and self._layout[0] == sig:
            offsets, total, chunks = self._layout[1], self._layout[2], self._layout[3]
        else:
            offsets, total, chunks = layout(plan.nbytes)
            self._layout = (sig, offsets, total, chunks)
        pin_bytes = None
        if self._max_pinned_bytes is not None:
            pin_bytes = _pin_boundary(offsets, plan.nbytes, chunks, self._max_pinned_bytes)
        if total > self._pool.nbytes:
            self._host_cache = None  # its views would keep the old block mapped
        # A no-op when it fits; also after a failed growth.
        fut = self._pool.reserve(total, pin_bytes=pin_bytes, background=background)
        return offsets, chunks, fut

    # ----------------------------------------------------------------- reload
    @torch.no_grad()
    def reload(self, prefetch: bool | Prefetch = False) -> TransferHandle:
        """Re-allocates the device storages and copies the state back.

        With ``prefetch`` (``True`` or a :class:`Prefetch`), an FSDP2 model's
        state comes back unit by unit in forward order and each unit's forward
        waits only for its own copies (see [Note: prefetch reload]); the
        returned handle covers the copies issued by this call. Without FSDP
        units (or before FSDP2's lazy init) it is a plain reload.

        The copies run on the H2D stream; the current stream is made to wait
        for them, so kernels queued after this call see the data without a
        host sync (use ``handle.wait_stream(s)`` for another stream ``s``).
        The known tensors are device tensors again when this returns. A no-op
        (returning the last handle) when already resident.

        Returns:
            A :class:`TransferHandle` for the H2D copies.

        Raises:
            RuntimeError: the device ran out of memory (the message names the
                bytes needed; the state stays on the host, nothing is lost), or
                a tensor cannot be re-pointed, or the ferry is closed.
        """
        self._check_open()
        if self._prefetching is not None:
            if prefetch:
                return self._done_handle("h2d")
            return self._finish_prefetch()
        if not self.residency.on_host:
            return self._done_handle("h2d")
        off = self._offloaded
        assert off is not None
        plan = off.plan
        # Gradients in the state: a zero_grad(set_to_none=False) before the forward
        # would write their host copies with _foreach_zero_, which DTensors do not
        # count in their version counters. Reload those plainly.
        if prefetch and not any(r.name.endswith(".grad") for r in plan.tensors):
            groups = group_plan(plan) if lazy_init_done(plan) else []
            if len(groups) > 1 or (groups and plan.optimizers):
                policy = prefetch if isinstance(prefetch, Prefetch) else Prefetch()
                return self._start_prefetch(off, groups, policy)
        cuda = self._streams.is_cuda
        issued_at = time.perf_counter()
        with _transfer_range("h2d", plan.state_bytes):
            event = start = None
            allocated_idx: list[int] = []  # storages re-allocated so far, to undo on failure
            try:
                if cuda:
                    # See [Note: reload allocates on the caller's stream].
                    h2d = self._streams.h2d
                    h2d.wait_stream(self._streams.current())
                    self._wait_own_offload(h2d)  # the slots may still be filling
                    arena = None if self._before_alloc else ReloadArena.seed(self.device, plan.nbytes)
                    start = self._streams.event(h2d, timing=True)
                allocated = 0
                packed = {si for ch in off.chunks for si in ch.storages}

                def alloc(si: int) -> torch.Tensor | None:
                    nonlocal allocated
                    n = plan.nbytes[si]
                    allocated += n
                    if self._before_alloc is not None:
                        self._before_alloc(allocated)
                    plan.storages[si].resize_(n)
                    allocated_idx.append(si)
                    return self._device_view(plan, si) if n else None

                # Large storages first, each copied as soon as it is allocated; then the
                # packed chunks, each allocated while its DMA is in flight.
                for si in range(len(plan.storages)):
                    if si in packed:
                        continue
                    dst = alloc(si)
                    if dst is None:
                        continue
                    if cuda:
                        with torch.cuda.stream(h2d):
                            dst.copy_(off.slots[si], non_blocking=True)
                    else:
                        dst.copy_(off.slots[si])
                if self._before_alloc is None and self._cached is not None and self._cached[1] is plan:
                    storages, sizes, views = plan.storages, plan.nbytes, self._cached[2]

                    def alloc_chunk(ch: PackChunk) -> list[torch.Tensor]:
                        # Thousands of small storages: one tight loop (see [Note: packing pipeline]).
                        allocated_idx.extend(ch.storages)  # freeing one not yet allocated is harmless
                        for si in ch.storages:
                            storages[si].resize_(sizes[si])
                        return [views[si] for si in ch.storages]
                else:
                    def alloc_chunk(ch: PackChunk) -> list[torch.Tensor]:
                        return [alloc(si) for si in ch.storages]

                unpack_from_host(off.chunks, off.pool_chunks, alloc_chunk, self.device, self._streams)
            except BaseException as e:
                self._undo_partial_reload(plan, allocated_idx)
                if isinstance(e, torch.OutOfMemoryError):
                    raise RuntimeError(
                        f"torchferry: reload needs {plan.state_bytes} bytes on {self.device} "
                        f"and ran out of device memory after {sum(plan.nbytes[i] for i in allocated_idx)} "
                        "bytes (free memory, e.g. the rollout engine's KV cache, and call reload() "
                        "again); the state is still offloaded, nothing was lost"
                    ) from e
                raise
            if cuda:
                event = self._streams.event(h2d, timing=True)
                self._streams.current().wait_event(event)
                for stream in fsdp_comm_streams(plan):  # also read by FSDP2's all-gathers
                    stream.wait_event(event)
                if arena is not None:
                    arena.seal()
                    self._arena = arena
            try:
                off.repointer.apply(off.device_locals)
            except BaseException:
                self._undo_partial_reload(plan, range(len(plan.storages)))
                raise
        self._offloaded = None
        self._guards.remove()
        self._state = Residency.H2D_IN_FLIGHT if cuda else Residency.DEVICE
        self._issued("h2d", plan.state_bytes)
        handle = self._last = self._latest["h2d"] = TransferHandle("h2d", plan.state_bytes, event, issued_at,
                                                                    start_event=start)
        handle.add_done_callback(self._completed)
        logger.debug("reload: %d bytes in %d storages to %s", plan.state_bytes, len(plan.storages), self.device)
        return handle

    # --------------------------------------------------------------- prefetch
    def _start_prefetch(self, off: _Offloaded, groups: list[Group], policy: Prefetch) -> TransferHandle:
        pf = _Prefetching(off, groups, policy)
        cuda = self._streams.is_cuda
        issued_at = time.perf_counter()
        if cuda:
            h2d = self._streams.h2d
            h2d.wait_stream(self._streams.current())
            self._wait_own_offload(h2d)
            pf.start = self._streams.event(h2d, timing=True)
            pf.comm_streams = fsdp_comm_streams(off.plan)
            if policy.lookahead_bytes is None:
                pf.arena = ReloadArena.seed(self.device, off.plan.nbytes)
        self._guards.remove()
        self._prefetching = pf
        self._state = Residency.PREFETCHING
        try:
            self._issue_ahead(pf, 0)
        except BaseException:
            self._prefetching = None
            self._undo_groups(pf)
            self._state = Residency.HOST
            self._guards.install(off.plan.modules, off.plan.optimizers)
            raise
        if pf.arena is not None:
            pf.arena.seal()
        for gi, g in enumerate(groups):
            if g.unit is not None:
                pf.hooks.append(g.unit.register_forward_pre_hook(self._unit_hook(gi), prepend=True))
        for opt in off.plan.optimizers:
            pf.hooks.append(opt.register_step_pre_hook(self._prefetch_step_hook))
        _prefetching_ferries[id(self)] = self
        _install_global_step_hook()
        nbytes = sum(groups[i].nbytes for i in range(pf.issued))
        self._issued("h2d", off.plan.state_bytes)  # all of it comes back, unit by unit
        pf.issued_at = issued_at
        handle = self._last = TransferHandle("h2d", nbytes, pf.events[pf.issued - 1], issued_at, start_event=pf.start)
        logger.debug("prefetch reload: %d groups, %d of %d bytes issued", len(groups), nbytes, off.plan.state_bytes)
        return handle

    def _issue_ahead(self, pf: _Prefetching, upto: int) -> None:
        """Issues groups until group ``upto`` is issued and the look-ahead budget is used."""
        limit = pf.policy.lookahead_bytes
        while pf.issued < len(pf.groups):
            ahead = sum(pf.groups[i].nbytes for i in range(upto, pf.issued))
            if pf.issued > upto and limit is not None and ahead >= limit:
                break
            self._issue_group(pf, pf.issued)

    def _issue_group(self, pf: _Prefetching, gi: int) -> None:
        with _transfer_range("h2d", pf.groups[gi].nbytes):
            self._issue_group_copies(pf, gi)

    def _issue_group_copies(self, pf: _Prefetching, gi: int) -> None:
        plan, cuda = pf.off.plan, self._streams.is_cuda
        if cuda and pf.issued > 0 and pf.policy.lookahead_bytes is not None:
            # Issued from a forward hook: the blocks allocated now may have been
            # freed by kernels still queued (see [Note: reload allocates on the caller's stream]).
            self._streams.h2d.wait_stream(self._streams.current())
        for si in pf.groups[gi].storages:
            plan.storages[si].resize_(plan.nbytes[si])
            pf.allocated.append(si)
        pf.versions.append(self._group_versions(pf, gi))
        self._copy_group(pf, gi)
        pf.events.append(self._streams.event(self._streams.h2d, timing=True) if cuda else None)
        pf.issued += 1

    def _copy_group(self, pf: _Prefetching, gi: int) -> None:
        plan, off, cuda = pf.off.plan, pf.off, self._streams.is_cuda
        for si in pf.groups[gi].storages:
            if not plan.nbytes[si]:
                continue
            dst = self._device_view(plan, si)
            if cuda:
                with torch.cuda.stream(self._streams.h2d):
                    dst.copy_(off.slots[si], non_blocking=True)
            else:
                dst.copy_(off.slots[si])

    @staticmethod
    def _group_versions(pf: _Prefetching, gi: int) -> list[int]:
        """Version counters of a group's host tensors; see [Note: prefetch reload]."""
        tensors = pf.off.repointer.tensors
        return _tensor_versions([tensors[i] for i in pf.groups[gi].tensors])

    def _unit_hook(self, gi: int):
        def hook(module: nn.Module, args: object) -> None:
            pf = self._prefetching
            if pf is None:
                return
            # This unit, and the ones FSDP2 all-gathers ahead from its pre-forward
            # (which may already be resident themselves, their targets not).
            targets = forward_prefetch_units(module)
            wanted = [j for j, g in enumerate(pf.groups)
                      if j == gi or (g.unit is not None and any(g.unit is u for u in targets))]
            wanted = [j for j in wanted if j not in pf.resident]
            if not wanted:
                return
            self._issue_ahead(pf, max(wanted))
            for j in wanted:
                self._make_resident(pf, j)
            if all(j in pf.resident for j, g in enumerate(pf.groups) if g.unit is not None):
                self._issue_ahead(pf, len(pf.groups) - 1)  # the tail follows on the copy stream
                if not pf.off.plan.optimizers:
                    self._finish_prefetch()
                # else: the optimizers' step pre-hook completes the tail group

        return hook

    def _prefetch_step_hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._prefetching is not None:
            self._finish_prefetch()  # optimizer state (and anything not yet used) resident first

    def _make_resident(self, pf: _Prefetching, gi: int) -> None:
        if gi in pf.resident:
            return
        if self._group_versions(pf, gi) != pf.versions[gi]:
            # Written on the host after its copy was issued: copy it again.
            if self._streams.is_cuda:
                self._streams.h2d.wait_stream(self._streams.current())
            self._copy_group(pf, gi)
            if self._streams.is_cuda:
                pf.events[gi] = self._streams.event(self._streams.h2d)
        ev = pf.events[gi]
        if ev is not None:
            self._streams.current().wait_event(ev)
            for stream in pf.comm_streams:  # FSDP2's all-gather copy-in reads the shard there
                stream.wait_event(ev)
        idx = pf.groups[gi].tensors
        if idx:
            sub = Repointer([pf.off.repointer.tensors[i] for i in idx], [pf.off.repointer.names[i] for i in idx])
            sub.apply([pf.off.device_locals[i] for i in idx])
        pf.resident.add(gi)

    def _finish_prefetch(self) -> TransferHandle:
        """Issues what is left and makes every group resident (``reload()`` while prefetching)."""
        pf = self._prefetching
        assert pf is not None
        self._issue_ahead(pf, len(pf.groups) - 1)
        for gi in range(len(pf.groups)):
            self._make_resident(pf, gi)
        return self._end_prefetch(pf)

    def _end_prefetch(self, pf: _Prefetching) -> TransferHandle:
        for h in pf.hooks:
            h.remove()
        _prefetching_ferries.pop(id(self), None)
        _remove_global_step_hook_if_idle()
        if pf.arena is not None:
            self._arena = pf.arena
        self._prefetching = None
        self._offloaded = None
        cuda = self._streams.is_cuda
        self._state = Residency.H2D_IN_FLIGHT if cuda else Residency.DEVICE
        handle = self._last = self._latest["h2d"] = TransferHandle(
            "h2d", pf.off.plan.state_bytes, pf.events[-1], pf.issued_at, start_event=pf.start)
        handle.add_done_callback(self._completed)
        return handle

    def _undo_groups(self, pf: _Prefetching) -> None:
        if self._streams.is_cuda:
            self._streams.h2d.synchronize()
        for si in pf.allocated:
            pf.off.plan.storages[si].resize_(0)

    def _undo_partial_reload(self, plan: Plan, indices) -> None:
        """Frees the re-allocated storages ``indices`` again (after their copies)."""
        if self._streams.is_cuda:
            self._streams.h2d.synchronize()
            self._streams.pack.synchronize()
        for si in indices:
            plan.storages[si].resize_(0)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Returns the host pool to the OS. The state must be resident.

        Raises:
            RuntimeError: the state is offloaded (closing would lose it): call
                ``reload()`` first.
        """
        if self._closed:
            return
        self._drop_pool("close()")
        self._closed = True

    def __enter__(self) -> Ferry:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Reloads what is offloaded, then closes; never masks the exception in flight."""
        try:
            if not self._closed and self.residency.on_host:
                self.reload()
            self.close()
        except Exception:
            if exc_type is None:
                raise
            logger.warning("torchferry: could not reload/close the ferry while leaving on an exception",
                           exc_info=True)
