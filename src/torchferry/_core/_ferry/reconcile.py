"""State replaced while offloaded: bring back what is still held, move the replacements.

[Note: state replaced while offloaded]
A checkpoint resume while offloaded (``optimizer.load_state_dict``, verl's
``load_checkpoint`` with the optimizer offloaded) puts new tensors where the
ferry's were: new CPU state tensors (PyTorch casts to the parameter's device,
which is the CPU then), the old ones dead. ``offload()`` and ``reload()``
while offloaded compare the ids of the tensors the targets hold with those at
the offload (``reload()`` while its copies are in flight); on a difference
the ferry reconciles: it brings back only the storages of tensors still
held (by the targets, or by an FSDP2 unit's ``FSDPParam``, which all-gathers
from its own parameter after the module was given another:
``tests/cpu/test_integration_fsdp2.py::test_an_fsdp2_parameter_replaced_while_offloaded_leaves_fsdp2s_own_whole``),
never re-allocates the dead ones, moves each replacement on the host to
the device where its predecessor (same name) lived (optimizer state without a
predecessor: floating state other than ``step``, as PyTorch's own placement
rule), and forgets its plan. The state is then resident; an ``offload()``
that found the change offloads everything again (one extra round trip, only
after a replacement). Before it, the second offload moved 0 of 12 new tensors
and the reload re-allocated the dead ones
(``tests/cpu/test_reconcile.py::test_optimizer_load_state_dict_while_offloaded_then_offload_moves_what_is_there_now``).

[Note: storage swapped while offloaded]
The same object can be given other bytes while offloaded: ``p.data = t``,
``p.set_(t)``, ``p.grad.data = g``. Ids do not change (and ``.data =``
bumps no version counter), so a reload that only compared ids brought the
pool's bytes back into the object and silently undid the assignment
(``tests/cpu/test_reconcile.py::test_storage_swapped_while_offloaded_is_kept``).
So every check above also compares each object's local
tensor with the host view the offload gave it (address, shape, dtype, read
once per check: about 0.3 us a tensor). A tensor that moved away is
reconciled like a replacement, keeping its object and its parked device impl
(autograd hooks, grad accumulator): its slot is not brought back, the parked
impl comes back and then takes the assigned tensor, moved to the device
(``.data =`` on the same device keeps the grad accumulator).
"""

from __future__ import annotations

import functools
import logging

import torch

from .._transfer.copies import undo_allocations
from .._transfer.h2d import issue_h2d
from .._transfer.signals import uninterruptible
from .._state.fsdp import local_of, repoint_sharded_data, sharded_params, storage_key
from .._state.host_blocks import in_host_pool
from .._host.layout import HostViews
from .._state.plan import Plan
from .._state.parking import Parking, move_to, moved
from .._transfer.streams import TransferStreams
from .._state.targets import describe, walk

__all__ = ["moved_away", "reconcile"]

logger = logging.getLogger("torchferry")


def _placed_by_optimizer(targets: list[object], where: tuple, t: torch.Tensor) -> bool:
    """PyTorch's placement of optimizer state without a predecessor: floating state other than
    ``step`` lives on its parameter's device (``Optimizer._process_value_according_to_param_policy``)."""
    if not isinstance(targets[where[0]], torch.optim.Optimizer):
        return False
    return where[3] != "step" and (t.is_floating_point() or t.is_complex())


def moved_away(views: HostViews, parking: Parking) -> list[int]:
    """Indices of the offloaded tensors given other bytes since the offload ([Note: storage
    swapped while offloaded])."""
    return views.moved_away(parking.locals())


def _onto_device(new: torch.Tensor, plan: Plan, views: HostViews,
                 on_device: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """The tensor an object given ``new`` while offloaded holds after the reload: a view of the
    reloaded storage where ``new`` views a slot of this pool (``p.data = q.data`` ties ``p`` to
    ``q``), ``new`` itself where it is on the device already, else a view of a device copy of
    its whole storage (one copy per storage, so tensors assigned views of one stay tied)."""
    st = new.untyped_storage()
    si = views.slot_of(st)
    if si is not None:
        target = plan.storages[si]
    elif new.device == plan.device and not (new.numel() and in_host_pool(new.data_ptr())):
        return new
    else:
        target = on_device.get(storage_key(st))
        if target is None:
            whole = torch.empty(0, dtype=torch.uint8, device=new.device).set_(st)
            target = on_device[storage_key(st)] = whole.to(plan.device, copy=True).untyped_storage()
    out = torch.empty(0, dtype=new.dtype, device=plan.device)
    return out.set_(target, new.storage_offset(), new.shape, new.stride())


def reconcile(plan: Plan, views: HostViews, parking: Parking, targets: list[object], streams: TransferStreams,
              device_views: list[torch.Tensor] | None, after: torch.cuda.Event | None) -> int:
    """Makes the state the targets hold now resident (synchronously), all or nothing.

    Everything that allocates runs first (the storages still held, device copies of the
    replacements and of the tensors assigned while offloaded); only then are tensor objects
    re-pointed, each step undone in reverse if a later one fails ([Note: all or nothing]).

    Args:
        plan, views, parking: what was offloaded, where, and its tensor objects.
        targets: the live targets.
        streams: the device's streams.
        device_views: the plan's cached device views, or ``None``.
        after: an event the copies wait for (the last offload), or ``None``.

    Returns:
        Bytes copied back.

    Raises:
        RuntimeError: the device ran out of memory (naming the bytes; the state is still
            offloaded, nothing was lost), or a tensor could not be re-pointed (nothing moved).
    """
    current = list(walk(targets))
    held = {id(t) for _, t in current}
    # FSDP2 all-gathers from the parameter its FSDPParam holds, also after the module was given another one
    held |= set(sharded_params([t for t in targets if isinstance(t, torch.nn.Module)]))
    swapped = [i for i in moved_away(views, parking) if id(plan.tensors[i].tensor) in held]
    assigned = {i: local_of(parking.tensors[i]).detach() for i in swapped}  # the bytes the user gave
    live_t = [i for i, r in enumerate(plan.tensors) if id(r.tensor) in held and i not in assigned]
    # Every storage a held tensor viewed comes back, also one whose tensor was given other bytes
    # (its other views: FSDP2's padded shard, the user's), and one whose slot was assigned.
    live_s = {plan.tensors[i].storage_index for i in live_t + swapped}
    live_s |= {si for new in assigned.values() if (si := views.slot_of(new.untyped_storage())) is not None}
    live_s = sorted(live_s)
    back = sorted(live_t + swapped)
    user_grads = {i: parking.tensors[i].grad for i in back if parking.has_grad_slot(i)}
    names = {r.name for r in plan.tensors}
    mine = {id(r.tensor) for r in plan.tensors}
    replacements = []  # held tensors the ferry does not know that belong on the device
    for where, t in current:
        if id(t) in mine:
            continue
        local = local_of(t)
        if local.device.type != "cpu" or (local.numel() and in_host_pool(local.data_ptr())):
            continue
        if describe(targets, where) in names or _placed_by_optimizer(targets, where, t):
            mine.add(id(t))
            replacements.append(t)
    # 1. Allocate: nothing is re-pointed yet.
    allocated: tuple[int, ...] = ()  # issue_h2d undoes its own allocations if it raises
    try:
        if streams.is_cuda and after is not None:
            streams.h2d.wait_event(after)
        allocated = issue_h2d(plan, views, streams, storages=live_s, device_views=device_views).allocated
        if streams.is_cuda:
            streams.h2d.synchronize()
            streams.pack.synchronize()
        on_device: dict[int, torch.UntypedStorage] = {}  # assigned tensors sharing a storage stay tied
        onto = {i: _onto_device(new, plan, views, on_device) for i, new in assigned.items()}
        moves = [move_to(t, plan.device) for t in replacements]
    except BaseException as e:
        undo_allocations(plan, allocated, streams)  # not one the offload kept
        if isinstance(e, torch.OutOfMemoryError):
            extra = sum(t.untyped_storage().nbytes() for t in replacements)
            raise RuntimeError(
                f"torchferry: bringing back the state replaced while offloaded needs "
                f"{sum(plan.nbytes[si] for si in live_s)} bytes of held storages plus {extra} bytes of "
                f"replacements on {plan.device} and ran out of device memory (free memory and call "
                "reload() again); the state is still offloaded, nothing was lost"
            ) from e
        raise
    nbytes = sum(plan.nbytes[si] for si in live_s)
    # 2. Re-point, each step undone in reverse on a failure; nothing after it can fail.
    undo: list = []
    try:
        for si in set(allocated) - set(live_s):  # a packed chunk brings back dead neighbours
            plan.storages[si].resize_(0)
        parking.to_device(back)
        undo.append(lambda: parking.revert_to_device(back))
        for i, g in user_grads.items():  # before any new shape: PyTorch checks a .grad against its tensor
            t = parking.tensors[i]
            if t.grad is not g:
                undo.append(functools.partial(setattr, t, "grad", t.grad))
                t.grad = g
        for i, dev in onto.items():
            local = local_of(parking.tensors[i])
            undo.append(functools.partial(setattr, local, "data", local.data))
            local.data = dev
        for m in moves:
            undo.append(moved(m))
        # See [Note: FSDP2's shard buffer after a move] (undone with the rest: the buffers then view
        # device storages the undo releases, as after any offload).
        repoint_sharded_data(plan.modules, parking.host_locals(back))
    except BaseException:
        with uninterruptible():  # see [Note: an undo is not interrupted]
            for step in reversed(undo):
                step()
            undo_allocations(plan, allocated, streams)
        raise
    logger.debug("reconcile: %d of %d tensors still held, %d given other bytes, %d replacements moved to %s",
                 len(live_t), len(plan.tensors), len(swapped), len(moves), plan.device)
    return nbytes
