"""Holders of the device storages an offload would release: keeping one a tensor the ferry does not know views.

[Note: a storage shared with a tensor the ferry does not know]
An offload releases each device storage whole (``resize_(0)``) and re-points
only the tensors it knows. Any other tensor over that storage (a user's
``v = model.weight[0]``, ``w = p.detach()``, ``p.data`` kept, the detached
tensors of ``sd = model.state_dict()``, the base ``b`` of
``Ferry(b[10:20])``) kept its sizes over an empty storage, and most kernels
do not check: ``b = torch.randn(100); Ferry(b[10:20]).offload(); b.sum()``
read released memory and crashed the interpreter
(``tests/cpu/test_shared_storage.py`` reproduces it).

So such a storage is kept, as ``model.to("cpu")`` keeps the device storage
an alias holds: before anything is copied or re-pointed,
:func:`shared_storages` counts the holders of each storage (``StorageImpl``'s
use count: one per tensor impl over it, one per Python storage object) and
returns those with more than the holders it can account for. The offload
copies them to the pool and re-points the known tensors as usual (all or
nothing, unchanged), but does not release them (``release()`` in
``_transfer/release.py``, ``ReleaseSchedule.hold`` in
``_schedules/release.py``): the alias stays readable, with the bytes of the
offload, and the device memory stays allocated (logged once per ferry, naming
the tensors and bytes). The reload finds such a storage allocated at its size
and does not ``resize_`` it (``issue_h2d``, the layer-wise reload's
``_allocate_group``); its H2D copy writes the pool's bytes into it, so the
known tensors and the alias see the same bytes again, and an undo does not
free it. What is written through the alias while offloaded is overwritten by
the reload. On a GPU the caller's stream waits for the offload's copies
before such a storage is left to it, so that a write through the alias after
``offload()`` cannot reach the pool.

It accounts for:

- the plan's tensors (a DTensor's local shard), each impl once;
- the ferry's own 1D uint8 views of the storage (``PlanCache.device_views``, and
  those of an old cache still alive: ``own_views``);
- FSDP2's ``_sharded_param_data`` and the padded tensor it views (``fsdp_held``);
- the base of a known view (``b`` of ``b[10:20]``) when it is a known tensor
  or one of FSDP2's; when a Python reference holds it otherwise (the user's
  ``b``), it is a holder the ferry does not know, and counted as one.

What it cannot account for, it releases as before: a storage one of whose
known tensors views a base that only C++ holds and that is not FSDP2's (DDP's
gradient buckets with ``gradient_as_bucket_view``, a view of a temporary:
``Ferry(torch.randn(100)[10:20])``), whose owner may hold more views the
ferry cannot see; and FSDP1's flat parameters (``fsdp1_flat_storages``),
whose flat tensor, local shard and original parameters' views FSDP1 keeps in
places that vary with its options. Counting those would keep them at every
offload: the memory an offload exists to free. A Python ``UntypedStorage``
object (``t.untyped_storage()``) is not counted: its reads are
bounds-checked. Tensors saved by a pending autograd graph are holders too (a
view such as ``w.t()``, saved for backward): their storage is kept, and
backward reads the bytes of the offload. A false count costs only device
memory not freed by that offload.
"""

from __future__ import annotations

import torch
from torch import nn

from .fsdp import base_held_by_python, fsdp_held, storage_key, storage_refs, view_base
from .fsdp1 import fsdp1_flat_storages
from .plan import Plan, own_views

__all__ = ["shared_storages"]


def shared_storages(plan: Plan, modules: list[nn.Module] | None = None) -> frozenset[int]:
    """The indices of ``plan``'s storages held by a tensor the ferry does not know: an offload
    copies them but keeps them allocated.

    See [Note: a storage shared with a tensor the ferry does not know].

    Args:
        plan: what the offload would release.
        modules: the plan's modules (default ``plan.modules``), for FSDP1/FSDP2 internals.
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
    skip = fsdp1_flat_storages(modules) if modules else set()
    shared: set[int] = set()
    for si, objs in enumerate(known):
        if storages[si].nbytes() == 0 or storage_key(storages[si]) in skip:
            continue
        refs = storage_refs(storages[si])
        if refs <= len(objs):  # every holder known (each object one impl over it): no base to look for
            continue
        for t in list(objs.values()):
            base = view_base(t)
            if base is None or id(base) in objs:
                continue
            if id(base) in accounted:
                objs[id(base)] = base
                continue
            del base  # a reference here would count as the user's
            if base_held_by_python(t):
                shared.add(si)  # the user's base (b of b[10:20]): a holder the ferry does not know
            break  # a base only C++ holds, not FSDP2's: its owner's other holders are not countable
        else:
            if refs > len(objs):
                shared.add(si)
    return frozenset(shared)
