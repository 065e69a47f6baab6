"""The H2D copies back from the pool, each storage re-allocated first.

[Note: reload allocates on the caller's stream]
Reload re-allocates each storage on the caller's (current) stream, the stream
that will use it, and the H2D stream first waits for everything already queued
there: the block may have been freed by pending current-stream work, and
writing it before that work ran would corrupt it. The current stream then
waits for the H2D event, so the next kernel sees complete data without a host
sync. Allocation and copies are interleaved per storage (an allocation that queues
nothing, ``resize_``: [Note: no arena under a layer-wise reload] in ``arena.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._host.layout import HostViews
from .._state.plan import Plan
from .copies import device_view, undo_allocations
from .gates import AllocGate, TailMark, upload_rows
from .packing import PackChunk, unpack_from_host
from .streams import TransferStreams

__all__ = ["H2DEarly", "H2DIssued", "issue_h2d"]


class H2DEarly(NamedTuple):
    """The mark of :func:`issue_h2d` (:class:`~torchferry._core._transfer.gates.TailMark`).

    Attributes:
        event: recorded on the H2D stream after the copies of ``storages``.
        storages: large ones, in copy order, copied while more than the mark's bytes were left.
        staged: what :func:`~torchferry._core._transfer.gates.upload_rows` uploaded just before the
            event, for the mark's rows, or ``None``.
    """

    event: torch.cuda.Event
    storages: list[int]
    staged: tuple[list[int], torch.Tensor | None] | None = None


class H2DIssued(NamedTuple):
    """What :func:`issue_h2d` queued: events on the H2D stream (``None`` on the CPU).

    Attributes:
        event: recorded after the last copy.
        start: recorded before the first copy (timing).
        early: with a ``mark``, the event recorded once at most its ``tail_bytes`` of large and
            packed storages were left to copy, if there were more; ``None`` otherwise.
        allocated: the storages it allocated (an undo frees them again), never one an offload kept.
    """

    event: torch.cuda.Event | None
    start: torch.cuda.Event | None
    early: H2DEarly | None = None
    allocated: tuple[int, ...] = ()


def issue_h2d(plan: Plan, views: HostViews, streams: TransferStreams, *, storages: list[int] | None = None,
              device_views: list[torch.Tensor] | None = None, gate: AllocGate | None = None,
              mark: TailMark | None = None) -> H2DIssued:
    """Re-allocates storages on the current stream and queues their H2D copies from the pool.

    Large storages first, each copied as soon as it is allocated; then the
    packed chunks, each chunk's storages allocated while its DMA is in flight
    (see [Note: packing pipeline]). The current stream is *not* made to wait:
    the caller decides which streams wait for the returned event.

    A storage already allocated at its size (one the offload kept: [Note: a storage shared
    with a tensor the ferry does not know]) is not ``resize_``d (that would move its bytes to a
    new block) nor freed by an undo; its copy writes the pool's bytes into it.

    Args:
        plan, views: what moves and where it is in the pool.
        streams: the device's streams.
        storages: indices to bring back (default: all); the others stay as they are.
        device_views: the plan's cached 1D uint8 device views (they follow
            ``resize_``), or ``None`` to make them.
        gate: a swap's outgoing storages, asked with the bytes allocated so far, including the
            next storage, before each allocation (swap's budget).
        mark: on a GPU, record :attr:`H2DIssued.early` once at most ``mark.tail_bytes`` bytes
            (large and packed storages) are left to copy, if there were more; just before it, upload
            ``mark.rows`` of the storages copied so far on the H2D stream (in that stream's order).

    Raises:
        torch.OutOfMemoryError: the device ran out of memory; everything this
            call allocated was freed again.
        BaseException: anything else raised midway, after the same undo.
    """
    cuda = streams.is_cuda
    # Switch points only where other work runs beside the copies ([Note: switch points]): a reload
    # from the device's default stream makes that stream wait for all of it, so nothing of the
    # caller's competes for the engine, and the pieces would cost 2-4% of the rate for nothing.
    switched = cuda and streams.current() != torch.cuda.default_stream(plan.device)
    wanted = range(len(plan.storages)) if storages is None else storages
    wanted_set = None if storages is None else set(storages)
    allocated_idx: list[int] = []
    start = None
    early: H2DEarly | None = None
    try:
        if cuda:
            h2d = streams.h2d
            h2d.wait_stream(streams.current())  # see [Note: reload allocates on the caller's stream]
            start = streams.event(h2d, timing=True)
        allocated = 0
        packed = views.packed
        nbytes = plan.nbytes
        sts = plan.storages

        def alloc(si: int) -> torch.Tensor | None:
            nonlocal allocated
            n = nbytes[si]
            allocated += n
            if gate is not None:
                gate.before_alloc(allocated)
            if sts[si].nbytes() != n:  # else kept by the offload
                sts[si].resize_(n)
                allocated_idx.append(si)
            return device_view(plan, si, device_views) if n else None

        large = [si for si in wanted if si not in packed]
        left = -1  # bytes left to copy, large and packed, while a mark is to come
        tail = mark.tail_bytes if mark is not None else 0
        rows = mark.rows if mark is not None else None
        if cuda and mark is not None:
            left = sum(nbytes[si] for si in wanted)
            if left <= tail:  # all of it is tail: nothing to hash early
                left = -1
        copied_idx: list[int] = []
        for si in large:
            dst = alloc(si)
            if dst is None:
                continue
            if cuda:
                with torch.cuda.stream(h2d):
                    if switched:
                        streams.switch("h2d").copy(dst, views.slots[si])  # see [Note: switch points]
                    else:
                        dst.copy_(views.slots[si], non_blocking=True)
                if left >= 0:
                    copied_idx.append(si)
                    left -= nbytes[si]
                    if left <= tail:
                        staged = None
                        if rows is not None:
                            with torch.cuda.stream(h2d):
                                staged = upload_rows(copied_idx, rows,
                                                     lambda i: device_view(plan, i, device_views).data_ptr(),
                                                     plan.device)
                        early = H2DEarly(streams.event(h2d), copied_idx, staged)
                        left = -1
            else:
                dst.copy_(views.slots[si])
        chunks = views.chunks
        pool_chunks = views.pool_chunks
        if wanted_set is not None:
            keep = [k for k, ch in enumerate(chunks) if any(si in wanted_set for si in ch.storages)]
            chunks = [chunks[k] for k in keep]
            pool_chunks = [pool_chunks[k] for k in keep]
        if gate is None and device_views is not None:
            def alloc_chunk(ch: PackChunk) -> list[torch.Tensor]:
                # Thousands of small storages: one tight loop (see [Note: packing pipeline]).
                for si in ch.storages:
                    if sts[si].nbytes() != nbytes[si]:  # else kept by the offload
                        allocated_idx.append(si)  # before: freeing one not yet allocated is harmless
                        sts[si].resize_(nbytes[si])
                return [device_views[si] for si in ch.storages]
        else:
            def alloc_chunk(ch: PackChunk) -> list[torch.Tensor]:
                # alloc() returns None only for a 0-byte storage, and packed storages are non-empty
                return [alloc(si) for si in ch.storages]  # pyright: ignore[reportReturnType]

        unpack_from_host(chunks, pool_chunks, alloc_chunk, plan.device, streams, switched=switched)
    except BaseException:
        undo_allocations(plan, allocated_idx, streams)
        raise
    event = streams.event(streams.h2d, timing=True) if cuda else None
    return H2DIssued(event, start, early, tuple(allocated_idx))
