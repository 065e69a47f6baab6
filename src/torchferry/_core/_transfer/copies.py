"""The D2H copies into the pool, and what the copy primitives share: the profiler ranges, a storage's
device view, and freeing storages again after a failed H2D. The H2D copies back are in ``_transfer/h2d``;
freeing the device memory after the D2H copies, and its undo, in ``_transfer/release``.

They know storages, pool views and streams; nothing of residency, hooks or schedules (those live above,
in ``_ferry/machine``, ``_schedules/prefetch``, ``_schedules/early`` and ``_schedules/release``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .._host.layout import HostViews
from .._state.plan import Plan
from .packing import PackChunk, pack_to_host
from .signals import uninterruptible
from .streams import TransferStreams

__all__ = ["D2HIssued", "copy_runs", "device_view", "free_quietly", "issue_d2h", "transfer_range",
           "undo_allocations"]

logger = logging.getLogger("torchferry")


@contextlib.contextmanager
def transfer_range(direction: str, nbytes: int):
    """Profiler ranges ``torchferry::d2h`` / ``torchferry::h2d``, and inside, one naming the bytes.

    ``record_function``'s ``args`` string does not reach Chrome/Perfetto
    traces (checked with torch 2.13), so the bytes go into a nested range's
    name: ``torchferry::d2h bytes=123``.
    """
    with torch.profiler.record_function(f"torchferry::{direction}"), \
            torch.profiler.record_function(f"torchferry::{direction} bytes={nbytes}"):
        yield


class D2HIssued(NamedTuple):
    """What :func:`issue_d2h` queued (events are ``None`` on the CPU, where the copies are done).

    Attributes:
        event: recorded on the D2H stream after the last copy.
        start: recorded on the D2H stream before the first copy (timing).
        progress: ``(bytes copied, event)`` every ``progress_every`` bytes, last one final.
        copied_after: per storage, the bytes copied once its copy is done (with ``progress_every``).
        gathered: the packed storages' indices and the event after their last gather on the
            ``gather`` stream ([Note: small storages released without an event each]); ``None``
            where the gathers reused staging buffers (then they waited for DMAs) or there were none.
    """

    event: torch.cuda.Event | None
    start: torch.cuda.Event | None
    progress: list[tuple[int, torch.cuda.Event]]
    copied_after: list[int] | None
    gathered: tuple[frozenset[int], torch.cuda.Event] | None = None


def issue_d2h(plan: Plan, sources: list[torch.Tensor], views: HostViews, skip: set[int],
              streams: TransferStreams, *, progress_every: int | None = None) -> D2HIssued:
    """Queues the D2H copies of ``plan``'s storages into their pool slots.

    Args:
        plan: what moves.
        sources: 1D uint8 device views of ``plan.storages`` (allocated).
        views: the plan's host views.
        skip: storage indices whose slots already hold their bytes (packed ones
            too: their chunks are copied in runs, see :func:`copy_runs`).
        streams: the device's streams (the D2H stream first waits for the current one).
        progress_every: record a progress event every this many bytes (swap's budget).
    """
    slots = views.slots
    packed = views.packed
    large = [si for si, src in enumerate(sources) if src.numel() and si not in packed and si not in skip]
    if skip & packed:
        chunks, pool_chunks = copy_runs(views.chunks, views.pool_chunks, skip)
    else:
        chunks = views.chunks
        pool_chunks = views.pool_chunks
    if not streams.is_cuda:
        for si in large:
            slots[si].copy_(sources[si])
        pack_to_host(chunks, sources, pool_chunks, plan.device)
        return D2HIssued(None, None, [], None)
    d2h = streams.d2h
    caller = streams.event()  # on the caller's stream: the packed storages' gathers wait for it
    d2h.wait_event(caller)  # copy what pending kernels write
    start = streams.event(d2h, timing=True)
    progress: list[tuple[int, torch.cuda.Event]] = []
    copied = 0
    mark = 0
    copied_after = [0] * len(sources) if progress_every else None
    switch = streams.switch("d2h")
    with torch.cuda.stream(d2h):
        for si in large:
            switch.copy(slots[si], sources[si])  # see [Note: switch points]
            if copied_after is not None:
                copied += plan.nbytes[si]
                copied_after[si] = copied
                # progress_every is set where copied_after is
                if copied - mark >= progress_every:  # pyright: ignore[reportOperatorIssue]
                    progress.append((copied, streams.event(d2h)))
                    mark = copied
        last_gather = pack_to_host(chunks, sources, pool_chunks, plan.device, streams, after=caller,
                                   own_buffers=progress_every is None)  # a swap's budget counts no staging
    event = streams.event(d2h, timing=True)
    gathered = None
    if last_gather is not None:
        gathered = (frozenset(si for ch in chunks for si in ch.storages), last_gather)
    if copied_after is not None:
        copied += sum(ch.nbytes for ch in chunks)
        for ch in chunks:  # the packed ones are complete at the final event only
            for si in ch.storages:
                copied_after[si] = copied
        progress.append((copied, event))
    return D2HIssued(event, start, progress, copied_after, gathered)


def copy_runs(chunks: list[PackChunk], pool_chunks: list[torch.Tensor],
              skip: set[int]) -> tuple[list[PackChunk], list[torch.Tensor]]:
    """The packed chunks cut into runs of consecutive storages not in ``skip``, one DMA per run
    (and their pool views); a chunk without skipped storages stays whole."""
    out: list[PackChunk] = []
    out_pool: list[torch.Tensor] = []
    for ch, pool in zip(chunks, pool_chunks, strict=False):
        keep = [k for k, si in enumerate(ch.storages) if si not in skip]
        if len(keep) == len(ch.storages):
            out.append(ch)
            out_pool.append(pool)
            continue
        runs: list[list[int]] = []
        for k in keep:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        for run in runs:
            a = ch.offsets[run[0]]
            last = run[-1]
            b = ch.offsets[last] + ch.split_sizes[2 * last]
            split = [n for k in run for n in ch.split_sizes[2 * k:2 * k + 2]]
            split[-1] = 0
            out.append(PackChunk([ch.storages[k] for k in run], [ch.offsets[k] - a for k in run],
                                 ch.pool_offset + a, b - a, split))
            out_pool.append(pool[a:b])
    return out, out_pool


def undo_allocations(plan: Plan, indices: Iterable[int], streams: TransferStreams) -> None:
    """Frees the re-allocated storages ``indices`` again, after the copies into them.

    Never raises, and no signal interrupts it (it runs inside the undo of a failed call, which must
    complete: [Note: all or nothing], [Note: an undo is not interrupted]): a storage that cannot be
    freed is logged and stays allocated; no tensor views it, and the next reload re-allocates it.
    """
    with uninterruptible():  # see [Note: an undo is not interrupted]
        if streams.is_cuda:
            streams.h2d.synchronize()
            streams.pack.synchronize()
        for si in indices:
            free_quietly(plan, si)


def free_quietly(plan: Plan, si: int, during: str = "undoing a transfer") -> None:
    """Frees storage ``si`` if allocated; never raises (inside an undo, which must complete): a storage
    that cannot be freed is logged and stays allocated, viewed by no tensor, until the next reload."""
    try:
        if plan.storages[si].nbytes():
            plan.storages[si].resize_(0)
    except BaseException:  # noqa: B036 (see above)
        logger.warning("torchferry: could not free storage %d while %s; "
                       "it stays allocated until the next reload", si, during, exc_info=True)


def device_view(plan: Plan, si: int, device_views: list[torch.Tensor] | None) -> torch.Tensor:
    """Storage ``si`` as a 1D uint8 device tensor: the cached view where there is one."""
    if device_views is not None:
        return device_views[si]
    return torch.empty(0, dtype=torch.uint8, device=plan.device).set_(plan.storages[si])
