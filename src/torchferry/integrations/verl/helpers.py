"""verl's FSDP offload helpers, backed by torchferry.

Same names and signatures as ``verl.utils.fsdp_utils`` (verl PR #7347, see
``shared/seed/``), so a verl user can swap them in (``torchferry.compat.verl``
is the same module's older import path)::

    from torchferry.integrations.verl import (
        offload_fsdp2_model_to_cpu, load_fsdp2_model_to_gpu,
        offload_fsdp_optimizer, load_fsdp_optimizer,
    )

Differences from the seed, all in the caller's favour: the host copies live in
one exact-size pinned pool made once per model/optimizer (not 1.90x the state
in power-of-two blocks, allocated on the fly), uneven FSDP2 shards stay pinned,
and every parameter, gradient and optimizer-state object keeps its identity.
As with the seed, the offloaded tensors are CPU tensors in pinned memory; with
``empty_cache=True`` the offload has completed when the helper returns.

One :class:`~torchferry.Ferry` is kept per model and per optimizer, weakly
keyed, so it goes away with the object; :func:`ferry_for` returns it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..._ferry import Ferry
from ..._targets import inner_optimizers

__all__ = [
    "ferry_for",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
]

_ferries: weakref.WeakKeyDictionary[object, Ferry] = weakref.WeakKeyDictionary()


def ferry_for(obj: nn.Module | torch.optim.Optimizer) -> Ferry | None:
    """The ferry the helpers keep for ``obj``.

    Args:
        obj: a model or optimizer passed to one of the helpers.

    Returns:
        Its :class:`~torchferry.Ferry`, or ``None`` if it was never offloaded
        through these helpers.
    """
    return _ferries.get(obj)


def _get_or_make(obj: nn.Module | torch.optim.Optimizer) -> Ferry:
    ferry = _ferries.get(obj)
    if ferry is None:
        ferry = Ferry(obj)
        _ferries[obj] = ferry
    return ferry


def _finish_offload(ferry: Ferry, handle, empty_cache: bool) -> None:
    if empty_cache:
        handle.wait()  # the handle offload() returned (also for a no-op offload: the last one)
        if ferry.device.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def offload_fsdp2_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Offloads ``model``'s parameters, buffers and gradients to pinned host memory.

    Args:
        model: an FSDP2 (``fully_shard``-ed) or plain module on one GPU.
        empty_cache: wait for the D2H copies, then ``torch.cuda.empty_cache()``
            to return the released memory to the driver (the seed does the
            same, and its ``empty_cache`` synchronises too).

    Raises:
        RuntimeError: host memory could not be allocated or pinned (the model
            stays on the GPU, unchanged).
    """
    ferry = _get_or_make(model)
    _finish_offload(ferry, ferry.offload(), empty_cache)


@torch.no_grad()
def load_fsdp2_model_to_gpu(model: nn.Module) -> None:
    """Reloads what :func:`offload_fsdp2_model_to_cpu` offloaded.

    The H2D copies are asynchronous; the current stream waits for them, so the
    next forward on that stream is ordered after them (as with the seed's
    same-stream ``model.to(device, non_blocking=True)``). A no-op for a model
    that was never offloaded through these helpers.
    """
    ferry = _ferries.get(model)
    if ferry is not None:
        ferry.reload()



def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer, or one it wraps (``ZeroRedundancyOptimizer.optim``), holds state."""
    return any(o.state for _, o in inner_optimizers(optimizer))

@torch.no_grad()
def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Offloads every device tensor in ``optimizer.state`` to pinned host memory.

    A no-op for an optimizer without state (before its first step), as in verl.
    """
    if not _has_state(optimizer):
        return
    ferry = _get_or_make(optimizer)
    ferry.offload()


@torch.no_grad()
def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
    """Reloads what :func:`offload_fsdp_optimizer` offloaded.

    Args:
        optimizer: the optimizer.
        device_id: the device to load onto; must be the device the state came
            from (torchferry restores the original storages).

    Raises:
        ValueError: ``device_id`` is not the device the state was offloaded from.
    """
    if not _has_state(optimizer):
        return
    ferry = _ferries.get(optimizer)
    if ferry is None:
        return
    device = torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id)
    if device.type == ferry.device.type and device.index is None:
        device = ferry.device
    if device != ferry.device:
        raise ValueError(
            f"torchferry: load_fsdp_optimizer(device_id={device_id!r}) but the state "
            f"was offloaded from {ferry.device}; it reloads where it came from"
        )
    ferry.reload()
