"""FSDP1's (``FullyShardedDataParallel``) internals, beside FSDP2's and torch's in ``fsdp.py``.

A torch upgrade that renames a private attribute of FSDP1 touches this file only. Written against torch
2.11-2.13 (``torch/distributed/fsdp/_flat_param.py``, ``fully_sharded_data_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
import weakref

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .fsdp import released, storage_key
from .host_blocks import in_host_pool
from .tree import module_tree

__all__ = [
    "fsdp1_flat_storages",
    "fsdp1_offloads_params",
    "fsdp1_units",
    "refuse_fsdp1_call",
    "rehome_flat_params",
    "run_first",
]


def fsdp1_offloads_params(module: nn.Module) -> bool:
    """Whether an FSDP1 (``FullyShardedDataParallel``) module, or one nested in it, keeps its
    flat parameters on the host itself (``cpu_offload=CPUOffload(offload_params=True)``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(getattr(getattr(m, "cpu_offload", None), "offload_params", False)
               for m in FullyShardedDataParallel.fsdp_modules(module))


def fsdp1_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP1 (``FullyShardedDataParallel``) units of ``module``'s tree, itself included."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    return [m for _, m in module_tree(module) if isinstance(m, FullyShardedDataParallel)]


def run_first(module: nn.Module, state_dict_hook: RemovableHandle, load_hook: RemovableHandle) -> None:
    """Moves the state-dict pre-hook and the load-state-dict pre-hook registered on ``module`` (their handles)
    before its others, those FSDP1 registered at wrapping included (a module's hooks run in registration order,
    and there is no ``prepend``)."""
    module._state_dict_pre_hooks.move_to_end(state_dict_hook.id, last=False)
    module._load_state_dict_pre_hooks.move_to_end(load_hook.id, last=False)


class _Refused:  # removes refuse_fsdp1_call's override, as a RemovableHandle's remove()

    def __init__(self, unit: nn.Module, fn: object, method: str) -> None:
        self._unit, self._fn, self._method = weakref.ref(unit), fn, method
        unit.__dict__[method] = fn

    def remove(self) -> None:
        unit = self._unit()
        if unit is not None and unit.__dict__.get(self._method) is self._fn:
            del unit.__dict__[self._method]


def refuse_fsdp1_call(unit: nn.Module, method: str, fn: object) -> _Refused | None:
    """Makes ``fn`` run instead of the FSDP1 unit's ``method`` until the handle's ``remove()``: ``"apply"``
    (FSDP1's ``apply(fn)`` unshards the unit first, ``_unshard_params``) of any unit, ``"_apply"`` (``.to()``,
    ``.float()``, ``.cuda()``, a parent's too) of a unit whose flat parameter is not a registered parameter
    (``use_orig_params=True``): both read the storages an offload released. ``None`` where there is nothing to
    refuse ([Note: FSDP1's state dict while offloaded] in ``_ferry/guards.py``)."""
    if (method == "_apply" and not getattr(unit, "_use_orig_params", False)) or method in unit.__dict__:
        return None
    return _Refused(unit, fn, method)


def _fsdp1_flat_on_host(flat: torch.Tensor) -> torch.Tensor | None:
    """A host tensor of ``flat``'s shape over the pool bytes its original parameters view (the ferry copied the
    flat parameter's storage whole into one slot, so their offsets in it are kept); ``None`` if none views it."""
    params, infos = getattr(flat, "_params", None) or (), getattr(flat, "_shard_param_infos", ())
    for p, info in zip(params, infos, strict=False):
        if not info.in_shard or not info.numel_in_shard or p.untyped_storage().nbytes() == 0:
            continue
        if not in_host_pool(p.untyped_storage().data_ptr()):
            return None
        start = p.storage_offset() - info.offset_in_shard
        if start < 0 or (start + flat.numel()) * flat.element_size() > p.untyped_storage().nbytes():
            return None
        return torch.empty(0, dtype=flat.dtype).set_(p.untyped_storage(), start, flat.size(), flat.stride())
    return torch.zeros(flat.size(), dtype=flat.dtype)  # this rank's shard is padding only


def rehome_flat_params(modules: Sequence[nn.Module]) -> None:
    """Points FSDP1's own tensors whose device storage an offload released at the host state (what a dropped
    ferry leaves: [Note: a ferry dropped while offloaded] in ``_ferry/guards.py``), so the module runs on the
    host and ``model.to(device)`` copies the host bytes: ``_local_shard`` and, with ``use_orig_params=True``,
    the flat parameter itself (not a registered parameter, so the ferry left it over the released storage)."""
    with torch.no_grad():
        for unit in (u for m in modules for u in fsdp1_units(m)):
            flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
            if not isinstance(flat, torch.Tensor):
                continue
            if released(flat):
                host = _fsdp1_flat_on_host(flat)
                if host is None:
                    continue
                flat.data = host
            if released(getattr(flat, "_local_shard", None)) and flat.device.type == "cpu":
                flat._local_shard = flat.data


def fsdp1_flat_storages(modules: list[nn.Module]) -> set[int]:
    """:func:`storage_key` of every FSDP1 ``FlatParameter``'s storage (and its local shard's) under
    ``modules``; empty without FSDP1 units."""
    out: set[int] = set()
    for unit in (u for m in modules for u in fsdp1_units(m)):
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        for t in (flat, getattr(flat, "_local_shard", None)):
            if isinstance(t, torch.Tensor):
                out.add(storage_key(t.untyped_storage()))
    return out
