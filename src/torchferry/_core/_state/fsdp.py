"""Every read of FSDP2's and DTensor's internals, in one place.

A torch upgrade that renames a private attribute touches this file only; the
rest of torchferry asks it. Written against torch 2.11-2.13
(``torch/distributed/fsdp/_fully_shard/`` and ``torch/distributed/tensor/``).
"""

from __future__ import annotations

import torch
from torch import nn

from .tree import module_tree

__all__ = [
    "comm_streams",
    "dtensor_twin",
    "forward_prefetch_units",
    "fsdp1_offloads_params",
    "fsdp_modules",
    "is_dtensor",
    "lazy_init_done",
    "local_of",
    "reshard",
    "swap_local",
    "unit_key",
    "versions",
]

_PLAIN = (torch.Tensor, nn.Parameter)


def is_dtensor(t: torch.Tensor) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    if type(t) in _PLAIN:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage moves: a DTensor's local shard, else ``t`` itself."""
    return t if type(t) in _PLAIN else getattr(t, "_local_tensor", t)


def dtensor_twin(t: torch.Tensor, new_local: torch.Tensor) -> torch.Tensor:
    """A new DTensor with ``t``'s spec and ``requires_grad`` over ``new_local``."""
    from torch.distributed.tensor import DTensor

    return DTensor(new_local, t._spec, requires_grad=t.requires_grad)


def swap_local(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchanges the local shards of two DTensors (the Python slot beside the wrapper impl)."""
    a._local_tensor, b._local_tensor = b._local_tensor, a._local_tensor


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP units (``fully_shard``-ed modules) in ``module``'s tree, root first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for _, m in module_tree(module) if isinstance(m, FSDPModule)]


def unit_key(unit: nn.Module) -> int:
    """Identifies a unit's FSDP state: ``fully_shard([a, b])`` gives ``a`` and ``b`` one key."""
    return id(unit._get_fsdp_state())  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state/reshard on an FSDPModule; nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs


def reshard(modules: list[nn.Module]) -> None:
    """Reshards every FSDP unit under ``modules``: the sharded parameters are registered."""
    for m in modules:
        for unit in fsdp_modules(m):
            unit.reshard()  # pyright: ignore[reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs


def forward_prefetch_units(unit: nn.Module) -> list[nn.Module]:
    """The units whose all-gather FSDP2 issues from ``unit``'s pre-forward (explicit prefetch)."""
    try:
        state = unit._get_fsdp_state()  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
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


def comm_streams(modules: list[nn.Module]) -> list[torch.cuda.Stream]:
    """FSDP2's all-gather streams for the units under ``modules``, each once.

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
    for m in modules:
        for unit in fsdp_modules(m):
            ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
            for name in ("all_gather_copy_in_stream", "all_gather_stream"):
                stream = getattr(ctx, name, None)
                if stream is not None:
                    out.setdefault(id(stream), stream)
    return list(out.values())


def lazy_init_done(modules: list[nn.Module]) -> bool:
    """FSDP2 initialises lazily at the first forward (and may re-pad shards then): layer-wise
    schedules run only after it, when a unit's shards are left as they are."""
    for m in modules:
        for unit in fsdp_modules(m):
            if getattr(unit._get_fsdp_state(), "_is_root", None) is None:  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
                return False
    return True


def fsdp1_offloads_params(module: nn.Module) -> bool:
    """Whether an FSDP1 (``FullyShardedDataParallel``) module, or one nested in it, keeps its
    flat parameters on the host itself (``cpu_offload=CPUOffload(offload_params=True)``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(getattr(getattr(m, "cpu_offload", None), "offload_params", False)
               for m in FullyShardedDataParallel.fsdp_modules(module))


def versions(tensors: list[torch.Tensor]) -> list[int]:
    """Version counters (bumped by every in-place write) of tensors, DTensor local shards included.

    A DTensor's in-place ops bump the outer counter (``zero_``, ``mul_``) or
    neither (the ``_foreach_`` ops, which optimizers use): both are read, and
    optimizer steps are caught apart (step pre-hooks). Inference tensors have
    no counter: they count as 0 (callers that must see their writes exclude them).
    """
    out = []
    for t in tensors:
        if t.is_inference():
            out.append(0)
            continue
        v = t._version
        if type(t) not in _PLAIN:
            local = getattr(t, "_local_tensor", None)
            if local is not None and not local.is_inference():
                v += local._version
        out.append(v)
    return out
