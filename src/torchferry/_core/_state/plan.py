"""Planning: which storages move, and which tensor objects view them.

The unit of transfer is a ``torch.UntypedStorage``. We collect every tensor
behind the targets (``_state/targets.walk``), look through DTensors to their local
tensor (for FSDP2 a view of the padded ``_sharded_param_data``), and
deduplicate storages by identity (``StorageImpl`` address, not ``data_ptr()``:
every zero-size storage has pointer 0), so tied weights and views move once.

[Note: cached plan]
Planning checks every tensor (10-40 us each); a fingerprint of the tensors,
storages, sizes and addresses (about 1 us each) tells whether the last plan
still holds, which it does every steady cycle. 4096 small tensors cost
100-230 ms to plan on a CI host against 3 ms to fingerprint.

[Note: NumPy views mark storages not resizable]
``Tensor.numpy()`` (and ``np.asarray(t)``, ``t.__array__()``) of a CPU tensor
sets its storage's ``resizable`` flag to False, so that a ``resize_`` cannot
free memory under the array; PyTorch never sets it back, even once the array
is gone. With ``device="cpu"`` the resident storages are CPU storages: such a
view taken after the plan was cached made the offload fail half-way, at the
release's ``resize_(0)``, after re-pointing, and then every ``reload()`` failed
at its ``resize_``. The fingerprint therefore holds
``resizable()``: a storage that lost it invalidates the cached plan and
:func:`build_plan` refuses it by name before anything is copied or re-pointed;
the state stays resident. Views of the pool are harmless: pool views are
never resizable (they borrow the pool's memory) and are never resized, and a
reload allocates the device storages, not them (tested with the array alive
during the reload and across later cycles). A NumPy array made *while
offloaded* of an alias the ferry does not know (using it is undefined: its
memory is released) leaves a device storage that can never be allocated
again: a plain ``reload()`` refuses it by name (:func:`refuse_unresizable`)
before allocating anything, and the state stays on the host.

NumPy is not the only cause, and the refusal must not blame it for the others:
``torch.load`` builds every storage it reads without an
allocator and not resizable, and ``optimizer.load_state_dict()`` keeps a
loaded tensor as it is when it already has its parameter's device and dtype
(``_process_value_according_to_param_policy`` in ``torch/optim/optimizer.py``),
which on a ferry whose device is the CPU is always; ``module.load_state_dict(...,
assign=True)`` does the same with parameters. Nothing on a storage tells these
causes apart, so :func:`_unresizable` names the one that fits what the tensor
is (optimizer state, a module's, a tensor) first, and ``copy.deepcopy`` of the
loaded state as the fix (its tensors get storages of their own).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from .fsdp import local_of, storage_key
from .targets import check_tensor, describe, hidden_optimizer_tensors, inner_optimizers, tensors, walk

__all__ = ["Plan", "PlanCache", "TensorRef", "build_plan", "fingerprint", "own_views", "refuse_unresizable",
           "resolve_device", "storage_bytes", "to_allocate"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor object the ferry re-points between device and host.

    Attributes:
        tensor: the object callers hold (Parameter, DTensor, ``.grad``,
            optimizer state, buffer). Its Python identity never changes.
        name: where it was found, for error messages
            (``"model.fc.weight.grad"``, ``"optimizer.state[0]['exp_avg']"``).
        storage_index: index into ``Plan.storages`` of the storage it views.
    """

    tensor: torch.Tensor
    name: str
    storage_index: int

    @property
    def local(self) -> torch.Tensor:
        """The plain tensor whose storage moves (the local shard of a DTensor)."""
        return local_of(self.tensor)


@dataclasses.dataclass(slots=True)
class Plan:
    """The storages to move and the tensors that view them.

    Attributes:
        device: the device the state lives on when resident.
        storages: unique storages, in discovery order (module order, so FSDP
            units come in forward order).
        nbytes: bytes of each storage, ``len(nbytes) == len(storages)``.
        tensors: every known tensor object, each once.
        module_refs: weak references to the module targets (a ferry keeps its
            last plan; a model dropped by its user must still be collected).
        optimizer_refs: weak references to the optimizer targets and the
            optimizers they wrap.
        derived: layouts derived from the plan and kept with it by the layers above, each with
            the key it is valid for (a layer-wise reload's groups: [Note: groups kept with the
            plan] in ``_schedules/groups.py``); no strong reference to a module.
    """

    device: torch.device
    storages: list[torch.UntypedStorage]
    nbytes: list[int]
    tensors: list[TensorRef]
    module_refs: list[weakref.ref]
    optimizer_refs: list[weakref.ref]
    derived: dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def modules(self) -> list[nn.Module]:
        """The module targets still alive (for forward guards and FSDP units)."""
        return [m for m in (r() for r in self.module_refs) if m is not None]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer targets (and wrapped ones) still alive (for step guards)."""
        return [o for o in (r() for r in self.optimizer_refs) if o is not None]

    @property
    def state_bytes(self) -> int:
        """Total bytes of the unique storages (what a transfer moves)."""
        return sum(self.nbytes)

    @property
    def has_grads(self) -> bool:
        """Whether any ``.grad`` is part of the state."""
        return any(r.name.endswith(".grad") for r in self.tensors)

    def signature(self) -> tuple:
        """Identity of the layout: equal signatures can reuse the same slots."""
        return tuple((storage_key(s), n) for s, n in zip(self.storages, self.nbytes, strict=True))


class PlanCache(NamedTuple):
    """The last plan, its fingerprint, and 1D uint8 views over its device storages.

    The views stay valid across cycles: the storage objects are kept and
    ``resize_`` in place (see [Note: storage moves keep every tensor object]).
    """

    fingerprint: list[tuple]
    plan: Plan
    device_views: list[torch.Tensor]


# StorageImpl address -> weak references to the views storage_bytes() made of it: holders the ferry
# knows, also those an old plan cache left alive (a caught exception's frames keep one):
# see [Note: a storage shared with a tensor the ferry does not know] in holders.py.
_own_views: dict[int, list[weakref.ref]] = {}


def _forget_view(key: int, ref: weakref.ref) -> None:
    refs = _own_views.get(key)
    if refs is not None:
        refs[:] = [r for r in refs if r is not ref]
        if not refs:
            del _own_views[key]


def storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """1D ``torch.uint8`` tensor over all of ``storage``'s bytes (registered for :func:`own_views`)."""
    view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    key = storage_key(storage)
    _own_views.setdefault(key, []).append(weakref.ref(view, lambda r, k=key: _forget_view(k, r)))
    return view


def own_views(key: int) -> list[torch.Tensor]:
    """The live views :func:`storage_bytes` made of the storage whose ``StorageImpl`` address is ``key``."""
    return [v for r in _own_views.get(key, ()) if (v := r()) is not None]


def fingerprint(targets: Sequence[object]) -> list[tuple]:
    """What a plan of ``targets`` depends on, cheaply: per tensor its id, storage, bytes and view.

    Equal fingerprints (taken while a plan holds the tensors, so ids are not
    reused) mean :func:`build_plan` would return the same plan, and the host
    views made for it still fit: the same tensor objects over the same
    storages (``StorageImpl``, which a reload keeps while its address changes)
    of the same sizes, sharing and resizability (``share_memory_()`` or a NumPy
    array made of a resident CPU tensor after planning must be refused again,
    before anything moves: [Note: NumPy views mark storages not resizable]),
    with the same dtype, storage offset, size and stride. See [Note: cached plan].
    """
    out = []
    for t in tensors(targets):
        local = local_of(t)
        st = local.untyped_storage()
        out.append((id(t), storage_key(st), st.nbytes(), st.is_shared(), st.resizable(), local.dtype,
                    local.storage_offset(), local.shape, local.stride()))
    return out


def refuse_unresizable(plan: Plan) -> None:
    """Refuses a reload that could not allocate: a device storage made not resizable while offloaded.

    Raises:
        RuntimeError: a storage of ``plan`` is no longer resizable (a NumPy array made of
            a view of it while offloaded: [Note: NumPy views mark storages not resizable]);
            nothing was allocated, the state stays offloaded.
    """
    for si, st in enumerate(plan.storages):
        if not st.resizable() and st.nbytes() != plan.nbytes[si]:  # one at its size is not resized
            name = next(r.name for r in plan.tensors if r.storage_index == si)
            raise RuntimeError(
                f"torchferry: cannot reload: the device storage of {name} was made not resizable while "
                "offloaded (a NumPy array of a view of it, e.g. v.numpy(); PyTorch never undoes that), "
                "so it cannot be allocated again; the state is still offloaded, on the host"
            )


def to_allocate(plan: Plan) -> list[int]:
    """Per storage of ``plan``, the bytes a reload allocates: 0 for one still allocated at its size
    (kept by the offload: [Note: a storage shared with a tensor the ferry does not know] in
    ``holders.py``), which the reload does not ``resize_``."""
    return [0 if st.nbytes() == n else n for st, n in zip(plan.storages, plan.nbytes, strict=True)]


def resolve_device(found: list[tuple[str, torch.Tensor, torch.Tensor]], device: torch.device | None) -> torch.device:
    """The ferry's device: ``device`` if given (checked), else the one accelerator the tensors are on.

    Raises:
        ValueError: tensors on several accelerators, on another device than
            ``device``, or none on a CUDA ``device``; CUDA asked for but absent.
        NotImplementedError: a device type other than CPU and CUDA.
    """
    explicit = device is not None
    accel: dict[torch.device, str] = {}
    for name, _, local in found:
        if local.device.type != "cpu":
            accel.setdefault(local.device, name)
    if device is None:
        if len(accel) > 1:
            listing = ", ".join(f"{n} on {d}" for d, n in accel.items())
            raise ValueError(
                f"torchferry: the targets span several devices ({listing}); "
                "make one Ferry per device"
            )
        device = next(iter(accel), torch.device("cpu"))
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" is the current device: cuda:N
    for d, name in accel.items():
        if d != device:
            raise ValueError(f"torchferry: {name} is on {d}, but the ferry's device is {device}")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"torchferry: device type {device.type!r} is not supported")
    if explicit and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torchferry: device {device} was asked for, but CUDA is not available")
    if not accel and device.type == "cuda":
        on_host = [name for name, _, _ in found if not name.startswith("optimizer")]
        if on_host:
            raise ValueError(
                f"torchferry: the ferry's device is {device} but none of the targets' tensors "
                f"is on it ({len(on_host)} on the CPU, e.g. {on_host[0]}); move the model first"
            )
    return device


def _unresizable(name: str, target: type) -> NotImplementedError:
    """The refusal of a storage that is not resizable, its likeliest cause first for a tensor found in
    a ``target`` of this type ([Note: NumPy views mark storages not resizable])."""
    numpy = ("a NumPy array made of it (t.numpy(), np.asarray(t)), which PyTorch never undoes, or memory "
             "borrowed from NumPy or DLPack (torch.from_numpy, torch.from_dlpack)")
    if issubclass(target, torch.optim.Optimizer):
        cause = ("optimizer state loaded with optimizer.load_state_dict(torch.load(...)): torch.load's storages "
                 "are not resizable, and the optimizer keeps the loaded tensors as they are where they already have "
                 f"their parameter's device and dtype (on a CPU ferry, all of them) and its step counters; or {numpy}")
        fix = ("load a copy that owns its memory: optimizer.load_state_dict(copy.deepcopy(torch.load(...))), "
               "or replace the tensor with t.clone() in optimizer.state")
    elif issubclass(target, nn.Module):
        cause = ("a parameter or buffer loaded with module.load_state_dict(torch.load(...), assign=True) "
                 f"(torch.load's storages are not resizable), or {numpy}")
        fix = "give it memory of its own (p.data = p.data.clone(), or load_state_dict without assign=True)"
    else:
        cause = f"{numpy}, or a tensor read by torch.load (whose storages are not resizable)"
        fix = "give it memory of its own (t.data = t.data.clone())"
    return NotImplementedError(f"torchferry: the storage of {name} cannot be resized, so its memory cannot be "
                               f"released; nothing was moved. PyTorch marks a storage so for {cause}. Fix: {fix}, "
                               "then offload again")


def build_plan(targets: Sequence[object], device: torch.device | str | None = None) -> Plan:
    """Collects and deduplicates the storages behind ``targets``.

    Tensors on the CPU are left alone when the ferry's device is a GPU (for
    example AdamW's ``step`` counters, which already live in host memory).

    Args:
        targets: ``nn.Module``s, ``torch.optim.Optimizer``s and tensors.
        device: the device to move from; inferred from the tensors if ``None``
            (the CPU when every tensor is on the CPU).

    Returns:
        A :class:`Plan`. Nothing is modified.

    Raises:
        ValueError: no targets, or tensors on several devices.
        TypeError: a target of another type.
        NotImplementedError: a tensor :func:`check_tensor` refuses, a storage
            that cannot be resized (e.g. one borrowed from NumPy or DLPack), or
            an optimizer holding device state outside ``optimizer.state``.
    """
    if not targets:
        raise ValueError("torchferry: Ferry() needs at least one target (module, optimizer or tensor)")
    found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    kinds: dict[int, type] = {}  # id(tensor) -> the type of target it was found in (for _unresizable)
    for where, t in walk(targets):
        if id(t) in kinds:
            continue
        kinds[id(t)] = type(targets[where[0]])
        name = describe(targets, where)
        found.append((name, t, check_tensor(name, t)))
    dev = resolve_device(found, None if device is None else torch.device(device))

    storages: list[torch.UntypedStorage] = []
    nbytes: list[int] = []
    index_of: dict[int, int] = {}
    refs: list[TensorRef] = []
    for name, t, local in found:
        if local.device != dev:
            continue
        st = local.untyped_storage()
        key = storage_key(st)
        if key not in index_of:
            if not st.resizable():  # see [Note: NumPy views mark storages not resizable]
                raise _unresizable(name, kinds[id(t)])
            index_of[key] = len(storages)
            storages.append(st)
            nbytes.append(st.nbytes())
        refs.append(TensorRef(t, name, index_of[key]))
    optimizers = [o for t in targets if isinstance(t, torch.optim.Optimizer) for _, o in inner_optimizers(t)]
    if dev.type != "cpu":
        for opt in optimizers:
            hidden = hidden_optimizer_tensors(opt, dev, set(index_of))
            if hidden:
                listing = ", ".join(f"{path} ({n} bytes)" for path, n in hidden[:3])
                raise NotImplementedError(
                    f"torchferry: {type(opt).__name__} holds state on {dev} outside optimizer.state "
                    f"({listing}{', ...' if len(hidden) > 3 else ''}); it would stay on the device. "
                    "Pass those tensors to Ferry(...) as well, or offload this optimizer another way"
                )
    return Plan(
        device=dev,
        storages=storages,
        nbytes=nbytes,
        tensors=refs,
        module_refs=[weakref.ref(t) for t in targets if isinstance(t, nn.Module)],
        optimizer_refs=[weakref.ref(o) for o in optimizers],
    )
