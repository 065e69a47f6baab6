"""Small storages moved in batches: packed on the device, one DMA per chunk.

One copy per storage costs a launch and a DMA setup each: 4096 copies of
256 KiB ran at 35.2 GB/s D2H and 36.3 GB/s H2D, 0.64-0.66 of the link, on one
H200 (``small_tensors.per_tensor_*`` in
``benchmarks/results/bench-pin-pinning_h200x1_2026-11-30.json``). Storages under :data:`PACK_BELOW` bytes are
therefore laid out back to back in the pool, in chunks of at most
:data:`PACK_CHUNK` bytes. Offload gathers a chunk's storages into a device
staging buffer with one batched kernel (``torch._foreach_copy_`` over byte
views) and copies the buffer to the pool in one DMA; reload does the reverse.
On the CPU the same path runs (an extra memcpy), so CPU tests cover the
layout.

[Note: packing pipeline]
A chunk is gathered into (scattered out of) its staging buffer with one op:
``torch.cat(out=)`` / ``torch.split_with_sizes_copy(out=)`` when it has no
padding, else ``torch._foreach_copy_`` over per-storage views; making those
views cost about 0.3 ms of host time per chunk of 256 storages, which at 4096
small tensors kept the host, not the link, on the critical path.
On a GPU the batched gather/scatter runs on a third stream (``pack``), so
chunk k+1 is packed while chunk k is on the wire (offload), and chunk k is
scattered while chunk k+1 comes in (reload): the copy engine never waits for
a kernel. Reload alternates two staging buffers. Offload gives every chunk a
staging buffer of its own where they take at most a quarter of the free
device memory (not in a swap, whose budget counts no staging), gathered on a
stream of their own (``gather``) where nothing waits for a copy, so the
sources can be freed without an event each ([Note: small storages released
without an event each] in ``_transfer/release``); else two buffers alternate on
``pack``. The gathers wait for the caller's stream only, not for the large
storages' DMAs queued before them. Events order each buffer's reuse after
the DMA or scatter that last read it; the copy stream waits for the
gathers' stream at the end, so the transfer's final event covers
everything. On reload the chunk's storages are allocated on the host while
its DMA is in flight (4096 allocations took longer than the copies when done
first, on an H200 host). Extra device memory: two chunks (``2 *
PACK_CHUNK``) on reload; on offload one per chunk within the quarter of free
memory, else two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._host.slots import PackChunk
from .._state.fsdp import foreach_copy

__all__ = ["pack_to_host", "unpack_from_host"]


def _views(staging: torch.Tensor, chunk: PackChunk) -> list[torch.Tensor]:
    """Each packed storage's bytes in ``staging`` (one ``split_with_sizes`` call)."""
    return list(staging[: chunk.nbytes].split_with_sizes(chunk.split_sizes)[0::2])


def _gather(staging: torch.Tensor, chunk: PackChunk, sources: list[torch.Tensor]) -> None:
    """Copies the chunk's storages (1D uint8 views, in chunk order) into ``staging``."""
    if chunk.dense:
        torch.cat(sources, out=staging[: chunk.nbytes])
    else:
        foreach_copy(_views(staging, chunk), sources)


def _scatter(staging: torch.Tensor, chunk: PackChunk, dests: list[torch.Tensor]) -> None:
    """Copies ``staging``'s bytes out into the chunk's storages (1D uint8 views, in chunk order)."""
    if chunk.dense:
        torch.split_with_sizes_copy(staging[: chunk.nbytes], chunk.sizes, out=dests)
    else:
        foreach_copy(dests, _views(staging, chunk))


_last_block: dict[torch.device, int] = {}  # bytes of the last own-buffers staging block, cached on ``gather``


def _own_buffers_fit(nbytes: int, device: torch.device) -> bool:
    """Whether a staging block of ``nbytes`` (one buffer per chunk) takes at most a quarter of
    what the ``gather`` stream can get without the allocator flushing its cache: the driver's free
    bytes, and the block the last such offload left cached on that stream."""
    free = torch.cuda.mem_get_info(device)[0] + _last_block.get(device, 0)
    return nbytes <= free // 4


def pack_to_host(chunks: list[PackChunk], sources: list[torch.Tensor], pool_chunks: list[torch.Tensor],
                 device: torch.device, streams=None, after: torch.cuda.Event | None = None,
                 own_buffers: bool = True) -> torch.cuda.Event | None:
    """Gathers each chunk's storages (1D uint8 views, on ``device``) into its pool view (1D uint8, host).

    On CUDA, call with the D2H stream current; ``streams`` is the device's
    ``TransferStreams`` and ``after`` an event on the caller's stream (the
    gathers read after it). With ``own_buffers``, every chunk gets a staging
    buffer of its own where a quarter of the free device memory holds them;
    else, or beyond that, two buffers alternate. See [Note: packing pipeline].
    On the CPU, a plain gather per chunk.

    Returns:
        On CUDA with a buffer per chunk, an event on the ``gather`` stream
        after the last gather, which waited for no copy: the sources are not
        read after it ([Note: small storages released without an event each]).
        ``None`` otherwise (buffers reused, the CPU, no chunks).

    Raises:
        torch.OutOfMemoryError: the staging buffers could not be allocated (the
            large storages' copies may be queued; nothing was re-pointed or freed).
    """
    if not chunks:
        return None
    if device.type != "cuda":
        for ch, pool_chunk in zip(chunks, pool_chunks, strict=False):
            staging = torch.empty(ch.nbytes, dtype=torch.uint8)
            _gather(staging, ch, [sources[si] for si in ch.storages])
            pool_chunk.copy_(staging)
        return None
    d2h = streams.d2h
    total = sum(ch.nbytes for ch in chunks)
    own = own_buffers and (len(chunks) <= 2 or _own_buffers_fit(total, device))
    if own:
        # Own buffers, packed back to back: no gather waits for a DMA, and the stream holds
        # nothing that does, so the caller's stream may wait for it.
        kernels = streams.gather
        offsets = [0]
        for ch in chunks[:-1]:
            offsets.append(offsets[-1] + ch.nbytes)
        with torch.cuda.stream(kernels):
            block = torch.empty(total, dtype=torch.uint8, device=device)
        if len(chunks) > 2:
            _last_block[device] = total
        bufs = [block[o:o + ch.nbytes] for o, ch in zip(offsets, chunks, strict=False)]
    else:
        kernels = streams.pack
        size = max(ch.nbytes for ch in chunks)
        with torch.cuda.stream(kernels):
            block = torch.empty(2 * size, dtype=torch.uint8, device=device)
        bufs = [block[:size], block[size:]]
    # After the caller's stream, not after the large storages' DMAs queued on d2h before.
    if after is not None:
        kernels.wait_event(after)
    else:
        kernels.wait_stream(d2h)
    nbuf = len(bufs)
    sent: list[torch.cuda.Event | None] = [None] * nbuf  # the DMA out of each buffer
    for k, (ch, pool_chunk) in enumerate(zip(chunks, pool_chunks, strict=False)):
        b = k % nbuf
        with torch.cuda.stream(kernels):
            if sent[b] is not None:
                kernels.wait_event(sent[b])  # the buffer's previous chunk has left
            _gather(bufs[b], ch, [sources[si] for si in ch.storages])
            packed = streams.event(kernels)
        d2h.wait_event(packed)
        with torch.cuda.stream(d2h):
            streams.switch("d2h").copy(pool_chunk, bufs[b][: ch.nbytes])  # see [Note: switch points]
        sent[b] = streams.event(d2h)
    gathered = streams.event(kernels) if own else None  # no gather waited for a DMA
    d2h.wait_stream(kernels)  # the offload's final D2H event covers every gather
    block.record_stream(d2h)  # freed on its stream once its last DMA is done
    return gathered


def unpack_from_host(chunks: list[PackChunk], pool_chunks: list[torch.Tensor],
                     allocate: Callable[[PackChunk], list[torch.Tensor]], device: torch.device,
                     streams=None, *, switched: bool = True) -> None:
    """Scatters each pool view (1D uint8, host) into its chunk's storages, allocated chunk by chunk.

    ``switched``: the chunks' DMAs go through the H2D switch points ([Note: switch points]).

    ``allocate(chunk)`` re-allocates the chunk's storages and returns their 1D
    uint8 device views, in ``chunk.storages`` order; it runs on the host while
    the chunk's H2D copy is in flight, on the caller's current stream (the
    stream that will use the storages, see [Note: reload allocates on the
    caller's stream]). On CUDA the H2D stream must already have waited for the
    caller's stream. See [Note: packing pipeline].
    """
    if not chunks:
        return
    if device.type != "cuda":
        for ch, pool_chunk in zip(chunks, pool_chunks, strict=False):
            dests = allocate(ch)
            _scatter(pool_chunk, ch, dests)
        return
    h2d, pack = streams.h2d, streams.pack
    pack.wait_stream(h2d)
    size = max(ch.nbytes for ch in chunks)  # bytes of each of the two staging buffers
    bufs: list[torch.Tensor] = []
    unpacked: list[torch.cuda.Event | None] = [None, None]  # the scatter out of each buffer
    for k, (ch, pool_chunk) in enumerate(zip(chunks, pool_chunks, strict=False)):
        b = k % 2
        with torch.cuda.stream(h2d):
            if len(bufs) <= b:
                bufs.append(torch.empty(size, dtype=torch.uint8, device=device))
            if unpacked[b] is not None:
                h2d.wait_event(unpacked[b])
            if switched:
                streams.switch("h2d").copy(bufs[b][: ch.nbytes], pool_chunk)  # see [Note: switch points]
            else:
                bufs[b][: ch.nbytes].copy_(pool_chunk, non_blocking=True)
            landed = streams.event(h2d)
        dests = allocate(ch)  # host work while the DMA runs
        pack.wait_event(landed)
        with torch.cuda.stream(pack):
            _scatter(bufs[b], ch, dests)
            unpacked[b] = streams.event(pack)
    h2d.wait_stream(pack)  # the reload's final H2D event covers every scatter
    for buf in bufs:
        buf.record_stream(pack)
