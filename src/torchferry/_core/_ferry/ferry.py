"""``Ferry``: the public face, over the residency state machine (``_ferry/machine``) and the host
pool's side (``_ferry/host_side``); the layers below do the work (``_ferry/state_set``: [Note: storage
moves keep every tensor object]; ``_ferry/reconcile``: [Note: state replaced while offloaded];
``_ferry/pin_ahead``: [Note: pin ahead])."""

from __future__ import annotations

import logging
import time
import weakref

import torch

from .._api.args import check_bool, check_bytes, check_device, shown
from .._api.handle import TransferHandle
from .._api.residency import Residency
from .._api.settings import CoreSettings
from .._api.stats import StatsRecorder, TransferStats
from .._schedules.issuer import refill_mark
from .._schedules.prefetch import Prefetch, prefetch_groups
from .._schedules.release import ReleaseSchedule
from .._state.plan import build_plan
from .._state.targets import Targets
from .._transfer.copies import transfer_range
from .guards import OffloadGuards, dropped
from .host_side import HostSide
from .misuse import OneMover, moves_state
from .pin_ahead import PinAhead
from .rollback import Rollback
from .state_set import StateSet
from .watch import ResidentWatch, forget_plan_of

__all__ = ["Ferry"]

logger = logging.getLogger("torchferry")


class Ferry(HostSide):
    """Moves a set of training state between its GPU and a pinned host pool.

    Args:
        *targets: ``nn.Module``s (parameters, buffers, ``.grad``s), optimizers (``optimizer.state``
            on the device, wrapped optimizers such as ``ZeroRedundancyOptimizer.optim`` too) and
            tensors; FSDP2 modules are resharded before each offload. Modules and optimizers are
            held by weak reference.
        device: inferred if ``None``. With ``"cpu"`` the same moves run synchronously into an
            unpinned pool (CPU tests).
        max_pinned_bytes: pin at most this many bytes of the pool (at a copy boundary); the rest
            stays pageable (slower, ``is_pinned()`` False).
        host_budget_bytes: bytes all pools of this node may hold together ([Note: host budget]);
            default ``settings.host_budget_bytes`` (``TORCHFERRY_HOST_BUDGET_BYTES``).
        pin_ahead: on a GPU, allocate and pin the host pool in a background thread from now on (after an
            optimizer target's first step if it has no state yet), so that the first offload does not pin
            ([Note: pin ahead]). Default on.
        skip_unchanged: offloads copy only the storages written since the last reload and release the
            rest uncopied (a frozen base, a reference model); a 128-bit hash of each such storage on the
            device at each reload and offload decides ([Note: unchanged storages] in
            ``torchferry._core._schedules.unchanged``). Default off.
        settings: the core's settings (``torchferry.CoreSettings``: the host budget's
            reserve and ledger folder, the copy streams' switch points, the hash, ...). Default:
            ``torchferry.Ferry`` reads them from the ``TORCHFERRY_*`` variables (``docs/ferry.md``,
            "Settings") once, now: a variable set after ``Ferry()`` does not change this ferry (the core's
            own class, below the environment, takes ``CoreSettings()``, the defaults); an integration's
            ``patch()`` passes the ones it read.

    Raises:
        ValueError: no targets, tensors on several devices, a ``device`` string torch does not
            know (``"gpu"``), a negative or non-integer byte count, or a bad ``TORCHFERRY_*`` setting
            (refused here, before anything moved).
        TypeError: a target that is not a module, optimizer or tensor; ``device`` not a str, int
            or ``torch.device``; ``pin_ahead`` or ``skip_unchanged`` not a bool; ``settings`` not a
            ``CoreSettings`` (whose own values it checks when made: ``ValueError``, ``TypeError``).
        NotImplementedError: meta, nested, non-strided, quantized tensors, tensor subclasses other
            than DTensor (also as a DTensor's local shard), storages that cannot be resized, an
            optimizer holding device state outside ``optimizer.state``.

    Example::

        ferry = torchferry.Ferry(model, optimizer)
        ferry.offload()            # D2H on its own stream; GPU memory released
        torch.cuda.empty_cache()   # return it to the driver (e.g. for rollout)
        ...
        ferry.reload()             # H2D; the current stream waits for it
        loss = model(batch).sum()  # no host sync needed

    Tensor objects keep their identity and autograd metadata across cycles. One thread moves a ferry at a
    time: a call while another thread is inside one raises ``RuntimeError`` ([Note: one thread moves a ferry]).
    """

    def __init__(self, *targets: object, device: torch.device | str | None = None,
                 max_pinned_bytes: int | None = None, host_budget_bytes: int | None = None,
                 pin_ahead: bool = True, skip_unchanged: bool = False, settings: CoreSettings | None = None) -> None:
        if settings is None:
            settings = CoreSettings()
        if not isinstance(settings, CoreSettings):
            raise TypeError(f"torchferry: Ferry(settings=...) must be a CoreSettings, got {shown(settings)}")
        refill_mark(settings.issue_refill_bytes)  # a mark above the issue window: refused now, not at a reload
        check_bytes(max_pinned_bytes, "Ferry(max_pinned_bytes=...)")
        check_bytes(host_budget_bytes, "Ferry(host_budget_bytes=...)")
        check_bool(pin_ahead, "Ferry(pin_ahead=...)")
        check_bool(skip_unchanged, "Ferry(skip_unchanged=...)")
        device = check_device(device, "Ferry(device=...)")
        plan = build_plan(targets, device)  # validates every target now
        self._targets = Targets(targets)
        # No tensor yet (an optimizer before its first step), no device: decided at the first offload.
        fixed = device is not None or bool(plan.tensors)
        self._set = StateSet(self._targets, plan.device if fixed else None, max_pinned_bytes=max_pinned_bytes,
                             host_budget_bytes=settings.host_budget_bytes if host_budget_bytes is None
                             else host_budget_bytes, skip_unchanged=skip_unchanged, settings=settings)
        self._settings = settings
        ref = weakref.ref(self)
        self._guards = OffloadGuards(lambda: repr(ref()) if ref() is not None else "Ferry(dropped)")
        # See [Note: a ferry dropped while offloaded].
        weakref.finalize(self, dropped, self._guards).atexit = False
        self._offloaded = None
        self._residency = Residency.DEVICE
        self._last = None
        self._prefetch = None
        self._state_bytes = plan.state_bytes
        self._recorder = StatsRecorder()
        self._released = (None, None)
        self._closed = False
        self._mover = OneMover()
        self._pin_ahead = PinAhead.arm(self._set, plan) if pin_ahead else None
        self._watch = ResidentWatch(lambda: forget_plan_of(ref()))  # [Note: state dropped while resident]
        weakref.finalize(self, self._watch.disarm).atexit = False

    # ------------------------------------------------------------------ state
    @property
    def settings(self) -> CoreSettings:
        """The core's settings this ferry was made with (read once, at ``Ferry()``)."""
        return self._settings

    @property
    def last_handle(self) -> TransferHandle | None:
        """The handle of the last transfer issued (offload or reload), or ``None`` before the first;
        for a layer-wise reload, of the copies issued so far (all of them once it finished)."""
        run = self._prefetch
        return run.handle() if run is not None and run.finished else self._last

    @property
    def stats(self) -> TransferStats:
        """Last and cumulative transfer figures (a finished layer-wise reload counted in)."""
        if self._prefetch is not None and self._prefetch.finished and not self._mover.busy_elsewhere():
            self._complete_prefetch()
        return self._recorder.stats

    @property
    def state_bytes(self) -> int:
        """Bytes of the unique storages in the last plan (what one transfer moves)."""
        return self._state_bytes

    def __repr__(self) -> str:
        if self._closed:
            return f"Ferry(device={self.device}, closed)"
        return (f"Ferry(device={self.device}, residency={self._residency.name}, "
                f"state_bytes={self._state_bytes}, host_bytes={self.host_bytes})")

    # ------------------------------------------------------------------- plan
    @moves_state("forget_plan()")
    def forget_plan(self) -> None:
        """Drops what the ferry keeps on the device for its next offload while the state is
        resident: the cached plan (it holds the device storages) and the reload arena's fillers.

        For state moved by other means (``model.cpu()``, another offloader), whose memory would
        otherwise stay reserved. The next ``offload()`` plans again.

        Raises:
            RuntimeError: the state is offloaded (``reload()`` first), or the ferry is closed.
        """
        self._check_open()
        self._complete_prefetch()
        if self.residency.on_host:
            raise RuntimeError("torchferry: forget_plan() while the state is offloaded would lose it; "
                               "reload() first")
        self._set.drop_arena()
        self._set.disarm_early()
        self._set.forget()

    # ---------------------------------------------------------------- offload
    def offload(self) -> TransferHandle:
        """Copies the state to the host pool and releases its device memory.

        The copies run on the D2H stream after the current stream's pending work. On return the known tensors are CPU
        tensors viewing the pinned pool (``is_pinned()``) and the device storages are empty (their blocks go back to
        the caching allocator once the copies finish; small packed ones once their gathers, device-to-device, are
        done, the current stream waiting for those: [Note: small storages released without an event each]).

        Returns before the copies complete, off the caller's stream: a synchronisation of that stream alone
        (``.item()``, ``torch.cuda.current_stream().synchronize()``) does not order them. A host read of the offloaded
        tensors needs ``handle.wait()``, a target's ``state_dict()`` (DCP's getters too; it waits: [Note: state_dict()
        waits for the offload]), ``handle.wait_stream(s)`` and then a synchronisation of ``s`` (what the verl helpers
        do), or ``torch.cuda.synchronize()`` (``docs/ferry.md``).

        A no-op when already offloaded, unless the targets' tensors were replaced meanwhile
        ([Note: state replaced while offloaded]). Runs with the cyclic GC paused ([Note: GC pause]).

        Returns:
            A :class:`TransferHandle` for the D2H copies.

        Raises:
            RuntimeError: the pool could not be allocated or pinned, a tensor cannot be re-pointed,
                or the ferry is closed (state unchanged).
            ValueError, TypeError, NotImplementedError: as for the constructor.
        """
        return self._offload(None)

    @moves_state("offload()")
    def _offload(self, schedule: ReleaseSchedule | None) -> TransferHandle:
        """``offload()``; :func:`torchferry.swap` hands its release schedule here (the storages go
        to it instead of being released at once: [Note: swap budget])."""
        self._check_open()
        self._complete_prefetch()
        off = self._offloaded
        if off is not None:  # on the host (or on its way)
            if not self._set.replaced(off):
                return self._handle_or_noop("d2h")
            self._reconcile(off)
        issued_at = time.perf_counter()
        rollback = Rollback(self)
        move = None
        with transfer_range("d2h", self._state_bytes):
            try:  # see [Note: one rollback]; a release rolled forward completes the move, raising
                with rollback:
                    move = self._set.offload(schedule)
                    rollback.undo = move.undo
                    rollback.committed = lambda: move.done
                    plan = move.issued.plan
                    self._guards.install(plan.modules, plan.optimizers)
                    handle = self._issued(move.handle(issued_at))
                    self._offloaded = move.offloaded
                    self._residency = Residency.D2H_IN_FLIGHT if self._streams.is_cuda else Residency.HOST
                    self._set.drop_arena()
                    move.finish()  # the last step: done, or undone and raising, or done and raising
            finally:
                if move is not None and move.done:
                    self._released = (self._last, move.released)
                    self._state_bytes = move.issued.plan.state_bytes
        plan = move.issued.plan
        self._watch.disarm()
        logger.debug("offload: %d bytes in %d storages from %s",
                     plan.state_bytes, len(plan.storages), self.device)
        return handle

    # ----------------------------------------------------- offload in pieces
    @moves_state("offload_during_forward()")
    def offload_during_forward(self) -> None:
        """Arms an offload in pieces: each FSDP unit's state starts its D2H copy as soon as its
        forward in the next forward pass is done; the next ``offload()`` then only copies the
        rest and releases everything.

        For forward-only phases (log-probabilities); can be armed right after
        ``reload(prefetch=...)``. What is and is not seen, and what is not armed (state with
        gradients, no FSDP2 units): [Note: offload during forward] in ``torchferry._core._schedules.early``.

        Raises:
            RuntimeError: the ferry is closed; or the host pool could not be allocated (nothing moved).
            HostBudgetError: the node's host budget cannot hold the pool.
        """
        self._check_open()
        self._set.disarm_early()
        if self._prefetch is not None and self._prefetch.finished:
            self._end_prefetch()
        run = self._prefetch
        if run is None and self._offloaded is not None:
            return  # on the host: nothing to copy early
        self._set.arm_early(run)

    # ----------------------------------------------------------------- reload
    def reload(self, prefetch: bool | Prefetch = False) -> TransferHandle:
        """Re-allocates the device storages and copies the state back.

        With ``prefetch``, FSDP2 units come back in forward order, each forward waiting only for its own copies,
        optimizer state behind them until ``optimizer.step()`` ([Note: prefetch reload]); ``residency`` is
        ``PREFETCHING`` until all is resident. Without FSDP units the parameters come back at once and optimizer state
        still follows behind; with neither, or with gradients in the state, it is a plain reload. The copies run on
        the H2D stream and the current stream waits for them (no host sync; ``handle.wait_stream(s)`` for another
        stream). A no-op when already resident.

        Args:
            prefetch: ``False``, ``True`` or a :class:`Prefetch` policy.

        Returns:
            A :class:`TransferHandle` for the H2D copies.

        Raises:
            TypeError: ``prefetch`` is not a bool or a :class:`Prefetch`.
            RuntimeError: the device ran out of memory (the message names the bytes needed; the
                state stays on the host, nothing is lost), a tensor cannot be re-pointed, or the
                ferry is closed.
        """
        return self._reload(prefetch, None)

    @moves_state("reload()")
    def _reload(self, prefetch: bool | Prefetch, schedule: ReleaseSchedule | None) -> TransferHandle:
        """``reload()``; :func:`torchferry.swap` hands its release schedule here (asked before each
        allocation, so the outgoing state leaves first)."""
        if not isinstance(prefetch, (bool, Prefetch)):
            raise TypeError(f"torchferry: reload(prefetch=...) takes True, False or a Prefetch, "
                            f"got {type(prefetch).__name__} {prefetch!r}")
        self._check_open()
        run = self._prefetch
        if run is not None and not run.finished:
            if prefetch and self._last is not None:
                return self._last
            return self._complete_prefetch()  # type: ignore[return-value]  # a run under way: its handle
        self._complete_prefetch()
        off = self._offloaded
        if off is None:
            return self._handle_or_noop("h2d")
        self._targets.refuse_reload_if_dead()
        groups = prefetch_groups(off.plan) if prefetch else None
        if groups is not None:
            if self._set.replaced(off):
                return self._reconcile(off)
            policy = prefetch if isinstance(prefetch, Prefetch) else Prefetch()
            return self._start_prefetch(off, groups, policy)
        return self._reload_all(off, schedule)

    # ------------------------------------------------------------------ close
    @moves_state("close()")
    def close(self) -> None:
        """Returns the pool and drops everything held: no device memory, host memory or hooks remain.

        Raises:
            RuntimeError: the state is offloaded (closing would lose it): ``reload()`` first; unless a target
                was collected meanwhile: the state then stays on the host ([Note: a target collected while
                offloaded] in guards.py).
        """
        if self._closed:
            return
        if self.residency.on_host and self._targets.dead() is not None:
            dropped(self._guards, warn=False)
            self._closed = True
            return
        self._drop_pool("close()")
        if self._pin_ahead is not None:
            self._pin_ahead.cancel()
        self._guards.remove()
        self._watch.disarm()
        self._set.forget()
        self._set.drop_arena()
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

