"""Offload during forward: each FSDP unit's D2H copies start as soon as its forward is done.

[Note: offload during forward]
In a forward-only phase (log-probabilities) an FSDP unit's sharded state is
not touched again once its forward is done, so ``offload_during_forward()``
registers a forward hook per unit that queues the unit's D2H copies right
then (on the D2H stream, after the kernels queued so far), while later units
compute. ``offload()`` then copies only what is left (units not run, packed
small storages, anything written since its copy) before re-pointing and
releasing everything at once, so the all-or-nothing and release rules are
unchanged. Writes after a unit's copy are caught by version counters, and any
optimizer step (a global step pre-hook) invalidates every early copy: a
DTensor's ``_foreach_`` updates bump no version counter. Storages holding an
inference tensor (no version counter: a rotary cache made under
``torch.inference_mode()``) are never copied early. Nor, with
``skip_unchanged``, are storages holding a baseline hash of [Note: unchanged
storages]: the offload hashes them and copies only those written (an early
copy of a frozen unit would move bytes the pool already holds).

[Note: one direction at a time]
Armed during a layer-wise reload, a unit's early D2H copies would share the
link with the reload's H2D copies still queued: on 2 H200s (Qwen2.5-7B) each
direction fell to 36-39 GB/s against about 55 GB/s alone, and the reload is
what the next units' forwards wait for. So a unit's D2H copies wait for the
last H2D copy the reload has issued by then (with the whole reload queued at
once, its end): the reload runs at its one-direction rate and the offload
follows it, still behind the forward's compute. While a thread still issues
the reload ([Note: copies issued off the caller's thread]) its end is not yet
known: a unit done then is deferred to the next unit's hook that finds the
reload issued (or to ``offload()``).
"""

from __future__ import annotations

import torch
from torch import nn

from .._api.hooks import EARLY as _during, Uncopyable
from .._transfer.batches import copy_out
from .._transfer.copies import transfer_range
from .._state.fsdp import lazy_init_done, versions
from .._host.layout import HostViews
from .._state.plan import Plan, storage_bytes
from .prefetch import Group, PrefetchRun, group_plan
from .step_hooks import GlobalStepHook
from .unchanged import UnchangedStorages
from .._transfer.streams import TransferStreams

__all__ = ["EarlyOffload"]

# Any optimizer step makes every armed offload's early copies stale.
_ARMED = GlobalStepHook()


class EarlyOffload:
    """An armed offload in pieces (see [Note: offload during forward]).

    Args:
        plan, views: the plan and its pool views (allocated: the hooks must not fail).
        sources: 1D uint8 device views of the plan's storages.
        groups: the plan's FSDP-unit groups (``unit`` not ``None``).
        streams: the device's streams.
        unchanged: the ferry's ``skip_unchanged``, or ``None``: storages holding its baseline
            at a unit's hook are not copied early.
        reload: the layer-wise reload under way when armed, or ``None``: a unit's D2H copies
            wait for the H2D copies it has issued by then (see [Note: one direction at a time]).
    """

    def __init__(self, plan: Plan, views: HostViews, sources: list[torch.Tensor], groups: list[Group],
                 streams: TransferStreams, unchanged: UnchangedStorages | None = None,
                 reload: PrefetchRun | None = None) -> None:
        self.plan, self.views, self.sources, self.groups, self.streams = plan, views, sources, groups, streams
        inference = {r.storage_index for r in plan.tensors if r.tensor.is_inference() or r.local.is_inference()}
        # Left to the final offload: packed storages (one DMA per chunk) and inference tensors.
        self._skip = views.packed | inference
        self._unchanged = unchanged
        self._reload = reload
        self._versions: dict[int, list[object]] = {}  # group index -> its tensors' versions at copy time
        self._copied: dict[int, list[int]] = {}  # group index -> the storages it copied early
        self._hooks: list = []
        self._deferred: list[int] = []  # units done while the reload was still being issued
        self.invalidated = False  # an optimizer stepped since: every early copy may be stale

    @classmethod
    def arm_for(cls, plan: Plan, views: HostViews, device_views: list[torch.Tensor] | None,
                streams: TransferStreams, unchanged: UnchangedStorages | None = None,
                reload: PrefetchRun | None = None) -> EarlyOffload | None:
        """Arms an offload in pieces over ``plan``'s FSDP units; ``None`` where it does not apply:
        state holding gradients (written by ``_foreach_`` ops, e.g. clipping, that no version
        counter sees), or no FSDP2 units (or before FSDP2's lazy init)."""
        if plan.has_grads:
            return None
        groups = [g for g in (group_plan(plan) if lazy_init_done(plan.modules) else []) if g.unit is not None]
        if not groups:
            return None
        if device_views is None:
            device_views = [storage_bytes(s, plan.device) for s in plan.storages]
        early = cls(plan, views, device_views, groups, streams, unchanged, reload)
        early.arm()
        return early

    def arm(self) -> None:
        for gi, g in enumerate(self.groups):
            self._hooks.append(g.unit.register_forward_hook(Uncopyable(self._hook(gi), _during)))
        _ARMED.add(id(self), self._invalidate)

    def disarm(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _ARMED.discard(id(self))

    def _invalidate(self) -> None:
        self.invalidated = True

    def _tensors(self, gi: int) -> list[torch.Tensor]:
        return [self.plan.tensors[i].tensor for i in self.groups[gi].tensors]

    def _hook(self, gi: int):
        @torch.inference_mode(False)  # see [Note: the ferry's bookkeeping outside inference mode] in _ferry/misuse
        def hook(module: nn.Module, args: object, output: object) -> None:
            if gi in self._versions or self.invalidated:
                return
            run = self._reload
            if run is not None and not run.finished and run.issuing:  # see [Note: one direction at a time]
                if gi not in self._deferred:
                    self._deferred.append(gi)
                return
            todo, self._deferred = [*self._deferred, gi], []
            for gj in todo:
                if gj not in self._versions:
                    self._copy_early(gj)

        return hook

    def _copy_early(self, gi: int) -> None:
        """Queues unit ``gi``'s D2H copies (after the kernels queued so far and the reload's H2D)."""
        g, plan, slots, sources = self.groups[gi], self.plan, self.views.slots, self.sources
        self._versions[gi] = versions(self._tensors(gi))
        held = self._unchanged
        todo = [si for si in g.storages if plan.nbytes[si] and si not in self._skip
                and not (held is not None and held.holds(si))]
        self._copied[gi] = todo
        with transfer_range("d2h", g.nbytes):
            if self.streams.is_cuda:
                d2h = self.streams.d2h
                d2h.wait_stream(self.streams.current())  # after the unit's kernels
                run = self._reload
                if run is not None and not run.finished and run.events and run.events[-1] is not None:
                    d2h.wait_event(run.events[-1])  # see [Note: one direction at a time]
            copy_out(self.streams, slots, sources, todo)

    @property
    def copied(self) -> set[int]:
        """Storage indices copied early: their slots were rewritten ([Note: unchanged storages])."""
        return {si for todo in self._copied.values() for si in todo}

    def take(self, plan: Plan, views: HostViews) -> set[int]:
        """Storage indices whose early copies still hold their current bytes (disarms).

        Nothing counts if the plan or the pool views changed since arming.
        """
        self.disarm()
        if plan is not self.plan or views is not self.views or self.invalidated:
            return set()
        valid: set[int] = set()
        for gi, recorded in self._versions.items():
            if versions(self._tensors(gi)) == recorded:
                valid.update(self._copied[gi])
        return valid
