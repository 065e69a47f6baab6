"""Swap: one state set out while another comes in, on the two copy engines at once.

Colocated PPO keeps several models on the same GPUs (actor, critic,
reference). Moving one out while the next comes in uses both copy engines:
97.6 GB/s both ways against 55.5 / 55.3 GB/s one way on one H200
(``link_peak_GBps`` in ``benchmarks/results/bench-pin-pinning_h200x1_2026-11-30.json``).

The outgoing state keeps its device memory until its copies land, so the
incoming state stays within ``gpu_budget_bytes`` (see [Note: swap budget] in
``_schedules/release``).
"""

from __future__ import annotations

import torch

from .._api.args import check_bytes, shown
from .ferry import Ferry
from .._api.handle import TransferHandle
from .interrupts import interrupts_deferred
from .._schedules.release import ReleaseSchedule

__all__ = ["swap", "swap_fits", "swap_if_fits"]


@interrupts_deferred
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
        TypeError: ``out`` or ``into`` is not a :class:`~torchferry.Ferry`.
        ValueError: the two ferries are one, or on different devices, or the
            budget is not an int >= 0 or cannot hold what is allocated besides
            ``out`` plus ``into``'s state.
        RuntimeError: a ferry is closed, or being moved by another thread (nothing moved), or
            ``into``'s reload failed (``out`` is then reloaded too, so neither moved; a reload that
            completed before raising leaves both moved).
    """
    swapped = _checked_swap(out, into, gpu_budget_bytes, "swap", refuse=True)
    assert swapped is not None
    return swapped


@interrupts_deferred
def swap_if_fits(out: Ferry, into: Ferry, gpu_budget_bytes: int | None) -> tuple[TransferHandle, TransferHandle] | None:
    """:func:`swap`, or ``None`` with nothing moved where ``gpu_budget_bytes`` cannot hold it (:func:`swap_fits`):
    the question and the swap under one measurement of the device's memory. A dock asked :func:`swap_fits`
    first and then called :func:`swap`, which measured again: an allocation by another thread in between made
    the swap refuse where the dock would have evicted, then loaded.

    Raises:
        As :func:`swap`, but for a budget that cannot hold it.
    """
    return _checked_swap(out, into, gpu_budget_bytes, "swap_if_fits", refuse=False)


def _checked_swap(out: object, into: object, gpu_budget_bytes: int | None, what: str, *,
                  refuse: bool) -> tuple[TransferHandle, TransferHandle] | None:
    """The arguments checked (errors named as ``what``), then :func:`_swap` with both ferries entered."""
    for name, ferry in (("out", out), ("into", into)):
        if not isinstance(ferry, Ferry):
            raise TypeError(f"torchferry: {what}({name}=...) must be a torchferry.Ferry, got {shown(ferry)}")
    check_bytes(gpu_budget_bytes, f"{what}(gpu_budget_bytes=...)")
    if out is into:
        raise ValueError(f"torchferry: {what}: out and into are the same ferry")
    assert isinstance(out, Ferry) and isinstance(into, Ferry)
    if out.device != into.device:
        raise ValueError(f"torchferry: {what}: out is on {out.device} but into on {into.device}")
    with out._mover.entered("swap()", out.__repr__), into._mover.entered("swap()", into.__repr__):
        return _swap(out, into, gpu_budget_bytes, refuse=refuse)  # see [Note: one thread moves a ferry]


def _staying(out: Ferry) -> int:
    """Device bytes allocated now besides ``out``'s state (on the CPU: 0)."""
    if out.device.type != "cuda":
        return 0
    return torch.cuda.memory_allocated(out.device) - (out.state_bytes if not out.residency.on_host else 0)


def swap_fits(out: Ferry, into: Ferry, gpu_budget_bytes: int | None) -> bool:
    """Whether :func:`swap` would take ``gpu_budget_bytes``: ``None``, or on the CPU, or an int >= 0 that holds
    what is allocated besides ``out`` plus ``into``'s state (the dock asks before a swap, instead of catching
    the ``ValueError``)."""
    if gpu_budget_bytes is None or out.device.type != "cuda":
        return True
    return gpu_budget_bytes >= 0 and _staying(out) + into.state_bytes <= gpu_budget_bytes


def _swap(out: Ferry, into: Ferry, gpu_budget_bytes: int | None, *,
          refuse: bool) -> tuple[TransferHandle, TransferHandle] | None:
    out._check_open()
    into._check_open()
    cuda = out.device.type == "cuda"
    base = torch.cuda.memory_allocated(out.device) if cuda else 0
    if not swap_fits(out, into, gpu_budget_bytes):
        if not refuse:
            return None
        stays = _staying(out)
        raise ValueError(
            f"torchferry: swap: gpu_budget_bytes={gpu_budget_bytes} but the incoming state "
            f"({into.state_bytes} bytes) plus what stays allocated ({stays} bytes) needs {stays + into.state_bytes}"
        )
    schedule = ReleaseSchedule(gpu_budget_bytes if cuda else None, base)
    out_was_away = out.residency.on_host  # then the swap does not move it, nor bring it back on a failure
    try:
        h_out = out._offload(schedule)
    except BaseException:  # offloaded all the same ([Note: a release rolled forward]): what it held is freed now
        schedule.release_rest()
        raise
    try:
        h_in = into._reload(False, schedule)
    except BaseException as failed:
        try:
            schedule.release_rest()
        finally:
            if into.residency.on_host and not out_was_away:  # all or nothing: the outgoing state back first
                _bring_back(out, failed)
            # else the reload completed before raising (an error in its bookkeeping after the move):
            # the swap completed; reloading `out` too would hold both sets on the device at once
        raise
    schedule.release_rest()
    return h_out, h_in


def _bring_back(out: Ferry, failed: BaseException) -> None:
    """``out`` reloaded after ``into``'s reload raised ``failed``; if that reload fails too, one error naming
    both (``out`` then stays offloaded, whole: each reload is all or nothing)."""
    try:
        out.reload()
    except Exception as e:
        raise RuntimeError(f"torchferry: swap: into's reload failed ({type(failed).__name__}: {failed}) and "
                           f"bringing out back failed too ({type(e).__name__}: {e}); both stay offloaded, "
                           "out.reload() retries") from failed
