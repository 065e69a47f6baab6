"""The fused hash kernel's work table (its upload: ``_transfer/batches.int64_on``); apart from ``hash`` so
that ``hash_triton`` (imported lazily by ``hash``) and ``hash`` do not import each other."""

from __future__ import annotations

import torch

from .._transfer.batches import int64_on

__all__ = ["row_table", "rows_per"]


def rows_per(nbytes: list[int], piece_words: int) -> list[int]:
    """Rows of the work table per byte range (at least one)."""
    return [max(1, -(-(n // 8) // piece_words)) for n in nbytes]


def row_table(ptrs: list[int], nbytes: list[int], piece_words: int, device: torch.device,
              meta: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The fused hash kernel's work table, built on ``device`` (``_schedules/hash_triton``).

    Each byte range is cut into pieces of at most ``piece_words`` 8-byte words, one row each:
    ``(address, words, first word's position, tail bytes)``, the tail (< 8 bytes) on a range's
    last row only; an empty range gets one row of 0 words.

    Returns:
        ``(both, rows)``: ``both`` is 1D int64 on ``device``, the ``[rows, 4]`` table flattened,
        then ``rows`` range indices (which range each row belongs to).

    ``meta``: ``[ptrs, nbytes, rows_per(nbytes)]`` already on ``device`` (its first three rows;
    uploaded earlier, in another stream's order); otherwise uploaded now on the current stream.

    Only ``3 * len(ptrs)`` int64 go up (pinned, non-blocking), the rest is computed there: built
    with CPU ops, a 15.9 GB state's 15k-row table cost some 10 ms of host time per offload
    (``git show 75cc57c:benchmarks/results/profile_lora_offload_h200_2026-12-01.txt``).
    """
    per_range = rows_per(nbytes, piece_words)
    rows = sum(per_range)
    if meta is None:
        meta = int64_on([ptrs, nbytes, per_range], device)
    p, n, per = meta[0], meta[1], meta[2]
    seg = torch.repeat_interleave(torch.arange(len(ptrs), device=device), per, output_size=rows)
    k = torch.arange(rows, device=device) - (torch.cumsum(per, 0) - per)[seg]  # piece index in its range
    first = k * piece_words
    table = torch.stack([
        p[seg] + first * 8,
        torch.clamp((n // 8)[seg] - first, max=piece_words),
        first,
        torch.where(k == per[seg] - 1, (n % 8)[seg], 0),
    ], 1)
    return torch.cat([table.view(-1), seg]), rows
