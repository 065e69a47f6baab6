"""Small storages moved in batches: packed on the device, one DMA per chunk.

One copy per storage costs a launch and a DMA setup each: 4096 copies of
256 KiB ran at 23.9 GB/s, 43% of the link, on an H200
(``shared/anchors/bw.json``). Storages under :data:`PACK_BELOW` bytes are
therefore laid out back to back in the pool, in chunks of at most
:data:`PACK_CHUNK` bytes. Offload gathers a chunk's storages into a device
staging buffer with one batched kernel (``torch._foreach_copy_`` over byte
views) and copies the buffer to the pool in one DMA; reload does the reverse.
The staging buffer is allocated on the copy stream itself and freed there, so
its reuse by the next chunk is ordered after the previous DMA; at most one
chunk of device memory is used at a time. On the CPU the same path runs (an
extra memcpy), so CPU tests cover the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["PACK_BELOW", "PACK_CHUNK", "PackChunk", "layout"]

PACK_BELOW = 1 << 20  # bytes: storages smaller than this are packed (the allocator's small-pool bound)
PACK_CHUNK = 64 << 20  # bytes of device staging per batched copy
_LARGE_ALIGN = 512  # CUDA caching allocator kMinBlockSize
_SMALL_ALIGN = 16  # every dtype's element size divides it


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclasses.dataclass
class PackChunk:
    """Consecutive small storages that move as one DMA.

    Attributes:
        storages: storage indices, in pool order.
        offsets: each storage's byte offset from the chunk start (16-B aligned).
        pool_offset: the chunk's byte offset in the pool.
        nbytes: the chunk's length in bytes, padding included.
    """

    storages: list[int] = dataclasses.field(default_factory=list)
    offsets: list[int] = dataclasses.field(default_factory=list)
    pool_offset: int = 0
    nbytes: int = 0


def layout(sizes: Sequence[int], *, pack_below: int = PACK_BELOW,
           chunk: int = PACK_CHUNK) -> tuple[list[int], int, list[PackChunk]]:
    """Pool layout: large storages first (512-B slots), then the small ones packed in chunks.

    Args:
        sizes: bytes per storage (zero allowed: such storages get offset 0 and move nothing).
        pack_below: storages of 1 to ``pack_below - 1`` bytes are packed.
        chunk: most bytes per packed chunk.

    Returns:
        ``(offsets, total, chunks)``: each storage's byte offset in the pool, the
        pool size in bytes, and the chunks of packed storages. Padding is under
        512 B per large storage and under 16 B per small one.
    """
    offsets = [0] * len(sizes)
    total = 0
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"storage size must be >= 0, got {n}")
        if n >= pack_below:
            total = _align_up(total, _LARGE_ALIGN)
            offsets[i] = total
            total += n
    chunks: list[PackChunk] = []
    for i, n in enumerate(sizes):
        if not 0 < n < pack_below:
            continue
        total = _align_up(total, _SMALL_ALIGN)
        if not chunks or total + n - chunks[-1].pool_offset > chunk:
            chunks.append(PackChunk(pool_offset=total))
        ch = chunks[-1]
        offsets[i] = total
        ch.storages.append(i)
        ch.offsets.append(total - ch.pool_offset)
        total += n
        ch.nbytes = total - ch.pool_offset
    return offsets, total, chunks


def pack_to_host(chunk: PackChunk, sources: list[torch.Tensor], pool_chunk: torch.Tensor,
                 device: torch.device) -> None:
    """Gathers ``chunk``'s storages (1D uint8 views, on ``device``) into ``pool_chunk`` (1D uint8, host).

    On CUDA, call with the D2H stream current: staging is allocated, filled,
    copied and freed on it.
    """
    staging = torch.empty(chunk.nbytes, dtype=torch.uint8, device=device)  # 1D uint8, device
    views = [staging[o : o + sources[si].numel()] for si, o in zip(chunk.storages, chunk.offsets)]
    torch._foreach_copy_(views, [sources[si] for si in chunk.storages])
    pool_chunk.copy_(staging, non_blocking=device.type == "cuda")


def unpack_from_host(chunk: PackChunk, pool_chunk: torch.Tensor, dests: list[torch.Tensor],
                     device: torch.device) -> None:
    """Scatters ``pool_chunk`` into ``chunk``'s storages (1D uint8 views on ``device``).

    On CUDA, call with the H2D stream current.
    """
    staging = torch.empty(chunk.nbytes, dtype=torch.uint8, device=device)
    staging.copy_(pool_chunk, non_blocking=device.type == "cuda")
    views = [staging[o : o + dests[si].numel()] for si, o in zip(chunk.storages, chunk.offsets)]
    torch._foreach_copy_([dests[si] for si in chunk.storages], views)
