"""The copy primitives: D2H into the pool, release, H2D back with re-allocation, undo.

They know storages, pool views and streams; nothing of residency, hooks or
schedules (those live above, in ``_ferry/ferry``, ``_schedules/prefetch``, ``_schedules/early`` and
``_schedules/release``).

[Note: release is safe against the in-flight copy]
The D2H copies read a storage on the D2H stream while the caller's stream
carries on. Before ``resize_(0)`` frees the block we ``record_stream`` it on the
D2H stream, so the caching allocator does not hand it to the caller's stream
until the copy has finished (otherwise a new allocation could overwrite bytes
not yet copied: silent corruption of the offloaded state).

[Note: small storages released without an event each]
A packed storage is read by one gather kernel on the pack stream, not by the
DMA. ``record_stream`` on each would leave one caching-allocator event per
storage, and the next allocation (the reload's first) processes them all
while the copy engine idles: with 4096 storages of 256 KiB, about 10 ms
before the first H2D copy, the reload at 35.8 against 52.8 GB/s without
those events (``git show 75cc57c:benchmarks/results/probe_unpack_h200_2026-12-01_events.json``),
and 1.75 against 0.45 us of host time per free
(``git show 75cc57c:benchmarks/results/probe_small_host_h200_2026-12-01_run2.json``).
So where every chunk has a staging buffer of its own (no gather waits for a
DMA, see [Note: packing pipeline]) and the gathers run on the ``gather``
stream, which holds nothing that waits for a copy (another ferry's reload
scatters and buffer-reusing gathers run on ``pack``), the caller's stream
waits for the last gather, a device-to-device copy queued right after the
caller's own work, and each packed storage is freed with ``record_stream``
on the caller's stream, which the allocator ignores for blocks of that very
stream (the usual case) and turns into an event for blocks of another one. Where the
staging buffers are reused, the gathers wait for DMAs and the storages are
freed with an event each, as the large ones are.

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

import contextlib
import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .._host.layout import HostViews
from .packing import PackChunk, pack_to_host, unpack_from_host
from .._state.plan import Plan
from .gates import AllocGate, TailMark, upload_rows
from .signals import uninterruptible
from .streams import TransferStreams, wait_event

__all__ = ["D2HIssued", "H2DEarly", "H2DIssued", "ReleaseRolledForward", "copy_runs", "issue_d2h", "issue_h2d",
           "release", "restore_released", "transfer_range", "undo_allocations", "undo_release"]

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
    slots, packed = views.slots, views.packed
    large = [si for si, src in enumerate(sources) if src.numel() and si not in packed and si not in skip]
    chunks, pool_chunks = copy_runs(views.chunks, views.pool_chunks, skip) if skip & packed else (
        views.chunks, views.pool_chunks)
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
    copied, mark = 0, 0
    copied_after = [0] * len(sources) if progress_every else None
    switch = streams.switch("d2h")
    with torch.cuda.stream(d2h):
        for si in large:
            switch.copy(slots[si], sources[si])  # see [Note: switch points]
            if copied_after is not None:
                copied += plan.nbytes[si]
                copied_after[si] = copied
                if copied - mark >= progress_every:  # pyright: ignore[reportOperatorIssue]  # set on this path (progress_every with copied_after; d2h stream when cuda; packed storages are non-empty)
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
            a, last = ch.offsets[run[0]], run[-1]
            b = ch.offsets[last] + ch.split_sizes[2 * last]
            split = [n for k in run for n in ch.split_sizes[2 * k:2 * k + 2]]
            split[-1] = 0
            out.append(PackChunk([ch.storages[k] for k in run], [ch.offsets[k] - a for k in run],
                                 ch.pool_offset + a, b - a, split))
            out_pool.append(pool[a:b])
    return out, out_pool


def release(plan: Plan, sources: list[torch.Tensor], slots: list[torch.Tensor], streams: TransferStreams,
            copied: torch.cuda.Event | None,
            gathered: tuple[frozenset[int], torch.cuda.Event] | None = None,
            kept: frozenset[int] = frozenset()) -> torch.cuda.Event | None:
    """Frees the device memory of ``plan``'s storages after their D2H copies (see
    [Note: release is safe against the in-flight copy]), all or nothing ([Note: a release undone
    from the pool]: ``slots``, the pool views, and ``copied``, the D2H copies' last event, serve
    its undo). ``gathered`` (from :class:`D2HIssued`): packed storages read only by the
    ``gather`` stream's kernels, freed after the caller's stream waits for them ([Note: small
    storages released without an event each]). ``kept``: storages a tensor the ferry does not
    know views, left allocated; the caller's stream waits for ``copied`` first, so that a write
    through that tensor cannot reach the pool ([Note: a storage shared with a tensor the ferry
    does not know]).

    Everything that can fail runs before the first storage is freed; the loop that frees them
    calls only ``record_stream`` and ``resize_``.

    Returns:
        On a GPU, an event on the D2H stream recorded after the allocator's own events for the
        freed blocks: once it completes, the allocator hands them out again ([Note: a reload takes
        the blocks its offload freed]); ``None`` on the CPU.

    Raises:
        BaseException: whatever freeing a storage raised, after every storage freed before it was
            given its memory and bytes back.
        ReleaseRolledForward: giving them back failed too; every storage was freed instead.
    """
    cuda = streams.is_cuda
    d2h = streams.d2h if cuda else None
    packed: frozenset[int] = frozenset()
    current = None
    if cuda and gathered is not None:
        packed, last_gather = gathered
        current = streams.current()
        wait_event(current, last_gather)
    if cuda and kept and copied is not None:
        wait_event(streams.current(), copied)
    freed = [si for si in range(len(plan.storages)) if si not in kept]
    try:
        for si in freed:
            src, storage = sources[si], plan.storages[si]
            if cuda and src.numel():
                src.record_stream(current if si in packed else d2h)  # pyright: ignore[reportArgumentType]  # set on this path (progress_every with copied_after; d2h stream when cuda; packed storages are non-empty)
            storage.resize_(0)
    except BaseException as error:
        undo_release(plan, freed, slots, copied, error)
        raise
    return streams.event(d2h) if cuda else None


class ReleaseRolledForward(BaseException):
    """A release failed part-way and so did its undo: it was completed instead ([Note: a release
    rolled forward]). The caller completes its move too, then raises :attr:`error`.

    Attributes:
        error: what freeing a storage raised.
        undo_error: what the undo (allocating again, copying back) raised.
    """

    def __init__(self, error: BaseException, undo_error: BaseException) -> None:
        super().__init__(f"release rolled forward after {undo_error!r}")
        self.error, self.undo_error = error, undo_error


def undo_release(plan: Plan, indices: Iterable[int], slots: list[torch.Tensor], copied: torch.cuda.Event | None,
                 error: BaseException) -> None:
    """Undoes a partial release of the storages ``indices`` ([Note: a release undone from the pool]),
    or, where that fails, completes it ([Note: a release rolled forward]); no signal interrupts either
    ([Note: an undo is not interrupted]). Returns once undone (the caller raises ``error``).

    [Note: a release rolled forward]
    The undo of a release allocates device memory again, which can fail too: an
    out-of-memory (another stream took the blocks), or a signal. An undo that
    stopped there left some storages at 0 bytes under a ferry reporting DEVICE
    (a forward raised, a ``state_dict()`` clone crashed). But when the undo
    starts, every pool slot holds its storage's bytes (see the Note above), so
    the other way out is always open: free every storage of ``indices`` still
    allocated (the ones the undo had allocated again included), once the
    copies' event has passed, and let the caller finish its move as if the
    release had succeeded (residency HOST, guards on; a reload brings every
    byte back). The caller then raises ``error``, with the undo's failure as
    its ``__cause__``. A storage whose ``resize_(0)`` fails even then stays
    allocated, viewed by no tensor: the next reload's ``resize_`` keeps it and
    copies its bytes in (logged).

    Raises:
        ReleaseRolledForward: the undo failed and the release was completed instead.
    """
    indices = list(indices)
    with uninterruptible():
        try:
            restore_released(plan, indices, slots, copied)
        except BaseException as undo_error:
            _roll_forward(plan, indices, copied)
            undo_error.__context__ = None  # the chain is error -> undo_error, made by the caller
            raise ReleaseRolledForward(error, undo_error) from None


def _roll_forward(plan: Plan, indices: list[int], copied: torch.cuda.Event | None) -> None:
    """Frees every storage of ``indices`` still allocated, after ``copied``; never raises."""
    try:
        if copied is not None:
            copied.synchronize()
    except BaseException:  # noqa: B036 (a failure path that must complete: logged, nothing else left to do)
        logger.warning("torchferry: waiting for the offload's copies failed while completing a release", exc_info=True)
    for si in indices:
        _free_quietly(plan, si, "completing a release")


def restore_released(plan: Plan, indices: Iterable[int], slots: list[torch.Tensor],
                     copied: torch.cuda.Event | None) -> None:
    """Undoes a partial release: each storage of ``indices`` that was freed gets its memory back
    (on the current stream) and its bytes from its pool slot, once ``copied`` (the D2H copies'
    last event, or ``None``) has passed.

    [Note: a release undone from the pool]
    An offload frees its device storages last, one ``resize_(0)`` each. An
    exception raised there after some were freed (a signal handler's
    ``SystemExit``, an error of the allocator) used to leave the call's undo
    re-pointing tensors at 0-byte storages: the ferry reported DEVICE, the next
    offload refused, the reload did nothing, a forward raised and cloning the
    ``state_dict()`` crashed the process (since 9af4330, seen at 0e8596e). At
    that point every slot holds its storage's bytes (the D2H copies were issued
    before the release, and a storage skipped as unchanged or copied early is
    one whose slot already held them), so the freed storages are allocated again
    and copied back from their slots after the copies' event, synchronously (a
    failure path: the host waits), and the caller's undo then finds every
    storage as it was. The memory was freed a moment ago, so the allocation
    finds it (the caching allocator waits for a block's pending events before
    it reports out of memory).
    """
    lost = [si for si in indices if plan.nbytes[si] and plan.storages[si].nbytes() == 0]
    if not lost:
        return
    if copied is not None:
        copied.synchronize()
    for si in lost:
        plan.storages[si].resize_(plan.nbytes[si])
        _device_view(plan, si, None).copy_(slots[si])


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
            _free_quietly(plan, si)


def _free_quietly(plan: Plan, si: int, during: str = "undoing a transfer") -> None:
    """Frees storage ``si`` if allocated; never raises (inside an undo, which must complete): a storage
    that cannot be freed is logged and stays allocated, viewed by no tensor, until the next reload."""
    try:
        if plan.storages[si].nbytes():
            plan.storages[si].resize_(0)
    except BaseException:  # noqa: B036 (see above)
        logger.warning("torchferry: could not free storage %d while %s; it stays allocated until the next reload",
                       si, during, exc_info=True)


def _device_view(plan: Plan, si: int, device_views: list[torch.Tensor] | None) -> torch.Tensor:
    if device_views is not None:
        return device_views[si]
    return torch.empty(0, dtype=torch.uint8, device=plan.device).set_(plan.storages[si])


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
        nbytes, sts = plan.nbytes, plan.storages

        def alloc(si: int) -> torch.Tensor | None:
            nonlocal allocated
            n = nbytes[si]
            allocated += n
            if gate is not None:
                gate.before_alloc(allocated)
            if sts[si].nbytes() != n:  # else kept by the offload
                sts[si].resize_(n)
                allocated_idx.append(si)
            return _device_view(plan, si, device_views) if n else None

        large = [si for si in wanted if si not in packed]
        left = -1  # bytes left to copy, large and packed, while a mark is to come
        tail, rows = (mark.tail_bytes, mark.rows) if mark is not None else (0, None)
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
                                                     lambda i: _device_view(plan, i, device_views).data_ptr(),
                                                     plan.device)
                        early, left = H2DEarly(streams.event(h2d), copied_idx, staged), -1
            else:
                dst.copy_(views.slots[si])
        chunks, pool_chunks = views.chunks, views.pool_chunks
        if wanted_set is not None:
            keep = [k for k, ch in enumerate(chunks) if any(si in wanted_set for si in ch.storages)]
            chunks, pool_chunks = [chunks[k] for k in keep], [pool_chunks[k] for k in keep]
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
                return [alloc(si) for si in ch.storages]  # pyright: ignore[reportReturnType]  # set on this path (progress_every with copied_after; d2h stream when cuda; packed storages are non-empty)

        unpack_from_host(chunks, pool_chunks, alloc_chunk, plan.device, streams, switched=switched)
    except BaseException:
        undo_allocations(plan, allocated_idx, streams)
        raise
    event = streams.event(streams.h2d, timing=True) if cuda else None
    return H2DIssued(event, start, early, tuple(allocated_idx))
