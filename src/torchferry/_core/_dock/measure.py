"""What a docked state set holds on its device now: the one place the dock reads a ferry's internals.

[Note: a set counts its bytes now]
``Ferry.state_bytes`` is the size of the ferry's last plan, made at its last
offload (or at its construction). State that grows while resident is not in
it until the next offload plans again: ``.grad``s kept by
``optimizer.zero_grad(set_to_none=False)`` (moved with the set from then on),
a parameter replaced by a larger one (an embedding resized, HF's
``resize_token_embeddings``), an optimizer's first step (its state created).
A dock that counted ``state_bytes`` counted 768 MiB while 1024 MiB were
allocated after ``use("rollout")`` on one H200, against an 896 MiB budget: the
room it made for the KV cache was not there. So a resident set counts the
unique storages on its device that its targets hold now, and those of the
ferry's last plan, at their sizes now (the plan keeps its storages until the
next offload: a replaced weight's old storage is still allocated), measured
by :func:`device_bytes` at every decision of the dock ([Note: dock
accounting] in ``engine``). A resident set without a plan (``forget_plan()``,
a replacement while offloaded, or the resident watch's ``forget_plan_of``
after gradients were dropped: [Note: state dropped while resident] in
``_ferry/watch.py``) counts the same walk plus FSDP2's sharded storages of its
modules (``sharded_storages``), where such a unit left unsharded keeps them:
counting ``max(device bytes, state_bytes)`` then kept the dropped gradients'
bytes counted, and a dock evicted a set to make room that was there
(``tests/cpu/test_dock_accounting.py::test_a_set_whose_plan_the_watch_forgot_counts_what_it_holds``).
A set on the host counts ``state_bytes``: the offload planned it, so it is what
the reload brings back (and what an offload in flight still holds on the
device). Not counted: a reload arena's filler ([Note: reload arena]), at most
one segment rounding (2 MiB) beside the state. The walk costs what the fingerprint of
[Note: cached plan] costs (which every offload takes): 20-35 ms for 8192
tensors (2048 Linears with grads) on a 2-core CI host; Qwen2.5-7B's 339
parameters with grads and AdamW state are about 1,400 tensors, 3-6 ms at that
rate. A ``use()`` walks each resident set about three times (at its start, at
its ``release()``, at a ``prefetch()`` in it).

[Note: state loaded behind the dock's back]
An evicted set counts ``state_bytes``, but its targets can be given new state on the device
while it is on the host: verl's ``load_checkpoint`` reloads the model (a docked load) and then
``optimizer.load_state_dict`` places the loaded AdamW state on its parameters' device, while
the optimizer's set was evicted for the rollout. The dock counted it evicted: 12.61 MB held
against an 8.47 MB budget at the next KV-cache wake. So every decision first
looks at each evicted set (:func:`appeared_bytes`): if its targets hold other tensors than at
its offload ([Note: state replaced while offloaded] in ``_ferry.reconcile``) and some of them
are on its device outside any host pool, the dock takes the set in as resident
(``ferry.reload()``, which reconciles: what is on the device stays, nothing is copied back
that was replaced) and counts it as it is from then; the decision then evicts it, or others,
as the budget needs. The targets' ``load_state_dict`` post-hooks ask for that decision right
after a load (``DockEngine.add_set``). A set whose replacements are on the host only
(``optimizer.load_state_dict`` while the model was offloaded too) holds nothing on the device
and is left to its next load.

[Note: kept storages count once]
An evicted set still holds on the device the storages its offload kept for a tensor the ferry does not know
(:func:`kept_storages`, from ``Offloaded.kept``). Two sets over one storage the caller holds (``Ferry(b[:n])``
and ``Ferry(b[n:])``) each keep it whole: summed per set, the dock counted it twice, 4 units held for 2 on
the device (``tests/cpu/test_dock_kept.py::test_a_storage_kept_for_two_sets_counts_once``). So the dock's
held bytes (``schedule.held``) take the kept storages of all evicted sets by ``StorageImpl`` address, each
once, and not one that a resident set counts already (:func:`measured` records the storages a resident set's
bytes cover). A set coming back adds its bytes less its own kept storages (``DockEngine.incoming``): a
prefetch of such a set counted them twice, kept and incoming, and never loaded
(``::test_an_evicted_set_with_kept_storages_is_prefetched``). Resident sets sharing a storage count it once
too: counted each, two halves of one tensor the caller keeps made a dock evict one half (which frees nothing)
and then go over its budget by what it loaded (``tests/cpu/test_dock_kept.py``).

[Note: an eviction frees what it releases]
A resident set whose storages a tensor the ferry does not know shares frees, when evicted, only the rest:
with all of them kept it frees nothing, and a ``use()`` that chose it by its counted bytes stayed over the
budget until the alias went. So the dock asks, for each candidate, what its offload would keep now
(:func:`eviction_keeps`: ``shared_storages`` of its last plan, the offload's own first question) and counts
the bytes its eviction would free (``DockEngine.freed``: the held bytes now less those after it); a set that
frees nothing is no victim, and when the others cannot free enough the ``use()`` raises as for any room held
by what is in use, naming what an eviction would leave
(``tests/cpu/test_dock_kept.py::test_a_set_whose_eviction_frees_nothing_is_not_chosen``). Without a plan
nothing is known kept. A schedule's cost of a victim stays its counted bytes: its reload copies them all.

A public ``Ferry`` property would be the better home for :func:`device_bytes`;
until there is one, this module is the only one of the dock that reads a
ferry's internals (``Ferry._targets``, ``Ferry._set``, ``Ferry._offloaded``, ``Ferry._closed``). The plan is
what tells where FSDP2 keeps the sharded storages of a unit left unsharded
(the root after a forward), so ``Dock.add`` gives a resident ferry without one
a plan (:func:`ensure_plan`). Without it, a tiny GRPO run counted the actor
128 bytes below the reference (its root norm's sharded storage unseen), and
the schedule, the two costs no longer equal, chose to evict the actor (in
use, so no prefetch) instead of the reference.
"""

from __future__ import annotations

import torch

from collections.abc import Iterable

from .._ferry.ferry import Ferry
from .first_step import first_step_bytes
from .._state.fsdp import local_of, resync_sharded_data, sharded_data_left_behind, sharded_storages, storage_key
from .._state.holders import shared_storages
from .._state.host_blocks import in_host_pool
from .._api.residency import Residency
from .._state.targets import walk

__all__ = [
    "appeared_bytes", "counted_bytes", "device_bytes", "device_storages", "ensure_plan", "eviction_keeps",
    "is_closed", "kept_bytes", "kept_storages", "measured", "objects_bytes", "replan_if_moved", "targets_of",
    "tensors_of",
]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _unique_storages(storages: Iterable[torch.UntypedStorage], dev: torch.device, *,
                     pool: bool = True) -> dict[int, int]:
    """The unique storages on ``dev`` (by ``StorageImpl`` identity) and their bytes now; ``pool=False``: not
    those lying in a host pool (an offloaded tensor's view, on a CPU device)."""
    seen: dict[int, int] = {}
    skipped: set[int] = set()
    for st in storages:
        key = storage_key(st)
        if key in seen or key in skipped or not _same_device(st.device, dev):
            continue
        if not pool and st.nbytes() and in_host_pool(st.data_ptr()):
            skipped.add(key)
            continue
        seen[key] = st.nbytes()
    return seen


def _unique_bytes(storages: Iterable[torch.UntypedStorage], dev: torch.device, *, pool: bool = True) -> int:
    """Bytes of :func:`_unique_storages`."""
    return sum(_unique_storages(storages, dev, pool=pool).values())


def tensors_of(ferry: Ferry) -> list[torch.Tensor]:
    """The tensor objects the ferry's targets hold now (parameters, ``.grad``s, optimizer state, buffers)."""
    return [t for _, t in walk(targets_of(ferry))]


def targets_of(ferry: Ferry) -> list[object]:
    """The ferry's live targets (modules, optimizers, tensors); ``[]`` once a module or optimizer was collected."""
    try:
        return ferry._targets.live()
    except RuntimeError:  # a module or optimizer target was collected
        return []


def device_storages(ferry: Ferry) -> dict[int, int]:
    """The unique storages on the ferry's device that its targets and its last plan hold now: ``StorageImpl``
    address -> bytes now (see :func:`device_bytes`). Without a plan, FSDP2's sharded storages of a unit left
    unsharded too ([Note: a set counts its bytes now])."""
    targets = targets_of(ferry)
    storages = [local_of(t).untyped_storage() for _, t in walk(targets)]
    cache = ferry._set.cache
    if cache is not None:
        storages.extend(cache.plan.storages)
    else:
        for m in targets:
            if isinstance(m, torch.nn.Module):
                storages.extend(sharded_storages(m))
    return _unique_storages(storages, ferry.device)


def device_bytes(ferry: Ferry) -> int:
    """Bytes of the unique storages on the ferry's device that its targets and its last plan hold now.

    Storages are told apart by identity (``StorageImpl``), as the planner does,
    so tied weights and views count once; a storage released by an offload
    counts 0. Tensors of the targets elsewhere (AdamW's ``step`` on the host
    for a GPU ferry) are not counted. On a CPU ferry an offloaded set's host
    views are CPU tensors too: call it for resident sets only (as
    :func:`counted_bytes` does).
    """
    return sum(device_storages(ferry).values())


def objects_bytes(objects: Iterable[object], device: torch.device) -> int:
    """Bytes of the unique storages on ``device`` that modules, optimizers and tensors hold now, nothing of
    a ferry's: what a framework keeps resident beside the sets (``Dock.reserve``). An FSDP2 unit left
    unsharded counts its sharded storages too; offloaded tensors (host pool views) count 0."""
    objs = list(objects)
    storages = [local_of(t).untyped_storage() for _, t in walk(objs)]
    for m in objs:
        if isinstance(m, torch.nn.Module):
            storages.extend(sharded_storages(m))
    return _unique_bytes(storages, device, pool=False)


def appeared_bytes(ferry: Ferry) -> int:
    """Bytes an offloaded set's targets hold on its device outside any host pool now: state loaded behind
    the dock's back ([Note: state loaded behind the dock's back]); 0 for a resident or unchanged set."""
    off = ferry._offloaded
    if ferry._closed or off is None or ferry._prefetch is not None or not targets_of(ferry):
        return 0  # a set whose objects were collected holds nothing of the trainer's (a reading must not raise)
    if not ferry._set.replaced(off):
        return 0
    storages = [local_of(t).untyped_storage() for _, t in walk(targets_of(ferry))]
    return _unique_bytes(storages, ferry.device, pool=False)


def kept_storages(ferry: Ferry) -> dict[int, int]:
    """The storages an evicted set still holds on its device (``StorageImpl`` address -> bytes): those its
    offload kept allocated because a tensor the ferry does not know shares them ([Note: a storage shared with
    a tensor the ferry does not know] in ``_state/holders.py``), from the indices the offload recorded
    (``Offloaded.kept``); empty for a resident set. Two sets over one storage keep it once ([Note: kept
    storages count once])."""
    off = ferry._offloaded
    if ferry._closed or off is None or not off.kept:
        return {}
    return {storage_key(off.plan.storages[si]): off.plan.nbytes[si] for si in off.kept}


def kept_bytes(ferry: Ferry) -> int:
    """Bytes of :func:`kept_storages`: what an evicted set still holds on its device; 0 for a resident set."""
    return sum(kept_storages(ferry).values())


def eviction_keeps(ferry: Ferry) -> dict[int, int]:
    """The storages an offload of the resident set would keep on its device now (``StorageImpl`` address ->
    bytes): those of its last plan that a tensor the ferry does not know shares (``shared_storages``, what
    the offload itself asks first). Empty without a plan (the offload plans again: nothing is known kept).
    See [Note: an eviction frees what it releases]."""
    cache = ferry._set.cache
    if ferry._closed or cache is None or ferry.residency.on_host:
        return {}
    plan = cache.plan
    if any(st.nbytes() != n for st, n in zip(plan.storages, plan.nbytes, strict=True)):
        return {}  # some not allocated at their size (a layer-wise reload under way): not an offload's case
    return {storage_key(plan.storages[si]): plan.nbytes[si] for si in shared_storages(plan)}


def is_closed(ferry: Ferry) -> bool:
    """Whether ``ferry.close()`` was called."""
    return ferry._closed


def ensure_plan(ferry: Ferry) -> None:
    """Gives a resident ferry that has no plan yet one, so that :func:`device_bytes` sees all it holds.

    An FSDP2 unit left unsharded (the root after a forward; every unit with
    ``reshard_after_forward=False``) registers its unsharded parameters: its
    sharded storages are reachable through the plan only. Planned by the
    public ``reserve_host(background=True)``, which also starts allocating
    the host pool that the set's first eviction needs (what ``pin_ahead``
    does by default anyway).

    Raises:
        HostBudgetError, RuntimeError: as ``Ferry.reserve_host``.
    """
    if ferry._set.cache is None and not ferry.residency.on_host:
        ferry.reserve_host(background=True)


def replan_if_moved(ferry: Ferry) -> None:
    """Re-points and plans again a resident set whose FSDP2 shard buffers a submodule's move left over old
    storages ([Note: FSDP2's shard buffer left by a submodule's move] in ``_state/fsdp.py``).

    A dock keeps a set resident where the framework would have offloaded it, and the framework's own
    offload (``model.cpu()`` on the root unit) is what re-pointed those buffers: without this, FSDP2
    all-gathered the old bytes from then on (training diverged from the framework's own after the next
    optimizer step) and the old plan kept the old storages allocated
    (``tests/cpu/test_dock_submodule_move.py``).

    Raises:
        HostBudgetError, RuntimeError: as ``Ferry.reserve_host``.
    """
    if ferry.residency is not Residency.DEVICE:
        return
    modules = [t for t in targets_of(ferry) if isinstance(t, torch.nn.Module)]
    if sharded_data_left_behind(modules):
        resync_sharded_data(modules)
        ferry.reserve_host(background=True)  # a new plan: the old one's storages go


def first_step_projection(ferry: Ferry) -> int:
    """Bytes the first ``step()`` of the ferry's optimizers without state will allocate on its device
    ([Note: first-step state] in ``first_step``): counted with the set before they exist, so the room a
    use makes for it is there when the step runs (an optimizer of unknown layout counts 0 until then)."""
    return sum(first_step_bytes(t, ferry.device) or 0 for t in targets_of(ferry)
               if isinstance(t, torch.optim.Optimizer) and not t.state)


def measured(ferry: Ferry) -> tuple[int, dict[int, int]]:
    """:func:`counted_bytes` and the storages it counts on the device (``StorageImpl`` address -> bytes; none
    for a set on the host), so that a storage an evicted set kept, or another resident set counts, is not
    counted again ([Note: kept storages count once])."""
    r = ferry.residency
    ahead = first_step_projection(ferry)
    if r.on_host:
        return ferry.state_bytes + ahead, {}
    now = device_storages(ferry)
    total = sum(now.values())
    if r is Residency.PREFETCHING:
        total = max(total, ferry.state_bytes)
    return total + ahead, dict(now)


def counted_bytes(ferry: Ferry) -> int:
    """Bytes a dock counts for the ferry's set now (see [Note: a set counts its bytes now]).

    Resident: :func:`device_bytes` (without a plan, after ``forget_plan()``, the resident watch's
    ``forget_plan_of`` or a replacement while offloaded, FSDP2's sharded storages of a unit left unsharded
    are looked up in its FSDP2 state: what is on the device, not the last plan's ``state_bytes``); at least
    ``state_bytes`` while a layer-wise reload is under way (``PREFETCHING``: the units not yet arrived hold
    0 bytes now). On the host: ``state_bytes``. Both with :func:`first_step_projection` for an optimizer that
    has not stepped yet.
    """
    return measured(ferry)[0]
