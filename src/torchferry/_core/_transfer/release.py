"""Freeing the device memory of an offload's storages after their D2H copies, all or nothing: the
release, its undo from the pool, and its completion where that undo fails.

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
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .._state.plan import Plan
from .copies import device_view, free_quietly
from .signals import uninterruptible
from .streams import TransferStreams, wait_event

__all__ = ["ReleaseRolledForward", "release", "restore_released", "undo_release"]

logger = logging.getLogger("torchferry")


def release(plan: Plan, sources: list[torch.Tensor], slots: list[torch.Tensor], streams: TransferStreams,
            copied: torch.cuda.Event | None,
            gathered: tuple[frozenset[int], torch.cuda.Event] | None = None,
            kept: frozenset[int] = frozenset()) -> torch.cuda.Event | None:
    """Frees the device memory of ``plan``'s storages after their D2H copies (see
    [Note: release is safe against the in-flight copy]), all or nothing ([Note: a release undone
    from the pool]: ``slots``, the pool views, and ``copied``, the D2H copies' last event, serve
    its undo). ``gathered`` (from :class:`~torchferry._core._transfer.copies.D2HIssued`): packed
    storages read only by the ``gather`` stream's kernels, freed after the caller's stream waits
    for them ([Note: small storages released without an event each]). ``kept``: storages a tensor
    the ferry does not know views, left allocated; the caller's stream waits for ``copied`` first,
    so that a write through that tensor cannot reach the pool ([Note: a storage shared with a
    tensor the ferry does not know]).

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
            src = sources[si]
            storage = plan.storages[si]
            if cuda and src.numel():
                # current is set where storages are packed, d2h on a GPU
                src.record_stream(current if si in packed else d2h)  # pyright: ignore[reportArgumentType]
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
        self.error = error
        self.undo_error = undo_error


def undo_release(plan: Plan, indices: Iterable[int], slots: list[torch.Tensor],
                 copied: torch.cuda.Event | None, error: BaseException) -> None:
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
        logger.warning("torchferry: waiting for the offload's copies failed while completing a release",
                       exc_info=True)
    for si in indices:
        free_quietly(plan, si, "completing a release")


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
        device_view(plan, si, None).copy_(slots[si])
