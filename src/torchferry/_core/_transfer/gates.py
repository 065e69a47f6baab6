"""What a schedule hands :func:`~torchferry._core._transfer.h2d.issue_h2d` for the reload it drives, as
data, not as a callback into its layer:

* :class:`AllocGate`: a swap's outgoing storages, freed as their D2H copies land, before the incoming
  allocations need their room ([Note: swap budget] in ``_schedules/release``, which builds it);
* :class:`TailMark`: where the reload marks the tail of its copies, and the table it uploads there for
  the hash that runs beside them ([Note: the reload's hash beside its copies] in ``_schedules/unchanged``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

__all__ = ["AllocGate", "Pending", "TailMark", "free_pending", "upload_rows"]

logger = logging.getLogger("torchferry")


class Pending(NamedTuple):
    """An outgoing storage a gate holds until its copy has landed."""

    copied_after: int  # bytes the outgoing copies have written once this storage's copy is done
    storage: torch.UntypedStorage
    source: torch.Tensor  # 1D uint8 device view of it, read by the D2H stream


@dataclasses.dataclass(slots=True)
class AllocGate:
    """Device memory the incoming reload of a swap waits for, before each allocation.

    Before an allocation that brings the bytes the reload allocated to ``allocated``, the gate needs
    ``allocated - room`` outgoing bytes gone: it waits (on the host) for the first progress event that
    covers that many (all of them if more), then frees the pending storages whose copies are complete.
    """

    room: int | None
    """Bytes the incoming reload may allocate before anything must go (``budget - base + freed``, bytes);
    ``None``: no budget, nothing waits."""
    out_bytes: int
    """Bytes the outgoing copies write in all."""
    progress: list[tuple[int, torch.cuda.Event]]
    """``(bytes copied, event on the D2H stream)``, in order; the last covers ``out_bytes``."""
    pending: list[Pending]
    """The outgoing storages not freed yet; :func:`free_pending` takes them out."""

    def before_alloc(self, allocated: int) -> None:
        """Makes room for the reload's bytes allocated so far, ``allocated`` (the next storage included)."""
        if self.room is None or not self.progress:
            return
        must_have_left = allocated - self.room
        if must_have_left <= 0:
            return
        for copied, event in self.progress:
            if copied >= min(must_have_left, self.out_bytes):
                event.synchronize()
                free_pending(self, [e for e in self.pending if e.copied_after <= copied],
                             [e for e in self.pending if e.copied_after > copied], record=None)
                return


def free_pending(gate: AllocGate, free: list[Pending], keep: list[Pending], *,
                 record: torch.cuda.Stream | None) -> None:
    """Frees ``free`` (``record_stream`` on ``record`` first, if given: their copies may be in flight) and
    keeps ``keep`` pending; if freeing one raises, it and those after it stay pending too (the outgoing
    tensors view the pool: a storage freed is simply gone)."""
    for k, (_, storage, src) in enumerate(free):
        try:
            if record is not None:
                src.record_stream(record)
            storage.resize_(0)
        except BaseException:
            gate.pending = keep + free[k:]
            raise
    gate.pending = keep


class TailMark(NamedTuple):
    """Where :func:`issue_h2d` records :attr:`H2DIssued.early`, and what it uploads there."""

    tail_bytes: int
    """Record the event once at most this many bytes (large and packed storages) are left to copy."""
    rows: Mapping[int, Sequence[int]] | None
    """Per storage index, the int64 values uploaded after its device address when its copy is before
    the mark (:func:`upload_rows`); ``None``: nothing to upload."""


def upload_rows(storages: Sequence[int], rows: Mapping[int, Sequence[int]], address: Callable[[int], int],
                device: torch.device) -> tuple[list[int], torch.Tensor | None] | None:
    """Uploads, on the current stream now (pinned, non-blocking), the table of those ``storages`` that
    have ``rows``: ``[1 + len(row), n]`` int64, each column a storage's device address then its row.

    Returns:
        ``(those storages, the table)``; ``None`` if there are none, or on any error (logged: the
        hash then uploads its own).
    """
    todo = [si for si in storages if si in rows]
    if not todo:
        return None
    try:
        columns = [[address(si), *rows[si]] for si in todo]
        return todo, torch.tensor(list(map(list, zip(*columns, strict=True))),
                                  dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    except Exception:
        logger.debug("torchferry: could not stage the hash's table", exc_info=True)
        return None
