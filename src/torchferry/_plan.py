"""Planning: which storages move, and which tensor objects view them.

The unit of transfer is a ``torch.UntypedStorage``. We collect every tensor
behind the targets (module parameters, buffers and ``.grad``s; every tensor in
``optimizer.state``; plain tensors), look through DTensors to their local
tensor (for FSDP2 a view of the padded ``_sharded_param_data``), and
deduplicate storages by identity (``StorageImpl`` address, not ``data_ptr()``:
every zero-size storage has pointer 0), so tied weights and views move once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["Plan", "TensorRef", "build_plan", "fingerprint", "fsdp_modules", "is_dtensor"]


def is_dtensor(t: torch.Tensor) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP units (``fully_shard``-ed modules) in ``module``'s tree, root first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


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
        return self.tensor._local_tensor if is_dtensor(self.tensor) else self.tensor


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
        optimizer_refs: weak references to the optimizer targets.
    """

    device: torch.device
    storages: list[torch.UntypedStorage]
    nbytes: list[int]
    tensors: list[TensorRef]
    module_refs: list[weakref.ref]
    optimizer_refs: list[weakref.ref]

    @property
    def modules(self) -> list[nn.Module]:
        """The module targets still alive (for forward guards and FSDP units)."""
        return [m for m in (r() for r in self.module_refs) if m is not None]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer targets still alive (for step guards)."""
        return [o for o in (r() for r in self.optimizer_refs) if o is not None]

    @property
    def state_bytes(self) -> int:
        """Total bytes of the unique storages (what a transfer moves)."""
        return sum(self.nbytes)

    def signature(self) -> tuple:
        """Identity of the layout: equal signatures can reuse the same slots."""
        return tuple(
            (s._cdata, n) for s, n in zip(self.storages, self.nbytes, strict=True)
        )


def _state_tensors(prefix: str, value: object) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors in an optimizer-state value: a tensor, or lists/tuples of them (LBFGS history)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from _state_tensors(f"{prefix}[{j}]", v)


def _named_tensors(targets: Sequence[object]) -> Iterable[tuple[str, torch.Tensor]]:
    for i, target in enumerate(targets):
        if isinstance(target, torch.jit.ScriptModule):
            raise NotImplementedError(
                f"torchferry: targets[{i}] is a TorchScript module; its forward cannot be guarded while "
                "offloaded. Make the ferry over the eager module."
            )
        if isinstance(target, nn.Module):
            prefix = type(target).__name__ if len(targets) == 1 else f"targets[{i}]"
            for name, p in target.named_parameters():
                yield f"{prefix}.{name}", p
                if p.grad is not None:
                    yield f"{prefix}.{name}.grad", p.grad
            for name, b in target.named_buffers():
                yield f"{prefix}.{name}", b
        elif isinstance(target, torch.optim.Optimizer):
            order = {id(p): k for k, p in enumerate(p for g in target.param_groups for p in g["params"])}
            # Every entry of optimizer.state, also of parameters no longer in a group.
            for n, (p, state) in enumerate(target.state.items()):
                index = order.get(id(p), f"extra{n}")
                for key, value in state.items():
                    yield from _state_tensors(f"optimizer.state[{index}][{key!r}]", value)
        elif isinstance(target, torch.Tensor):
            yield f"tensors[{i}]", target
        else:
            hint = ""
            if isinstance(target, (list, tuple, dict)) or hasattr(target, "__next__"):
                hint = " (pass tensors as separate arguments: Ferry(*tensors), or pass the module itself)"
            raise TypeError(
                "torchferry: a target must be an nn.Module, a torch.optim.Optimizer "
                f"or a torch.Tensor; targets[{i}] is {type(target).__name__}{hint}"
            )


def _iter_tensors(targets: Sequence[object]) -> Iterable[torch.Tensor]:
    """The tensors of :func:`_named_tensors`, in the same order, without names or checks."""
    for target in targets:
        if isinstance(target, nn.Module):
            for p in target.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from target.buffers()
        elif isinstance(target, torch.optim.Optimizer):
            for state in target.state.values():
                for value in state.values():
                    for _, t in _state_tensors("", value):
                        yield t
        else:
            yield target  # a tensor


def fingerprint(targets: Sequence[object]) -> list[tuple]:
    """What a plan of ``targets`` depends on, cheaply: per tensor its id, storage, bytes and view.

    Equal fingerprints (taken while a plan holds the tensors, so ids are not
    reused) mean :func:`build_plan` would return the same plan, and the host
    views made for it still fit: the same tensor objects over the same
    storages (``StorageImpl``, which a reload keeps while its address changes)
    of the same sizes and sharing (``share_memory_()`` after planning must be
    refused again), with the same dtype, storage offset, size and stride.
    About 1 us per tensor, against 10-40 us for a full plan with its checks
    (4096 tensors on a 2-core CI host: 3 ms against 100-230 ms).
    """
    out = []
    for t in _iter_tensors(targets):
        local = t if type(t) in (torch.Tensor, nn.Parameter) else getattr(t, "_local_tensor", t)
        st = local.untyped_storage()
        out.append((id(t), st._cdata, st.nbytes(), st.is_shared(), local.dtype, local.storage_offset(), local.shape,
                    local.stride()))
    return out


def _check_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """Validates ``t`` and returns the plain tensor whose storage moves."""
    if t.is_meta:
        raise NotImplementedError(
            f"torchferry: {name} is a meta tensor ({t.shape=}); it has no data to "
            "move. Materialise it (e.g. module.to_empty(device=...)) first."
        )
    local = t
    if is_dtensor(t):
        local = t._local_tensor
    elif type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(t):
            raise NotImplementedError(
                f"torchferry: {name} is a {type(t).__name__}; of the tensor "
                "subclasses only DTensor is supported"
            )
    if local.layout != torch.strided or local.is_nested:
        raise NotImplementedError(
            f"torchferry: {name} has layout {local.layout}; only strided tensors move"
        )
    if local.is_meta:
        raise NotImplementedError(f"torchferry: {name} has a meta local shard ({local.shape=})")
    if local.is_quantized:
        raise NotImplementedError(f"torchferry: {name} is a quantized tensor ({local.dtype}); not supported")
    if local.is_conj() or local.is_neg():
        raise NotImplementedError(
            f"torchferry: {name} has the conjugate or negative bit set; call .resolve_conj() / "
            ".resolve_neg() on it first"
        )
    if local.device.type == "cpu" and local.is_shared():
        raise NotImplementedError(
            f"torchferry: {name} is in shared memory (share_memory_()); releasing it would break "
            "the other processes' view of it"
        )
    _check_backed(name, local)
    return local


def _check_backed(name: str, local: torch.Tensor) -> None:
    """Refuses tensors whose storage is not there: offloaded by another ferry, or released."""
    from ._host_memory import in_host_pool

    if local.numel() == 0:
        return
    st = local.untyped_storage()
    if local.device.type == "cpu" and in_host_pool(st.data_ptr()):
        raise RuntimeError(
            f"torchferry: {name} is already offloaded by another Ferry (it views that ferry's "
            "host pool); reload that ferry first"
        )
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(local.shape, local.stride()))
    needed = (local.storage_offset() + extent) * local.element_size()
    if st.nbytes() < needed:
        raise RuntimeError(
            f"torchferry: the storage of {name} holds {st.nbytes()} bytes but the tensor needs "
            f"{needed}: its memory was released (offloaded by another Ferry, or resize_(0)); "
            "reload it first"
        )


def _resolve_device(
    found: list[tuple[str, torch.Tensor, torch.Tensor]], device: torch.device | None
) -> torch.device:
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
    for d, name in accel.items():
        if d != device:
            raise ValueError(f"torchferry: {name} is on {d}, but the ferry's device is {device}")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"torchferry: device type {device.type!r} is not supported")
    if explicit and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torchferry: device {device} was asked for, but CUDA is not available")
    if not accel and device.type == "cuda":
        on_host = [name for name, _, _ in found if not name.startswith("optimizer.")]
        if on_host:
            raise ValueError(
                f"torchferry: the ferry's device is {device} but none of the targets' tensors "
                f"is on it ({len(on_host)} on the CPU, e.g. {on_host[0]}); move the model first"
            )
    return device


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
        NotImplementedError: a meta tensor, a non-strided tensor, a tensor
            subclass other than DTensor, or a storage that cannot be resized
            (e.g. one borrowed from NumPy or DLPack).
    """
    if not targets:
        raise ValueError("torchferry: Ferry() needs at least one target (module, optimizer or tensor)")
    found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for name, t in _named_tensors(targets):
        if id(t) in seen:
            continue
        seen.add(id(t))
        found.append((name, t, _check_tensor(name, t)))
    dev = _resolve_device(found, None if device is None else torch.device(device))

    storages: list[torch.UntypedStorage] = []
    nbytes: list[int] = []
    index_of: dict[int, int] = {}
    refs: list[TensorRef] = []
    for name, t, local in found:
        if local.device != dev:
            continue
        st = local.untyped_storage()
        key = st._cdata
        if key not in index_of:
            if not st.resizable():
                raise NotImplementedError(
                    f"torchferry: the storage of {name} cannot be resized (it is "
                    "borrowed, e.g. from NumPy or DLPack), so its memory cannot be "
                    "released; clone the tensor into a torch-owned one first"
                )
            index_of[key] = len(storages)
            storages.append(st)
            nbytes.append(st.nbytes())
        refs.append(TensorRef(t, name, index_of[key]))
    return Plan(
        device=dev,
        storages=storages,
        nbytes=nbytes,
        tensors=refs,
        module_refs=[weakref.ref(t) for t in targets if isinstance(t, nn.Module)],
        optimizer_refs=[weakref.ref(t) for t in targets if isinstance(t, torch.optim.Optimizer)],
    )
