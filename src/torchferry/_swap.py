"""Swap: one state set out while another comes in, on the two copy engines at once.

Colocated PPO keeps several models on the same GPUs (actor, critic,
reference). Moving one out while the next comes in uses both copy engines:
94.4 GB/s both ways against 55.3 GB/s one way on an H200
(``shared/anchors/bw.json``).

[Note: swap budget]
A plain offload releases its storages with ``record_stream``: the caching
allocator then hands a block out again only after an event recorded at
release time, that is after *all* the offload's copies (measured on an H200:
the incoming state took fresh memory, 1 GiB over a 256 MiB budget). So swap
keeps the outgoing storages allocated, and before each incoming allocation it
waits for the D2H progress event (recorded every 256 MiB) that covers enough
outgoing bytes for the incoming state, the outgoing bytes still in flight and
everything else allocated to stay within ``gpu_budget_bytes``, then releases
the storages whose copies are complete: their blocks are free at once, for the
incoming storages. Whatever is left is released as usual once the reload is
issued.
"""

from __future__ import annotations

import torch

from ._ferry import Ferry
from ._handle import TransferHandle

__all__ = ["swap"]


def swap(out: Ferry, into: Ferry, *, gpu_budget_bytes: int | None = None) -> tuple[TransferHandle, TransferHandle]:
    """Offloads ``out`` and reloads ``into`` at the same time (D2H and H2D streams).

    Args:
        out: a ferry whose state is on the device (a no-op for it otherwise).
        into: a ferry whose state is offloaded (a no-op for it otherwise).
        gpu_budget_bytes: device bytes that everything allocated on the device
            may reach during the swap (see [Note: swap budget]); ``None``: no
            limit beyond the device's own.

    Returns:
        ``(offload_handle, reload_handle)``.

    Raises:
        ValueError: the two ferries are one, or on different devices, or the
            budget is negative or cannot hold what is allocated besides ``out``
            plus ``into``'s state.
        RuntimeError: a ferry is closed, or ``into``'s reload failed (``out``
            is then reloaded too, so neither moved).
    """
    if out is into:
        raise ValueError("torchferry.swap: out and into are the same ferry")
    if out.device != into.device:
        raise ValueError(f"torchferry.swap: out is on {out.device} but into on {into.device}")
    if gpu_budget_bytes is not None and gpu_budget_bytes < 0:
        raise ValueError(f"torchferry.swap: gpu_budget_bytes must be >= 0, got {gpu_budget_bytes}")
    out._check_open()
    into._check_open()
    cuda = out.device.type == "cuda"
    base = torch.cuda.memory_allocated(out.device) if cuda else 0
    out_bytes = out.state_bytes if not out.residency.on_host else 0
    if gpu_budget_bytes is not None and cuda:
        need = base - out_bytes + into.state_bytes
        if need > gpu_budget_bytes:
            raise ValueError(
                f"torchferry.swap: gpu_budget_bytes={gpu_budget_bytes} but the incoming state "
                f"({into.state_bytes} bytes) plus what stays allocated ({base - out_bytes} bytes) needs {need}"
            )
    out._track_progress = True
    try:
        h_out = out.offload()
    finally:
        out._track_progress = False
    progress = list(out._progress) if cuda else []
    out_bytes = h_out.nbytes if progress else 0

    def before_alloc(allocated: int) -> None:
        # Outgoing bytes that must have left: base + in-flight out + incoming <= budget.
        must_have_left = base + allocated - gpu_budget_bytes  # base still counts all of out
        if must_have_left <= 0:
            return
        for copied, event in progress:
            if copied >= min(must_have_left, out_bytes):
                event.synchronize()
                out._release_copied(copied)
                return

    if gpu_budget_bytes is not None and progress:
        into._before_alloc = before_alloc
    try:
        h_in = into.reload()
    except BaseException:
        out._release_copied(None)
        out.reload()  # all or nothing: bring the outgoing state back before raising
        raise
    finally:
        into._before_alloc = None
        out._release_copied(None)
    return h_out, h_in
