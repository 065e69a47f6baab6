"""Copies a schedule asks for a few storages at a time, issued here: an offload-during-forward unit's
D2H copies, a layer-wise reload group's H2D copies, and the odd copy on the caller's stream.

The schedules above (``_schedules/early``, ``_schedules/prefetch``, ``_schedules/unchanged``) decide
what to copy and when, and hand it down as data (the views, the slots, which ones go by pointer); the
copies themselves are queued only by this layer, so every copy of the pool passes its switch points
([Note: switch points]) and its streams.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import torch

from .._state.plan import Plan
from .driver import DriverQueue
from .streams import TransferStreams

__all__ = ["copy_group_in", "copy_now", "copy_out", "int64_on", "taken_to"]


def copy_out(streams: TransferStreams, slots: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             storages: Iterable[int]) -> None:
    """Queues the D2H copies ``sources[si] -> slots[si]`` of ``storages`` on the D2H stream, through its
    switch points (on the CPU: done now). The caller has made the D2H stream wait for what it must.

    Args:
        streams: the device's streams.
        slots: the pool views, 1D uint8, one per storage of the plan.
        sources: the device views, 1D uint8, one per storage of the plan.
        storages: the indices to copy, in order.
    """
    if not streams.is_cuda:
        for si in storages:
            slots[si].copy_(sources[si])
        return
    switch = streams.switch("d2h")
    with torch.cuda.stream(streams.d2h):
        for si in storages:
            switch.copy(slots[si], sources[si])  # see [Note: switch points]


def copy_group_in(plan: Plan, storages: Iterable[int], slots: Sequence[torch.Tensor], streams: TransferStreams,
                  device_views: Sequence[torch.Tensor] | None, queue: DriverQueue | None = None,
                  by_pointer: Container[int] = ()) -> None:
    """Queues the H2D copies ``slots[si] -> plan.storages[si]`` of ``storages`` (allocated; the empty ones
    skipped), in order, on the H2D stream through its switch points (on the CPU: done now).

    Args:
        plan: what moves.
        storages: the indices to copy, in order.
        slots: the pool views, 1D uint8.
        streams: the device's streams.
        device_views: the plan's cached 1D uint8 device views, or ``None`` to make them.
        queue: the issuer thread's driver queue ([Note: copies queued by pointer] in ``driver``), or ``None``.
        by_pointer: the storages to queue through ``queue`` by address (their slots pinned); the others
            go through ``copy_``.
    """
    cuda = streams.is_cuda
    switch = streams.switch("h2d") if cuda else None  # see [Note: switch points]
    for si in storages:
        if not plan.nbytes[si]:
            continue
        if queue is not None and si in by_pointer:  # see [Note: copies queued by pointer]
            assert switch is not None
            switch.copy_by_pointer(queue, plan.storages[si].data_ptr(), slots[si].data_ptr(), plan.nbytes[si])
            continue
        dst = (device_views[si] if device_views is not None
               else torch.empty(0, dtype=torch.uint8, device=plan.device).set_(plan.storages[si]))
        if switch is not None:
            with torch.cuda.stream(streams.h2d):
                switch.copy(dst, slots[si])
        else:
            dst.copy_(slots[si])


def int64_on(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, without a host sync (pinned, non-blocking): the hashes'
    tables and constants."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def taken_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` on the current stream: a tensor the caller gave another shape or dtype while its state
    was away, taken to the device as it is (not into the planned storage: not a bulk transfer)."""
    return t.to(device)


def copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on the current stream, in its order: a copy that is the caller's own work (a
    tensor given new bytes on the host, copied into the storage the ferry planned; a check that reads
    device bytes back), not a bulk transfer."""
    dst.copy_(src)
