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
prefetch from there, ``_states_to_forward_prefetch``), re-points the unit's
tensors at their device storages, and issues further groups to keep the
look-ahead. The tail group is completed by a step pre-hook of each optimizer
target, so ``optimizer.step()`` cannot run on state still in flight. When the
last group is resident the hooks are removed. Until its unit runs, a group's
tensors stay CPU tensors viewing the pool (still correct, just not moved yet);
``ferry.reload()`` without prefetch completes everything at once.

Between ``reload(prefetch=...)`` and a unit's forward its tensors are host
tensors. In-place writes to them there (``p.mul_(2)``) are not lost: version
counters are recorded when the copies are issued and a group written since is
copied again when made resident. Writes the counters do not see are: the
``_foreach_`` ops on DTensors, writes through ``p.data`` or through views
taken before the offload. So: state holding gradients is reloaded plainly
(``zero_grad(set_to_none=False)`` before the forward uses ``_foreach_zero_``),
every optimizer step first completes every prefetch under way (a global step
pre-hook while one is), and you should not write parameters between the
reload and the forward otherwise. FSDP2's ``unshard()`` called by hand there
would read a unit not yet resident.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._plan import Plan, fsdp_modules

__all__ = ["Group", "Prefetch", "group_plan"]


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
        if self.lookahead_bytes is not None and self.lookahead_bytes < 0:
            raise ValueError(f"lookahead_bytes must be >= 0 or None, got {self.lookahead_bytes}")


@dataclasses.dataclass
class Group:
    """The storages and tensors one FSDP unit needs (``unit is None``: the tail group).

    ``units`` lists every module of the unit (several for ``fully_shard([a, b])``).
    """

    unit: nn.Module | None
    storages: list[int] = dataclasses.field(default_factory=list)  # indices into plan.storages
    tensors: list[int] = dataclasses.field(default_factory=list)  # indices into plan.tensors
    nbytes: int = 0


def group_plan(plan: Plan) -> list[Group]:
    """Groups a plan's storages by FSDP unit, in forward order, tail group last.

    A parameter belongs to the innermost unit that holds it (as in FSDP2); its
    ``.grad`` goes with it; buffers likewise. A storage goes to the first
    group (in forward order) of any tensor viewing it. Returns only non-empty
    groups; without FSDP units, one tail group if there are optimizer targets
    (else an empty list: a plain reload).
    """
    units: list[nn.Module] = []
    seen_states: dict[int, int] = {}  # id(FSDPState) -> index in units
    alias: dict[int, int] = {}  # id(module) -> unit index, for grouped fully_shard([a, b])
    for m in plan.modules:
        for u in fsdp_modules(m):
            key = id(u._get_fsdp_state())
            if key not in seen_states:
                seen_states[key] = len(units)
                units.append(u)
            alias[id(u)] = seen_states[key]
    if not units:
        # Optimizer state alone: one tail group, completed by the step pre-hook,
        # so the forward before the step does not wait for it.
        if plan.optimizers and plan.storages:
            tail = Group(None, list(range(len(plan.storages))), list(range(len(plan.tensors))), plan.state_bytes)
            return [tail]
        return []
    owner: dict[int, int] = {}  # id(tensor) -> group index
    members = [m for root in plan.modules for m in fsdp_modules(root)]
    for u in reversed(members):  # innermost first claims
        gi = alias[id(u)]
        for p in u.parameters():
            owner.setdefault(id(p), gi)
            if p.grad is not None:
                owner.setdefault(id(p.grad), gi)
        for b in u.buffers():
            owner.setdefault(id(b), gi)
    tail = len(units)
    groups = [Group(u) for u in units] + [Group(None)]
    storage_group: dict[int, int] = {}
    for ti, ref in enumerate(plan.tensors):
        gi = owner.get(id(ref.tensor), tail)
        si = ref.storage_index
        storage_group[si] = min(storage_group.get(si, gi), gi)
    # A parameter and its grad must move together (the grad link of a DTensor
    # parameter is re-made in the same re-pointing batch): unify their groups.
    tensor_of = {id(r.tensor): r for r in plan.tensors}
    for _ in range(2):
        for ref in plan.tensors:
            g = getattr(ref.tensor, "grad", None) if ref.tensor.requires_grad else None
            if g is not None and id(g) in tensor_of:
                a, b = ref.storage_index, tensor_of[id(g)].storage_index
                low = min(storage_group[a], storage_group[b])
                storage_group[a] = storage_group[b] = low
    for ti, ref in enumerate(plan.tensors):
        groups[storage_group[ref.storage_index]].tensors.append(ti)
    for si, gi in sorted(storage_group.items()):
        groups[gi].storages.append(si)
        groups[gi].nbytes += plan.nbytes[si]
    return [g for g in groups if g.storages or g.tensors]


def forward_prefetch_units(unit: nn.Module) -> list[nn.Module]:
    """The units whose all-gather FSDP2 issues from ``unit``'s pre-forward (explicit prefetch)."""
    try:
        state = unit._get_fsdp_state()
    except AttributeError:
        return []
    out: list[nn.Module] = []
    for other in getattr(state, "_states_to_forward_prefetch", []) or []:
        out.extend(getattr(other, "_modules", ()) or ())  # the FSDPState's modules
        for group in ([getattr(other, "_fsdp_param_group", None)]
                      + list(getattr(other, "_fsdp_param_groups", []) or [])):
            if group is not None:
                out.extend(getattr(group, "modules", ()) or ())
    return out


def fsdp_comm_streams(plan: Plan) -> list[torch.cuda.Stream]:
    """FSDP2's all-gather streams for the plan's units, each once.

    FSDP2 makes them wait for the current stream once per iteration, in the
    root's pre-forward (or for its post-optimizer event instead), and then
    lets each unit's all-gather copy-in read the sharded parameters without
    waiting for the current stream again (implicit prefetching,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``,
    ``_root_pre_forward``). A unit's H2D copies must therefore be waited for
    on these streams too, not only on the current stream (measured on 2
    H200s: without it, a unit's all-gather read its shard before its copy
    landed and the loss was NaN).
    """
    out: dict[int, torch.cuda.Stream] = {}
    for m in plan.modules:
        for unit in fsdp_modules(m):
            ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)
            for name in ("all_gather_copy_in_stream", "all_gather_stream"):
                stream = getattr(ctx, name, None)
                if stream is not None:
                    out.setdefault(id(stream), stream)
    return list(out.values())


def lazy_init_done(plan: Plan) -> bool:
    """FSDP2 initialises lazily at the first forward (and may re-pad shards then): prefetch
    only after it, when a unit's shards are left as they are."""
    for m in plan.modules:
        for unit in fsdp_modules(m):
            state = unit._get_fsdp_state()
            if getattr(state, "_is_root", None) is None:
                return False
    return True
