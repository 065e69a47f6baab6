"""FSDP2 units of a bench model, with torch's public API only: which modules are units, the bytes
each owns, a DTensor's local shard, resharding.

``fully_shard`` is called on one module at a time throughout the bench (``setup.shard_fsdp2``), so
every ``FSDPModule`` is a unit of its own.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fsdp_units", "local_of", "reshard", "unit_bytes"]


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage holds ``t``'s bytes on this rank: a DTensor's local shard
    (``DTensor.to_local()``, the same storage), else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():  # no autograd view: the local tensor itself
            return t.to_local()
    return t


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The ``fully_shard``-ed modules under ``model`` in module pre-order (the root first)."""
    kind = _fsdp_module_type()
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def reshard(model: nn.Module) -> None:
    """Reshards every FSDP unit under ``model`` (``FSDPModule.reshard()``): the sharded parameters
    are registered again, as after a backward (FSDP2 keeps the root unsharded after a forward)."""
    for unit in fsdp_units(model):
        unit.reshard()  # pyright: ignore[reportCallIssue]  # an FSDPModule method; nn.Module attributes type as Tensor | Module in torch's stubs


def unit_bytes(units: list[nn.Module]) -> list[int]:
    """Bytes of the local-shard storages of the parameters each unit owns (a parameter belongs to the
    innermost unit holding it, i.e. the last in pre-order; a storage counts once, for its first unit)."""
    owner: dict[int, tuple[int, torch.Tensor]] = {}
    for i, u in enumerate(units):
        for p in u.parameters():
            owner[id(p)] = (i, p)
    out = [0] * len(units)
    seen: set[int] = set()
    for i, p in sorted(owner.values(), key=lambda x: x[0]):
        st = local_of(p).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out[i] += st.nbytes()
    return out
