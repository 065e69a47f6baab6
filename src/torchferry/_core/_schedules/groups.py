"""The groups of a layer-wise reload: one per FSDP unit in forward order, and the tail
([Note: prefetch reload] in ``prefetch``)."""

from __future__ import annotations

import dataclasses

from torch import nn

from .._state.fsdp import fsdp_modules, lazy_init_done, own_tensors, unit_key
from .._state.plan import Plan
from .._state.tree import members, module_tree

__all__ = ["TAIL_PIECE_BYTES", "Group", "group_plan", "prefetch_groups", "split_tail"]


@dataclasses.dataclass
class Group:
    """The storages and tensors one FSDP unit needs (``unit is None``: the tail group).

    Attributes:
        unit: the unit's first module (``None`` for the tail group).
        storages: indices into ``plan.storages``.
        tensors: indices into ``plan.tensors``.
        nbytes: bytes of the group's storages.
    """

    unit: nn.Module | None
    storages: list[int] = dataclasses.field(default_factory=list)
    tensors: list[int] = dataclasses.field(default_factory=list)
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
    seen_states: dict[int, int] = {}  # unit_key -> index in units
    alias: dict[int, int] = {}  # id(module) -> unit index, for grouped fully_shard([a, b])
    for m in plan.modules:
        for u in fsdp_modules(m):
            key = unit_key(u)
            if key not in seen_states:
                seen_states[key] = len(units)
                units.append(u)
            alias[id(u)] = seen_states[key]
    if not units:
        # Optimizer state alone: one tail group, completed by the step pre-hook,
        # so the forward before the step does not wait for it. With a module target
        # too (no FSDP units), a plain reload: its parameters must be back before
        # the forward, not at the step (a backward in between would drop their grads).
        if plan.optimizers and plan.storages and not plan.modules:
            return [Group(None, list(range(len(plan.storages))), list(range(len(plan.tensors))), plan.state_bytes)]
        return []
    owner: dict[int, int] = {}  # id(tensor) -> group index
    units_in_order = [m for root in plan.modules for m in fsdp_modules(root)]
    for u in reversed(units_in_order):  # innermost first claims
        gi = alias[id(u)]
        tree = module_tree(u)  # one walk of the unit's modules, as u.parameters() and u.buffers() make
        for _, p in members(tree, "_parameters"):
            owner.setdefault(id(p), gi)
            if p.grad is not None:
                owner.setdefault(id(p.grad), gi)
        for _, b in members(tree, "_buffers"):
            owner.setdefault(id(b), gi)
    tail = len(units)
    groups = [Group(u) for u in units] + [Group(None)]
    storage_group: dict[int, int] = {}
    for ref in plan.tensors:
        gi = owner.get(id(ref.tensor), tail)
        si = ref.storage_index
        storage_group[si] = min(storage_group.get(si, gi), gi)
    # A parameter and its grad must move together (the host impl links the host
    # grad, see [Note: parked TensorImpls]): unify their groups.
    tensor_of = {id(r.tensor): r for r in plan.tensors}
    for _ in range(2):
        for ref in plan.tensors:
            g = ref.tensor.grad if isinstance(ref.tensor, nn.Parameter) or ref.tensor.requires_grad else None
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


def prefetch_groups(plan: Plan) -> list[Group] | None:
    """The groups of a layer-wise reload of ``plan``, or ``None`` for a plain reload.

    Plain: state holding gradients (a ``zero_grad(set_to_none=False)`` before
    the forward would write their host copies with ``_foreach_zero_``, which
    DTensors do not count in their version counters), FSDP2 before its lazy
    init, or nothing to defer (no units and no optimizer state). The groups are
    kept with the plan while the module trees stay as they were ([Note: groups
    kept with the plan]).
    """
    if plan.has_grads:
        return None
    groups = _kept_groups(plan) if lazy_init_done(plan.modules) else []
    return groups if len(groups) > 1 or (groups and plan.optimizers) else None


# [Note: groups kept with the plan]
# group_plan() walks every unit's subtree (the root's is the whole model): with LoRA's adapters,
# verl's Qwen2.5-1.5B has about 2,300 modules, and the walk was the largest part of a layer-wise
# reload's host time (``groups.py group_plan`` under ``VERL_ACTOR_PROFILE=1``, benchmarks/README.md).
# A plan is kept across offloads while its tensors are the same objects ([Note: cached plan] in
# ``_state/plan.py``), and the groups depend only on the plan and on the module trees: which
# module holds which parameters and buffers, and which modules are FSDP units. So the groups are
# kept in ``plan.derived`` under the trees' signature (per module in pre-order: its id and its
# parameters' and buffers' ids; one walk, memoised for the call: [Note: module walks] in
# ``_state/tree.py``), with each group's unit as its index among the units (the plan holds no
# module strongly); any change to a tree (a module replaced, moved or wrapped, a parameter
# re-registered) changes the signature and the groups are made again. Each call gets fresh lists.
def _tree_signature(plan: Plan) -> tuple:
    return tuple((id(m), *(tuple(map(id, own.values())) for own in own_tensors(m)))
                 for root in plan.modules for _, m in module_tree(root))


def _kept_groups(plan: Plan) -> list[Group]:
    units = [u for root in plan.modules for u in fsdp_modules(root)]
    key = _tree_signature(plan)
    kept = plan.derived.get("groups")
    if not (isinstance(kept, tuple) and kept[0] == key):
        groups = group_plan(plan)
        pos = {id(u): i for i, u in enumerate(units)}
        kept = (key, [(None if g.unit is None else pos[id(g.unit)], g.storages, g.tensors, g.nbytes)
                      for g in groups])
        plan.derived["groups"] = kept
    return [Group(None if u is None else units[u], list(st), list(ts), n) for u, st, ts, n in kept[1]]


TAIL_PIECE_BYTES = 256 << 20  # a tail issued from the thread goes in groups of about this size (bytes)


def split_tail(plan: Plan, groups: list[Group]) -> list[Group]:
    """``groups`` with the tail group (optimizer state: no hook needs it before the step) cut into
    groups of about :data:`TAIL_PIECE_BYTES` by storage, so that the caller's thread issues only
    the first of them ([Note: copies issued off the caller's thread]). A tail holding a tensor
    that requires grad stays whole (a parameter and its grad move together)."""
    if not groups or groups[-1].unit is not None:
        return groups
    tail = groups[-1]
    if any(plan.tensors[ti].tensor.requires_grad for ti in tail.tensors) or tail.nbytes <= TAIL_PIECE_BYTES:
        return groups
    pieces: list[Group] = []
    piece_of: dict[int, Group] = {}
    for si in tail.storages:
        if not pieces or pieces[-1].nbytes >= TAIL_PIECE_BYTES:
            pieces.append(Group(None))
        pieces[-1].storages.append(si)
        pieces[-1].nbytes += plan.nbytes[si]
        piece_of[si] = pieces[-1]
    for ti in tail.tensors:
        piece_of[plan.tensors[ti].storage_index].tensors.append(ti)
    return groups[:-1] + pieces
