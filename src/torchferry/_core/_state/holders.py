"""Holders of the device storages an offload would release: refusing one the ferry does not know.

[Note: a storage shared with a tensor the ferry does not know]
An offload releases each device storage whole (``resize_(0)``) and re-points
only the tensors it knows. Any other tensor over that storage (a user's
``v = model.weight[0]``, ``w = p.detach()``, ``p.data`` kept, the base ``b``
of ``Ferry(b[10:20])``) keeps its sizes over an empty storage, and most
kernels do not check: ``v.sum()`` read released memory and crashed the
interpreter (found by a breaker helper). So before anything is copied or
re-pointed, :func:`refuse_shared` counts the holders of each storage
(``StorageImpl``'s use count: one per tensor impl over it, one per Python
storage object) and refuses, naming a tensor of the storage, when there are
more than the holders it can account for:

- the plan's tensors (a DTensor's local shard), each impl once;
- the ferry's own 1D uint8 views of the storage (``PlanCache.device_views``, and
  those of an old cache still alive: ``own_views``);
- FSDP2's ``_sharded_param_data`` and the padded tensor it views (``fsdp_held``);
- the base of a known view (``b`` of ``b[10:20]``) when it is a known tensor
  or one of FSDP2's; when a Python reference holds it otherwise (the user's
  ``b``), it is a holder the ferry does not know, and counted as one.

What it cannot account for, it leaves alone (never a false refusal): a
storage one of whose known tensors views a base that only C++ holds and that
is not FSDP2's (DDP's gradient buckets with ``gradient_as_bucket_view``, a
view of a temporary: ``Ferry(torch.randn(100)[10:20])``), whose owner may
hold more views the ferry cannot see; and FSDP1's flat parameters
(``fsdp1_flat_storages``), whose flat tensor, local shard and original
parameters' views FSDP1 keeps in places that vary with its options; and
bytes the user gave while offloaded (``p.data = t``, ``StateSet.given``),
whose giver may still hold ``t`` (plain PyTorch allows it, and the reconcile
tests do it). The cached plan's fast path checks too, before its copies. A Python
``UntypedStorage`` object (``t.untyped_storage()``) is not counted: its
reads are bounds-checked. Tensors saved by a pending autograd graph are
holders too (a view such as ``w.t()``, saved for backward): the offload is
refused until the graph is run or dropped, as backward would read the
released memory.
"""

from __future__ import annotations

import torch
from torch import nn

from .fsdp import base_held_by_python, fsdp1_flat_storages, fsdp_held, storage_key, storage_refs
from .plan import Plan, own_views

__all__ = ["refuse_shared", "shared_storage"]


def shared_storage(plan: Plan, modules: list[nn.Module] | None = None, skip: set[int] | frozenset[int] = frozenset()
                   ) -> int | None:
    """The index of a storage of ``plan`` held by a tensor the ferry does not know, else ``None``.

    See [Note: a storage shared with a tensor the ferry does not know].

    Args:
        plan: what the offload would release.
        modules: the plan's modules (default ``plan.modules``), for FSDP1/FSDP2 internals.
        skip: :func:`storage_key` of storages not checked (bytes the user gave while offloaded).
    """
    storages = plan.storages
    index = {storage_key(st): si for si, st in enumerate(storages)}
    known: list[dict[int, torch.Tensor]] = [{} for _ in storages]  # per storage: id -> tensor object
    for si, st in enumerate(storages):
        for v in own_views(storage_key(st)):
            known[si][id(v)] = v
    modules = plan.modules if modules is None else modules
    accounted: set[int] = set()  # ids of the FSDP2 tensors (a known view's base among them counts)
    if modules:
        for held in fsdp_held(modules):
            si = index.get(storage_key(held.untyped_storage()))
            if si is not None:
                known[si][id(held)] = held
                accounted.add(id(held))
    for r in plan.tensors:
        local = r.local
        known[r.storage_index][id(local)] = local
    skip = set(skip) | (fsdp1_flat_storages(modules) if modules else set())
    for si, objs in enumerate(known):
        if storages[si].nbytes() == 0 or storage_key(storages[si]) in skip:
            continue
        for t in list(objs.values()):
            if not t._is_view():
                continue
            base = t._base
            if base is None or id(base) in objs:
                continue
            if id(base) in accounted:
                objs[id(base)] = base
                continue
            del base  # a reference here would count as the user's
            if base_held_by_python(t):
                return si  # the user's base (b of b[10:20]): a holder the ferry does not know
            break  # a base only C++ holds, not FSDP2's: its owner's other holders are not countable
        else:
            if storage_refs(storages[si]) > len(objs):
                return si
    return None


def refuse_shared(plan: Plan, modules: list[nn.Module] | None = None, skip: set[int] | frozenset[int] = frozenset()
                  ) -> None:
    """Refuses an offload that would release a storage a tensor the ferry does not know still views
    (arguments as for :func:`shared_storage`).

    Raises:
        RuntimeError: naming a known tensor of that storage; nothing was copied, re-pointed or
            released ([Note: a storage shared with a tensor the ferry does not know]).
    """
    si = shared_storage(plan, modules, skip)
    if si is None:
        return
    name = next(r.name for r in plan.tensors if r.storage_index == si)
    raise RuntimeError(
        f"torchferry: cannot offload {name}: its storage is shared with a tensor torchferry does not manage "
        "(a view, slice, .data or .detach() of it held elsewhere, or the base it was sliced from), which would "
        "read released memory once offloaded; nothing was moved. Drop that tensor (del it) or pass it to "
        "Ferry(...) too, then offload again"
    )
