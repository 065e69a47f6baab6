"""A model's and optimizer's state as the bench checks it: bytes of its storages, bit checksums."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from .units import local_of

__all__ = ["bit_sums", "checksum", "state_bytes", "unique_storage_bytes"]


def unique_storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` under ``tensors`` (a DTensor counts its local shard)."""
    seen = {}
    for t in tensors:
        local = local_of(t)
        if local.device == device:
            st = local.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}``: bytes of each on ``device`` (local shards)."""
    unique = functools.partial(unique_storage_bytes, device=device)
    return {
        "params": unique(model.parameters()),
        "grads": unique(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": unique(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(model: nn.Module, device: torch.device | None = None) -> list[int]:
    """Per parameter, the sum of its local shard's bits as integers (int64, wrapping).

    Exact and independent of summation order, so a shard read on the host
    (still offloaded, during a layer-wise reload) and on the device give the
    same value; a float sum would differ by rounding. See :func:`bit_sums` for ``device``.
    """
    return bit_sums([local_of(p) for p in model.parameters()], device)


def bit_sums(tensors: list[torch.Tensor], device: torch.device | None = None) -> list[int]:
    """Per tensor, the sum of its bits as integers (int64, wrapping); 0 for an empty one.

    With a CUDA ``device``, host tensors are copied there (H2D, non-blocking from pinned
    memory) and summed on the GPU, with one host sync for all: the host copies are still
    what is read, at the link's rate instead of the host's (a 7B state took minutes summed
    on the host). Otherwise each tensor is summed where it is.
    """
    on_gpu = device is not None and device.type == "cuda"
    with torch.no_grad():
        sums: list[torch.Tensor | int] = []
        for t in tensors:
            if not t.numel():
                sums.append(0)
                continue
            if on_gpu and t.device.type == "cpu":
                t = t.to(device, non_blocking=t.is_pinned())
            t = t.contiguous()
            s = t.view(_INT_VIEW[t.element_size()]).sum(dtype=torch.int64)
            sums.append(s if on_gpu and s.device == device else int(s))
        lazy = [s for s in sums if torch.is_tensor(s)]
        values = iter(torch.stack(lazy).tolist() if lazy else [])
        return [next(values) if torch.is_tensor(s) else s for s in sums]
