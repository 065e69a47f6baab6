"""The content hash of [Note: unchanged storages] (``_schedules/unchanged``): 128 bits per storage.

Two implementations of the same math (see the Note): ``"torch"``, plain torch ops, some 50 bytes
of device memory traffic per hashed byte, on any device (the CPU and the fallback); ``"triton"``,
one fused kernel over every storage of a call (``_schedules/hash_triton``, imported lazily), each byte read
once, on CUDA devices where Triton imports. ``TORCHFERRY_HASH=torch`` forces the torch ops. A
baseline records the kind that took it and is compared only with the same kind
(:func:`hash_storages`), so the two never meet even where their values would differ (packed
storages: the torch ops hash them at their positions in the packed chunk, the kernel from 0).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._transfer.batches import int64_on
from .._host.slots import PackChunk
from .._state.fsdp import foreach_copy

__all__ = ["HASH_PIECE", "LANES", "hash_bytes", "hash_kind", "hash_packed", "hash_storages",
           "stage_rows"]

logger = logging.getLogger("torchferry")

HASH_PIECE = 32 << 20  # bytes of a storage hashed per batch of ops (bounds the temporaries)

# Per lane: the position multiplier, then rounds of (xor-shift right by, then multiply by).
LANES = (
    (0x9E3779B97F4A7C15, ((None, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None))),  # SplitMix64
    (0xC2B2AE3D27D4EB4F, ((None, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53), (33, None))),  # Murmur3
)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


class _Consts(NamedTuple):
    g: torch.Tensor  # [2, 1] position multipliers
    rounds: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]  # [2, 1] shift, mask, mult


_consts_cache: dict[torch.device, _Consts] = {}


def _consts(device: torch.device) -> _Consts:
    k = _consts_cache.get(device)
    if k is None:
        def col(values: Sequence[int]) -> torch.Tensor:
            return int64_on([[_i64(v)] for v in values], device)

        rounds = []
        for r in range(len(LANES[0][1])):
            shifts = [lane[1][r][0] for lane in LANES]
            mults = [lane[1][r][1] for lane in LANES]
            rounds.append((None if shifts[0] is None else col(shifts),  # pyright: ignore[reportArgumentType]  # a round's shifts are all ints or all None (checked on shifts[0])
                           None if shifts[0] is None else col([(1 << (64 - s)) - 1 for s in shifts]),  # pyright: ignore[reportOperatorIssue]  # a round's shifts are all ints or all None (checked on shifts[0])
                           None if mults[0] is None else col(mults)))  # pyright: ignore[reportArgumentType]  # a round's shifts are all ints or all None (checked on shifts[0])
        k = _consts_cache[device] = _Consts(col([lane[0] for lane in LANES]), rounds)
    return k


def _mix(values: torch.Tensor, first: int) -> torch.Tensor:
    """Both lanes' mixed value of each int64 in ``values`` (1D), at positions ``first, first + 1, ...``."""
    k = _consts(values.device)
    n = values.numel()
    z = torch.arange(first + 1, first + 1 + n, dtype=torch.int64, device=values.device).unsqueeze(0) * k.g
    z += values
    for shift, mask, mult in k.rounds:
        if shift is not None:
            t = torch.bitwise_right_shift(z, shift)
            t &= mask  # a logical shift: int64's is arithmetic  # pyright: ignore[reportOperatorIssue]  # a round's shifts are all ints or all None (checked on shifts[0])
            z ^= t
        if mult is not None:
            z *= mult
    return z


def hash_bytes(data: torch.Tensor) -> torch.Tensor:
    """The 128-bit hash of a 1D uint8 tensor's bytes, as a ``[2]`` int64 tensor on its device.

    Not cryptographic; see [Note: unchanged storages]. Enqueued on the current stream, no sync.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"hash_bytes takes a 1D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    n = data.numel()
    out = torch.zeros(2, dtype=torch.int64, device=data.device)
    nw = n // 8
    if nw:
        if data.storage_offset() % 8 or not data.is_contiguous():
            data = data.clone()
        words = data[: nw * 8].view(torch.int64)
        step = HASH_PIECE // 8
        for a in range(0, nw, step):
            out += _mix(words[a:a + step], a).sum(1)
    if n % 8:
        out += _mix(data[nw * 8:].to(torch.int64), nw).sum(1)
    return out


def hash_packed(chunk: PackChunk, members: list[int], sources: list[torch.Tensor]) -> torch.Tensor:
    """Hashes of packed storages, ``[len(members), 2]`` int64, at their positions in ``chunk``.

    Args:
        chunk: the packed chunk.
        members: sorted positions in ``chunk.storages`` to hash.
        sources: their 1D uint8 device views, in the same order.

    Words are numbered from the chunk's start (offsets are 16-aligned), each
    storage's last word padded with zeros, so a storage's hash depends only
    on its bytes and its place in the layout, not on its neighbours.
    """
    device = sources[0].device
    sizes, offsets = chunk.sizes, chunk.offsets
    out: list[torch.Tensor] = []
    i = 0
    while i < len(members):
        start = offsets[members[i]]
        j = i + 1
        while j < len(members) and offsets[members[j]] + sizes[members[j]] - start <= HASH_PIECE:
            j += 1
        batch = members[i:j]
        end = offsets[batch[-1]] + sizes[batch[-1]]
        # One zero word first: a storage's sum is then a difference of two inclusive prefix sums.
        staging = torch.zeros(8 + (end - start + 7) // 8 * 8, dtype=torch.uint8, device=device)
        split, cursor = [], start - 8
        for m in batch:
            split += [offsets[m] - cursor, sizes[m]]
            cursor = offsets[m] + sizes[m]
        split.append(staging.numel() - sum(split))
        foreach_copy(list(staging.split_with_sizes(split)[1::2]), sources[i:j])
        cums = _mix(staging.view(torch.int64), start // 8 - 1).cumsum(1)
        lo = [(offsets[m] - start) // 8 for m in batch]
        hi = [(offsets[m] + sizes[m] - start + 7) // 8 for m in batch]
        out.append((cums.index_select(1, int64_on(hi, device)) - cums.index_select(1, int64_on(lo, device))).T)
        i = j
    return torch.cat(out)


@functools.cache
def _triton_usable() -> bool:
    try:
        from . import hash_triton  # noqa: F401
    except Exception:  # not installed, or no usable backend: the torch ops
        logger.info("torchferry: no Triton; unchanged storages are hashed with torch ops", exc_info=True)
        return False
    return True


def hash_kind(device: torch.device, choice: str = "auto") -> str:
    """``"triton"`` on a CUDA device where Triton imports, else ``"torch"``. ``choice``: ``CoreSettings.hash``
    (from ``TORCHFERRY_HASH``): ``"auto"`` or ``"triton"`` (the kernel where it imports), ``"torch"`` (the
    torch ops everywhere)."""
    if device.type == "cuda" and choice != "torch" and _triton_usable():
        return "triton"
    return "torch"


def stage_rows(kind: str, todo: Sequence[int], nbytes: Sequence[int]) -> dict[int, tuple[int, ...]] | None:
    """Per storage of ``todo``, what a reload uploads after its device address for a later
    :func:`hash_storages` on another stream (``_transfer/gates.TailMark.rows``: the storages must be
    allocated, their bytes may still be on the way); ``None`` for ``"torch"`` (nothing to stage)."""
    if kind != "triton":
        return None
    from .hash_triton import stage_row

    return {si: stage_row(nbytes[si], si) for si in todo}


def hash_storages(kind: str, out: torch.Tensor, todo: Sequence[int], sources: Sequence[torch.Tensor],
                  chunks: Sequence[PackChunk], packed_at: dict[int, tuple[int, int]],
                  staged: torch.Tensor | None = None) -> None:
    """Writes ``out[si]`` (``[2]`` int64) for every ``si`` in ``todo``: the hash of ``sources[si]``.

    Args:
        kind: ``"torch"`` or ``"triton"`` (:func:`hash_kind`); compare only hashes of one kind.
        out: ``[storages, 2]`` int64 on the sources' device.
        todo: storage indices.
        sources: 1D uint8 views of whole device storages (the plan's device views).
        chunks, packed_at: the pool's packed chunks and, per packed storage, ``(chunk, position)``
            (the torch ops hash packed storages a chunk at a time).
        staged: the table a reload uploaded with :func:`stage_rows`' rows for this ``todo``, or ``None``.

    Enqueued on the current stream, no host sync.

    Raises:
        ValueError: (``"triton"``) a storage's address is not 16-byte aligned.
        torch.OutOfMemoryError: no device memory for the temporaries.
    """
    if not todo:
        return
    if kind == "triton":
        from .hash_triton import hash_segments

        h = hash_segments([sources[si].data_ptr() for si in todo], [sources[si].numel() for si in todo], out.device,
                          staged)
        out.index_copy_(0, staged[3] if staged is not None else int64_on(list(todo), out.device), h)
        return
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for si in todo:
        at = packed_at.get(si)
        if at is None:
            out[si] = hash_bytes(sources[si])
        else:
            by_chunk.setdefault(at[0], []).append((at[1], si))
    for k, items in by_chunk.items():
        items.sort()
        h = hash_packed(chunks[k], [j for j, _ in items], [sources[si] for _, si in items])
        out.index_copy_(0, int64_on([si for _, si in items], out.device), h)
