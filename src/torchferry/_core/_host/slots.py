"""The pool's slot layout: large storages in 512-B slots, small ones packed in chunks that move as
one DMA each ([Note: packing pipeline] in ``torchferry._core._transfer.packing`` moves them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
        split_sizes: the chunk cut into each storage's bytes and the padding
            after it, ``[n0, pad0, n1, pad1, ...]`` (sums to ``nbytes``), so that
            one ``split_with_sizes`` call makes every view (``[0::2]``).

    A chunk without padding (every storage a multiple of 16 bytes: the usual
    case) is :attr:`dense`: packed with one ``torch.cat(out=)`` and unpacked
    with one ``torch.split_with_sizes_copy(out=)``, without a Python view per
    storage (see [Note: packing pipeline]).
    """

    storages: list[int] = dataclasses.field(default_factory=list)
    offsets: list[int] = dataclasses.field(default_factory=list)
    pool_offset: int = 0
    nbytes: int = 0
    split_sizes: list[int] = dataclasses.field(default_factory=list)

    @property
    def dense(self) -> bool:
        """No padding between the storages: ``nbytes`` is the sum of their sizes."""
        return not any(self.split_sizes[1::2])

    @property
    def sizes(self) -> list[int]:
        """Each storage's bytes, in chunk order."""
        return self.split_sizes[0::2]


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
        if ch.split_sizes:
            ch.split_sizes[-1] = total - ch.pool_offset - ch.nbytes  # padding after the previous one
        ch.storages.append(i)
        ch.offsets.append(total - ch.pool_offset)
        ch.split_sizes += [n, 0]
        total += n
        ch.nbytes = total - ch.pool_offset
    return offsets, total, chunks
