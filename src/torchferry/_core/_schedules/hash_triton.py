"""The content hash of [Note: unchanged storages] as one fused Triton kernel over many storages.

Imported lazily (``_schedules/hash``) and only for CUDA devices: ``import torchferry`` needs no Triton.

The math is that of the torch-op hash in ``_schedules/hash`` (the same two lanes, the same positions: word
``p`` of a storage mixed with ``(p + 1) * G``, the tail bytes after the words as single values),
so for one storage both give the same 128 bits; the kernel reads each byte once instead of some
50 times. Launch shape: the storages are cut into pieces of at most ``PIECE_WORDS`` 8-byte words
(a table row each: address, words, first word's position, tail bytes); one program per row loops
over its piece ``BLOCK`` words at a time and writes the row's two 64-bit sums; one ``index_add_``
folds the rows into per-storage sums (wrapping int64 additions, so the order does not matter).
One launch hashes every storage of an offload, whatever their number.
"""

from __future__ import annotations

import torch
import triton  # pyright: ignore[reportMissingImports]  # optional: CUDA builds of torch ship triton; CPU ones do not
import triton.language as tl  # pyright: ignore[reportMissingImports]  # as above

from .._transfer.batches import int64_on
from .hash_rows import row_table, rows_per

__all__ = ["ALIGN", "PIECE_WORDS", "hash_segments", "stage_row"]

PIECE_WORDS = 1 << 17  # 8-byte words per program (1 MiB): a 15 GB state is ~15k rows
BLOCK = 2048  # words per loop step of one program
ALIGN = 16  # every storage's address must be a multiple of this (the caching allocator gives 512)

# Per lane: position multiplier, first multiplier, first shift, second multiplier, second shift
# (``hash.LANES``: SplitMix64's and Murmur3's finalisers, less their first xor-shift).
_CONSTS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31,
           0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)
_consts_on: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _lane(w, pos, g, m1, s1: tl.constexpr, m2, s2: tl.constexpr):
    z = w + pos * g
    z = z * m1
    z = z ^ (z >> s1)
    z = z * m2
    return z ^ (z >> s2)


@triton.jit
def _hash_rows(table, consts, partials, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    addr = tl.multiple_of(tl.load(table + row * 4), 16)
    nw = tl.load(table + row * 4 + 1)
    first = tl.load(table + row * 4 + 2)
    ntail = tl.load(table + row * 4 + 3)
    g0 = tl.load(consts + 0).to(tl.uint64, bitcast=True)
    a0 = tl.load(consts + 1).to(tl.uint64, bitcast=True)
    b0 = tl.load(consts + 3).to(tl.uint64, bitcast=True)
    g1 = tl.load(consts + 5).to(tl.uint64, bitcast=True)
    a1 = tl.load(consts + 6).to(tl.uint64, bitcast=True)
    b1 = tl.load(consts + 8).to(tl.uint64, bitcast=True)
    words = addr.to(tl.pointer_type(tl.uint64))
    offs = tl.arange(0, BLOCK)
    acc0 = tl.zeros([BLOCK], dtype=tl.uint64)
    acc1 = tl.zeros([BLOCK], dtype=tl.uint64)
    for i in range(0, nw, BLOCK):
        idx = tl.max_contiguous(tl.multiple_of(i + offs, BLOCK), BLOCK)
        m = idx < nw
        w = tl.load(words + idx, mask=m, other=0)
        pos = (first + idx + 1).to(tl.uint64)
        zero = tl.zeros_like(w)
        acc0 += tl.where(m, _lane(w, pos, g0, a0, 27, b0, 31), zero)
        acc1 += tl.where(m, _lane(w, pos, g1, a1, 33, b1, 33), zero)
    # The tail bytes (< 8, only in a storage's last row), each one value at the positions after the words.
    t8 = tl.arange(0, 8)
    tm = t8 < ntail
    tb = tl.load(addr.to(tl.pointer_type(tl.uint8)) + nw * 8 + t8, mask=tm, other=0).to(tl.uint64)
    tpos = (first + nw + t8 + 1).to(tl.uint64)
    tzero = tl.zeros_like(tb)
    s0 = tl.sum(acc0, axis=0) + tl.sum(tl.where(tm, _lane(tb, tpos, g0, a0, 27, b0, 31), tzero), axis=0)
    s1 = tl.sum(acc1, axis=0) + tl.sum(tl.where(tm, _lane(tb, tpos, g1, a1, 33, b1, 33), tzero), axis=0)
    tl.store(partials + row * 2, s0.to(tl.int64, bitcast=True))
    tl.store(partials + row * 2 + 1, s1.to(tl.int64, bitcast=True))


def _consts(device: torch.device) -> torch.Tensor:
    c = _consts_on.get(device)
    if c is None:
        vals = [v - (1 << 64) if v >= 1 << 63 else v for v in _CONSTS]
        c = _consts_on[device] = int64_on(vals, device)
    return c


def stage_row(nbytes: int, extra: int) -> tuple[int, int, int]:
    """A range's column of :func:`hash_segments`' staged inputs after its address: its bytes, its rows of
    the work table, and one more value (``extra``). The reload uploads the ``[4, ranges]`` int64 table
    (addresses first) on its H2D stream, in that stream's order, for a hash queued later on another
    stream (``_transfer/gates.upload_rows``)."""
    return nbytes, rows_per([nbytes], PIECE_WORDS)[0], extra


def hash_segments(ptrs: list[int], nbytes: list[int], device: torch.device,
                  staged: torch.Tensor | None = None) -> torch.Tensor:
    """The 128-bit hashes of ``len(ptrs)`` device byte ranges, ``[len(ptrs), 2]`` int64, in one launch.

    Args:
        ptrs: start addresses on ``device``, each a multiple of :data:`ALIGN` (raises
            ``ValueError`` otherwise, before any launch).
        nbytes: bytes of each range (0 allowed: its hash is ``[0, 0]``).
        device: the CUDA device holding them.
        staged: the ranges' table staged with :func:`stage_row` (``[4, len(ptrs)]`` int64 on ``device``),
            or ``None`` (uploaded now).

    Enqueued on the current stream; no host sync (the row table is built there, :func:`row_table`).
    """
    if any(p % ALIGN for p, n in zip(ptrs, nbytes, strict=False) if n):
        raise ValueError(f"torchferry: a storage address is not {ALIGN}-byte aligned")
    both, rows = row_table(ptrs, nbytes, PIECE_WORDS, device, meta=staged)
    partials = torch.empty(rows, 2, dtype=torch.int64, device=device)
    _hash_rows[(rows,)](both, _consts(device), partials, BLOCK=BLOCK, num_warps=8)  # pyright: ignore[reportIndexIssue]  # a triton.jit kernel launches as kernel[grid](...)
    out = torch.zeros(len(ptrs), 2, dtype=torch.int64, device=device)
    return out.index_add_(0, both[rows * 4:], partials)
