"""Layer-wise reload: FSDP units come back in forward order, each forward waits only for its own.

[Note: prefetch reload]
``ferry.reload(prefetch=...)`` splits the state into groups, one per FSDP unit
(a ``fully_shard``-ed module: its parameters, their grads, its buffers) in
forward order (module pre-order, so the root unit comes first: FSDP2's root
pre-forward all-gathers it before any layer runs), plus a tail group for the
rest (optimizer state, plain tensors). Copies for the groups are issued on the
H2D stream in that order, all at once or, with ``lookahead_bytes``, keeping at
most that many bytes issued ahead of the unit being computed.

A unit is an FSDP2 state: ``fully_shard([a, b])`` makes one unit of both.
Every unit gets a forward pre-hook, prepended so that it runs before FSDP2's
own (which all-gathers the unit's ``_sharded_param_data``). The hook makes the
current stream wait for the unit's copy event (and for the units FSDP2 will
prefetch from there, ``_states_to_forward_prefetch``), gives the unit's
tensors their device impls back, and issues further groups to keep the
look-ahead. The tail group is completed by a step pre-hook of each optimizer
target, so ``optimizer.step()`` cannot run on state still in flight; a
``state_dict()`` or ``load_state_dict()`` of a target (module or optimizer)
completes everything first.
When the last group is resident the hooks are removed. Until its unit runs, a
group's tensors stay CPU tensors viewing the pool (still correct, just not
moved yet); ``ferry.reload()`` without prefetch completes everything at once.

[Note: storage swapped while prefetching]
As while offloaded ([Note: storage swapped while offloaded] in ``_ferry.reconcile``), a tensor
can be given other bytes between ``reload(prefetch=...)`` and its unit's forward: ``p.data = t``,
``module.half().float()``, or FSDP2 itself, which on any ``module.to(...)`` of a unit re-pads an
uneven shard into a new host tensor that later in-place writes then land in (the writes were
lost: ``tests/cpu/test_fsdp2_module_to.py``). So making a unit resident first compares each of its
tensors with the host view the offload gave it (address, shape, stride, dtype); one that moved
away gets the pool's bytes and then the bytes it holds now (``copy_`` into its planned storage,
or, for another shape or dtype, ``.data =`` a device copy, as a reconcile does), and the
baseline of [Note: unchanged storages] is dropped (the next offload copies everything).
``load_state_dict()`` of a target or of a unit completes the reload first.

Between ``reload(prefetch=...)`` and a unit's forward its tensors are host
tensors. In-place writes to them there (``p.mul_(2)``) are not lost: version
counters are recorded when the copies are issued and a group written since is
copied again when made resident. Writes the counters do not see are: the
``_foreach_`` ops on DTensors, writes through ``p.data`` or through views
taken before the offload. So: state holding gradients is reloaded plainly
(``zero_grad(set_to_none=False)`` before the forward uses ``_foreach_zero_``),
every optimizer step first completes every prefetch under way (a global step
pre-hook while one is), and you should not write parameters between the
reload and the forward otherwise. FSDP2's ``unshard()`` called by hand there,
or ``full_tensor()`` of a parameter not yet resident, would read a host
tensor: call ``ferry.reload()`` first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

import torch
from torch import nn

from .._api.settings import CoreSettings
from .._transfer.batches import copy_group_in, copy_now, taken_to
from .._transfer.copies import transfer_range, undo_allocations
from .._state.fsdp import comm_streams, forward_prefetch_units, local_of, repoint_sharded_data, sharded_params, versions
from .._api.hooks import PREFETCHING as _during, Uncopyable
from .._api.handle import TransferHandle
from .._host.layout import HostViews
from .._state.plan import Plan
from .._state.parking import Parking
from .step_hooks import GlobalStepHook
from .unchanged import UnchangedStorages
from .._transfer.driver import DriverQueue, queue_for
from .._transfer.streams import TransferStreams, wait_event
from .groups import Group, group_plan, prefetch_groups, split_tail
from .issuer import ISSUE_POLL_S, ISSUE_WINDOW_BYTES, Issuer, refill_mark, wait_target

__all__ = ["Group", "Prefetch", "PrefetchRun", "group_plan", "prefetch_groups", "split_tail"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prefetch:
    """How a layer-wise reload runs.

    Attributes:
        lookahead_bytes: bytes of copies kept issued ahead of the unit being
            computed (at least one group is always issued). ``None`` (the
            default) issues every group at the ``reload()`` call: the copy
            engine then streams them back to back in forward order, and the
            device memory is allocated at once, as for a plain reload.
    """

    lookahead_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.lookahead_bytes is not None and (
                not isinstance(self.lookahead_bytes, int) or isinstance(self.lookahead_bytes, bool)
                or self.lookahead_bytes < 0):
            raise ValueError(f"torchferry: Prefetch: lookahead_bytes must be an int >= 0 (bytes) or None, "
                             f"got {self.lookahead_bytes!r}")


# Every optimizer step first completes every layer-wise reload under way.
_RUNS = GlobalStepHook()
# And then waits, on its own stream, for those completed and not yet done ([Note: the step waits on its own stream]).
_SETTLING = GlobalStepHook()

logger = logging.getLogger("torchferry")

# The copies of a reload queued at once are issued from a thread on CUDA ([Note: copies issued
# off the caller's thread]); the CPU tests set this to run that path where copies are synchronous.
BACKGROUND_ON_CPU = False


def _wait_at_step(key: int, done: torch.cuda.Event, device: torch.device):
    """The entry of :data:`_SETTLING` for a finished layer-wise reload whose last event is ``done``.

    [Note: the step waits on its own stream]
    With ``optimizer_at_step`` the optimizer state comes back when
    ``optimizer.step()`` starts. A step on a side stream must wait for it on
    that stream, the one current in the step pre-hook. Waiting where the reload
    was completed is not enough: another optimizer's step, a ``state_dict()``
    or ``reload()`` may complete it first on another stream (the global step
    hook completes every layer-wise reload before *any* step), after which the
    ferry's hooks are gone; then the side stream's step read state still in
    flight (12 wrong state tensors on one H200 at 0e8596e). So until the
    reload's last event on the H2D stream (``PrefetchRun.done``, after every
    group's copies, re-copies included) has passed, every optimizer step makes
    its own current stream wait for it (and ``finish()`` makes the stream it
    runs on wait for it, also for groups made resident earlier on another
    stream). ``tests/gpu/test_stream_order_cuda.py``.
    """

    def wait() -> None:
        if done.query():
            _SETTLING.discard(key)
        else:
            wait_event(torch.cuda.current_stream(device), done)

    return wait


class PrefetchRun:
    """One layer-wise reload under way (see [Note: prefetch reload]).

    Args:
        plan, views: what comes back, and its pool views.
        parking: the plan's tensor objects (on the host when this starts).
        device_views: the plan's cached 1D uint8 device views, or ``None``.
        groups: from :func:`group_plan`, at least one.
        policy: the :class:`Prefetch` settings.
        streams: the device's streams.
        after: an event the H2D stream waits for first (the ferry's last
            offload: its slots may still be filling), or ``None``.
        unchanged: the ferry's ``skip_unchanged`` ([Note: unchanged storages]), or ``None``:
            each group's baseline hash is taken on the H2D stream right after its copies, its
            version counters once it is resident.
        settings: the ferry's settings: the issuer thread's refill mark (``issue_refill_bytes``) and
            whether it queues copies by pointer (``driver_copies``); default the core's defaults.

    Raises:
        ValueError: a refill mark outside ``[0, ISSUE_WINDOW_BYTES]`` (:func:`refill_mark`).

    Attributes:
        finished: every group resident and every hook removed.
        events: per issued group, its H2D event (``None`` on the CPU).
        start: H2D event before the first copy (timing), ``None`` on the CPU.
        issued_at: ``time.perf_counter()`` at the start.
        done: once finished on a GPU, the run's last event on the H2D stream: after every group's
            copies and baseline hash, re-copies included (the finished handle's ``ready_event``).
    """

    def __init__(self, plan: Plan, views: HostViews, parking: Parking, device_views: list[torch.Tensor] | None,
                 groups: list[Group], policy: Prefetch, streams: TransferStreams,
                 after: torch.cuda.Event | None, unchanged: UnchangedStorages | None = None, *,
                 settings: CoreSettings | None = None) -> None:
        self.plan, self.views, self.parking, self.device_views = plan, views, parking, device_views
        self.groups, self.policy, self.streams, self._after = groups, policy, streams, after
        self._unchanged = unchanged
        self.issued = 0  # groups issued, in order
        self.events: list[torch.cuda.Event | None] = []
        self._versions: list[list[object]] = []  # per issued group: its host tensors' versions at issue
        self.resident: set[int] = set()
        self._allocated: list[int] = []  # storage indices re-allocated so far
        self._hooks: list = []
        self._comm: list[torch.cuda.Stream] = []
        self._sharded: dict[int, object] = {}  # sharded_params(), made in begin() before any hook
        self.start: torch.cuda.Event | None = None
        self.done: torch.cuda.Event | None = None
        self._latest: torch.cuda.Event | None = None  # the event this run recorded last on the H2D stream
        self.issued_at = time.perf_counter()
        self.finished = False
        self._issuer: Issuer | None = None  # see [Note: copies issued off the caller's thread]
        self._window_from = 0  # the first issued group whose copies may not be done (issuer thread)
        self._queue: DriverQueue | Literal[False] | None = None  # the issuer thread's; False: use copy_
        self._settings = settings if settings is not None else CoreSettings()
        self._refill = refill_mark(self._settings.issue_refill_bytes)
        self._pinned: dict[int, bool] = {}  # storage index -> its slot is pinned (the issuer thread's)
        self._background = (streams.is_cuda or BACKGROUND_ON_CPU) and policy.lookahead_bytes is None
        if self._background:
            self.groups = groups = split_tail(plan, groups)
            self._background = len(groups) > 1

    # ------------------------------------------------------------ lifecycle
    def begin(self) -> None:
        """Issues the first groups and installs the hooks.

        Raises:
            BaseException: whatever the first copies (or a hook's registration) raised, after
                :meth:`abort`: nothing is left allocated or hooked, the tensors are still on the host.
        """
        cuda = self.streams.is_cuda
        try:
            self._sharded = sharded_params(self.plan.modules)  # inside the call: its walk is memoised
            if cuda:
                self._comm = comm_streams(self.plan.modules)
                _SETTLING.install()  # finish() adds to it, maybe from inside a step
            if self._background:
                # No reload arena here: [Note: no arena under a layer-wise reload] in _transfer/arena.py.
                for gi in range(len(self.groups)):  # on the caller's thread and stream: see the Note
                    self._allocate_group(gi)
            else:
                self._allocate_group(0)
            if cuda:  # after the allocations: [Note: reload allocates on the caller's stream] in h2d.py
                h2d = self.streams.h2d
                h2d.wait_stream(self.streams.current())
                if self._after is not None:
                    h2d.wait_event(self._after)
                self.start = self.streams.event(h2d, timing=True)
            if self._background:
                self._issue_ranged(0)  # the handle's event
            else:
                self._issue_ahead(0)
            targets = {id(m) for m in self.plan.modules}
            complete = Uncopyable(torch.inference_mode(False)(self._complete_hook), _during)  # see _api/hooks
            for gi, g in enumerate(self.groups):
                if g.unit is not None:
                    self._hooks.append(g.unit.register_forward_pre_hook(self._unit_hook(gi), prepend=True))
                    # A unit's own load_state_dict completes the reload first; one such hook per module
                    # (a target gets its own below): the one that completes removes the others while
                    # torch iterates that module's hooks.
                    if id(g.unit) not in targets:
                        self._hooks.append(g.unit.register_load_state_dict_pre_hook(complete))
            for m in self.plan.modules:  # a checkpoint saved or loaded here: everything resident first
                self._hooks.append(m.register_state_dict_pre_hook(complete))
                self._hooks.append(m.register_load_state_dict_pre_hook(complete))
            for opt in self.plan.optimizers:
                self._hooks.append(opt.register_step_pre_hook(complete))
                self._hooks.append(opt.register_state_dict_pre_hook(complete))
                self._hooks.append(opt.register_load_state_dict_pre_hook(complete))
            _RUNS.add(id(self), self.finish)
            if self._background:
                self._issuer = Issuer(self.plan.device, self._issue_windowed, 1, len(self.groups))
                self._issuer.start()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Undoes :meth:`begin` before any group was made resident: hooks removed, storages
        released again after the copies into them (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _RUNS.discard(id(self))
        self._stop_issuer()
        if self.resident:
            self.parking.revert_to_device([i for gi in sorted(self.resident) for i in self.groups[gi].tensors])
            self.resident = set()
        allocated, self._allocated = self._allocated, []
        undo_allocations(self.plan, allocated, self.streams)  # after the copies into them; never raises

    def finish(self) -> None:
        """Issues what is left and makes every group resident (idempotent); the current stream
        then waits for every group, also those made resident earlier on another stream, and an
        optimizer step on any stream waits for it until it is done ([Note: the step waits on
        its own stream])."""
        if self.finished:
            return
        self._issue_ahead(len(self.groups) - 1)
        for gi in range(len(self.groups)):
            self._make_resident(gi)
        self.done = self._latest
        if self.done is not None:  # the last of this run's events on the H2D stream: after all its copies
            wait_event(self.streams.current(), self.done)  # also for groups made resident on another stream
            if self.plan.optimizers:  # keyed by plan: one entry per ferry, holding only an event
                _SETTLING.add(id(self.plan), _wait_at_step(id(self.plan), self.done, self.plan.device))
        self._close()

    def _close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _RUNS.discard(id(self))
        self._stop_issuer()
        self.finished = True

    def _stop_issuer(self) -> None:
        """Cancels the issuer thread's jobs not started and joins it: from here this thread issues."""
        issuer, self._issuer = self._issuer, None
        if issuer is None:
            return
        issuer.stop()
        if issuer.error is not None:
            logger.warning("torchferry: issuing a layer-wise reload's copies from a thread failed (%r); the "
                           "caller's thread issues the rest", issuer.error)

    @property
    def issuing(self) -> bool:
        """The issuer thread still queues copies: ``events[-1]`` is not yet the reload's last."""
        issuer = self._issuer
        return issuer is not None and issuer.running

    @property
    def issued_bytes(self) -> int:
        return sum(self.groups[i].nbytes for i in range(self.issued))

    def handle(self) -> TransferHandle:
        """A handle for the copies issued so far (all of them once finished)."""
        nbytes = self.plan.state_bytes if self.finished else self.issued_bytes
        return TransferHandle("h2d", nbytes, self.events[self.issued - 1], self.issued_at, start_event=self.start,
                              ready_event=self.done if self.finished else None)

    # ---------------------------------------------------------------- hooks
    def _unit_hook(self, gi: int):
        @torch.inference_mode(False)  # [Note: the ferry's bookkeeping outside inference mode] in _ferry/misuse
        def hook(module: nn.Module, args: object) -> None:
            if self.finished:
                return
            # This unit, and the ones FSDP2 all-gathers ahead from its pre-forward
            # (which may already be resident themselves, their targets not).
            targets = forward_prefetch_units(module)
            wanted = [j for j, g in enumerate(self.groups)
                      if j == gi or (g.unit is not None and any(g.unit is u for u in targets))]
            wanted = [j for j in wanted if j not in self.resident]
            if not wanted:
                return
            self._issue_ahead(max(wanted))
            for j in wanted:
                self._make_resident(j)
            if all(j in self.resident for j, g in enumerate(self.groups) if g.unit is not None):
                if self._issuer is None:
                    self._issue_ahead(len(self.groups) - 1)  # the tail follows on the copy stream
                if not self.plan.optimizers:
                    self.finish()
                # else: the optimizers' step pre-hook completes the tail group

        return Uncopyable(hook, _during)

    def _complete_hook(self, *args: object, **kwargs: object) -> None:
        self.finish()  # optimizer state (and anything not yet used) resident first

    # --------------------------------------------------------------- copies
    def _issue_ahead(self, upto: int) -> None:
        """Issues groups until ``upto`` is and the look-ahead is used (or waits for the issuer thread
        to issue ``upto``, taking over if it stopped)."""
        issuer = self._issuer
        if issuer is not None:
            if issuer.wait(upto):
                return
            self._stop_issuer()
        limit = self.policy.lookahead_bytes
        while self.issued < len(self.groups):
            ahead = sum(self.groups[i].nbytes for i in range(upto, self.issued))
            if self.issued > upto and limit is not None and ahead >= limit:
                break
            self._issue_ranged(self.issued)

    def _issue_windowed(self, gi: int) -> None:
        """The issuer thread's job: group ``gi`` once the copies queued and not yet done are under
        :data:`ISSUE_WINDOW_BYTES` (with ``gi``'s), so the stream's queue never fills and no
        CUDA call of another thread waits behind it ([Note: copies issued off the caller's thread]);
        by pointer where the driver allows ([Note: copies queued by pointer]). A full window is
        waited for until it has drained to the refill mark (``TORCHFERRY_ISSUE_REFILL_BYTES``)."""
        if self._queue is None and self.streams.is_cuda:
            self._queue = queue_for("h2d", self.streams.h2d, enabled=self._settings.driver_copies) or False
        queue = self._queue or None
        events, nbytes = self.events, [g.nbytes for g in self.groups]
        while self._window_from < self.issued and (events[self._window_from] is None
                                                   or events[self._window_from].query()):
            self._window_from += 1
        target = wait_target(nbytes, self._window_from, self.issued, gi, ISSUE_WINDOW_BYTES, self._refill)
        if target is not None:
            ev = events[target]
            if ev is not None and queue is not None:
                queue.wait(ev)  # the GIL released until those copies are done
            elif ev is not None:
                while not ev.query():
                    time.sleep(ISSUE_POLL_S)
            self._window_from = target + 1
        self._issue_ranged(gi, queue)

    def _issue_ranged(self, gi: int, queue: DriverQueue | None = None) -> None:
        with transfer_range("h2d", self.groups[gi].nbytes):
            self._issue_group(gi, queue)

    def _allocate_group(self, gi: int) -> None:
        plan = self.plan
        for si in self.groups[gi].storages:
            if plan.storages[si].nbytes() != plan.nbytes[si]:  # else kept by the offload (holders.py)
                plan.storages[si].resize_(plan.nbytes[si])
                self._allocated.append(si)
        self._versions.append(self._group_versions(gi))
        if self.streams.is_cuda and self.issued > 0 and self.policy.lookahead_bytes is not None:
            # Issued from a forward hook, after the allocations: the blocks may have been freed by kernels
            # still queued, or written by one the allocation queued (see [Note: reload allocates on the
            # caller's stream] in h2d.py).
            self.streams.h2d.wait_stream(self.streams.current())

    def _issue_group(self, gi: int, queue: DriverQueue | None = None) -> None:
        """Allocates group ``gi`` (unless done), queues its copies (by pointer through ``queue`` if
        given) and event (on the issuer thread too)."""
        if gi >= len(self._versions):
            self._allocate_group(gi)
        self._copy_group(gi, queue)
        ev = self.streams.event(self.streams.h2d, timing=True) if self.streams.is_cuda else None
        self.events.append(ev)
        self._latest = ev
        self.issued += 1

    def _copy_group(self, gi: int, queue: DriverQueue | None = None) -> None:
        plan, slots, cuda = self.plan, self.views.slots, self.streams.is_cuda
        todo = self.groups[gi].storages
        by_pointer = ({si for si in todo if plan.nbytes[si] and self._slot_pinned(si)}  # see [Note: copies
                      if queue is not None else ())  # queued by pointer]
        copy_group_in(plan, todo, slots, self.streams, self.device_views, queue, by_pointer)
        held = self._unchanged
        if held is not None and self.device_views is not None:  # the bytes just copied, before any write
            storages = self.groups[gi].storages
            if cuda:
                with torch.cuda.stream(self.streams.h2d):
                    held.copied_in(plan, self.views, self.device_views, storages)
            else:
                held.copied_in(plan, self.views, self.device_views, storages)

    def _slot_pinned(self, si: int) -> bool:
        """Whether storage ``si``'s pool slot is pinned (a partly pinned pool's rest is pageable: its
        copies go through ``copy_``, which releases the GIL while the driver stages them)."""
        pinned = self._pinned.get(si)
        if pinned is None:
            pinned = self._pinned[si] = self.views.slots[si].is_pinned()
        return pinned

    def _group_versions(self, gi: int) -> list[object]:
        tensors = self.parking.tensors
        return versions([tensors[i] for i in self.groups[gi].tensors])

    def _make_resident(self, gi: int) -> None:
        if gi in self.resident:
            return
        cuda = self.streams.is_cuda
        if self._group_versions(gi) != self._versions[gi]:
            # Written on the host after its copy was issued: copy it again (this thread alone
            # issuing on the H2D stream from here).
            if self._issuer is not None:
                self._issue_ahead(len(self.groups) - 1)
                self._stop_issuer()
            if cuda:
                self.streams.h2d.wait_stream(self.streams.current())
            self._copy_group(gi)
            if cuda:
                self.events[gi] = self._latest = self.streams.event(self.streams.h2d)
        ev = self.events[gi]
        if ev is not None:
            wait_event(self.streams.current(), ev)
            for stream in self._comm:  # FSDP2's all-gather copy-in reads the shard there
                stream.wait_event(ev)
        group = self.groups[gi]
        given = self._given_other_bytes(group)
        self.parking.to_device(group.tensors)
        self.resident.add(gi)
        repoint_sharded_data(self.plan.modules, self.parking.host_locals(group.tensors),  # see [Note: FSDP2's
                             self._sharded)  # shard buffer after a move]
        if self._unchanged is not None:
            ts = self.groups[gi].tensors
            self._unchanged.resident(self.plan, self.views, self.parking.host_versions(ts), ts)
            if given:
                self._unchanged.forget()  # the next offload copies everything
        for i, new in given.items():  # after the pool's bytes, on the stream that waited for them
            local = local_of(self.parking.tensors[i])
            if (new.shape, new.stride(), new.dtype) == (local.shape, local.stride(), local.dtype):
                copy_now(local, new)  # into the storage the ferry planned
            else:  # another shape or dtype (module.half()): the object takes it to the device, as a reconcile does
                local.data = taken_to(new, local.device)

    def _given_other_bytes(self, group: Group) -> dict[int, torch.Tensor]:
        """The group's tensors given other host bytes since the reload began (``module.half().float()``,
        FSDP2 re-padding an uneven shard on ``module.to()``, ``p.data = t``): index -> the tensor they
        hold now, whose bytes go to the device instead of the pool's ([Note: storage swapped while
        prefetching])."""
        parking = self.parking
        moved = self.views.moved_among((i, local_of(parking.tensors[i])) for i in group.tensors)
        return {i: local_of(parking.tensors[i]) for i in moved}
