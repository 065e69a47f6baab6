"""Unchanged storages: an offload skips the D2H copy of a storage whose host copy is still exact.

[Note: unchanged storages]
After a reload the host pool still holds every storage's bytes. With
``Ferry(skip_unchanged=True)`` the next offload copies only the storages
written on the device since and releases the others without a copy (a frozen
base model, a reference model that is never trained). A write missed here
would be lost at the next reload, so a storage is skipped only when two
checks, in this order, both pass:

1. Pre-filter, on the host. Since the reload that made the storage resident
   (a plain reload, or its group's turn in a layer-wise one): every known
   tensor viewing it still has the version counter recorded then (for a
   DTensor: the DTensor's and its local shard's, ``_fsdp.versions``); it is
   viewed by no ``.grad`` and no optimizer state (written every step: not
   worth hashing); the plan is the same cached plan, over the same host views
   of the same pool block, still intact (``HostViews.intact``), with no
   reconcile or re-plan since. This catches in-place ops (``add_``,
   ``copy_`` under ``no_grad``, ``load_state_dict``, BatchNorm's running
   statistics in forward, optimizer steps on plain tensors), writes through
   views (they share the counter) and ``p.data = t`` (a new storage: the
   plan's fingerprint changes). A storage failing it is copied, unhashed.
2. Content hash, on the device. Version counters miss writes through
   ``p.data`` (a new counter over the same storage), the ``_foreach_`` ops
   on DTensors (FSDP2's optimizer steps) and writes to inference tensors. So
   each eligible storage's bytes are hashed right after the reload's copies
   land (on the current stream, after its wait for the reload's event and
   before any later kernel: no host sync at reload), and the survivors of
   the pre-filter again at the offload, after the current stream's pending
   work; one ``.tolist()`` brings the comparison back (the offload's only
   host sync). Equal: skipped.

A baseline serves one offload: taken at a reload, consumed by the next
offload whatever it decides (a failed offload copies everything next time).
A storage copied early (``offload_during_forward``) was rewritten in the
pool after the baseline, so this rule does not skip it (the early rules do).

The hash (:func:`hash_bytes`) is plain torch ops over the storage's bytes:
the 8-byte-aligned prefix viewed as int64 words, the tail (< 8 bytes) as
uint8 values. Two lanes each map word ``w`` at position ``p`` to
``mix(w + (p + 1) * G)``, where ``mix`` multiplies by an odd constant,
xor-shifts right, multiplies, xor-shifts right (the finalisers of SplitMix64
and of Murmur3, one per lane, less their first xor-shift), and sum the
results with wrapping int64 additions: 128 bits per storage. Small (packed)
storages are hashed a packed chunk at a time, at their positions in the
chunk (one gather, a cumulative sum and a difference per storage), and
copied in runs of consecutive changed storages (``_copies.copy_runs``). The
right shifts fold high bits into low ones (a flip of the sign bit of two
float64s must not cancel in the sums). Each step is a bijection of the word
for a fixed position, so a change confined to one word or tail byte always
changes both sums: it is caught with certainty. A change to several words
goes unseen only if the per-word differences sum to 0 modulo 2**64 in both
lanes; modelling the mixed words as independent uniform values, that is
2**-128 per storage and offload (10**12 comparisons: below 10**-26). It is
not cryptographic: a write crafted with knowledge of the constants can keep
both sums.

Cost: 12 elementwise kernels over both lanes per ``HASH_PIECE`` of a storage,
some 50 bytes of device memory traffic per hashed byte (about 12 ms per GB
at 4 TB/s; a fused kernel would read each byte once: to be measured on
GPUs), at each reload for every eligible storage and at each offload for
those that pass the pre-filter; at most ``4 * HASH_PIECE`` (128 MiB) of
temporary device memory, plus a packed batch's staging. Saved: the D2H
copies of the storages skipped (about 18 ms per GB at 55 GB/s, on the copy
engine, and the offload's wait for them); which wins is to be measured.

Not seen: a write to the *host pool* between the reload and the offload (a
host tensor kept from an earlier offload, or written through ``.data``
during a layer-wise reload): a skipped storage keeps those bytes where a full
offload would overwrite them. ``TORCHFERRY_VERIFY_SKIPS=1`` (tests) copies
every storage judged unchanged to a scratch buffer and compares it with its
slot, raising on a difference.

Swap: the outgoing ferry's skipped storages are released at once (no copy
reads them; ``ReleaseSchedule.hold``). The incoming ferry of a swap with
``gpu_budget_bytes`` takes no baseline (its hash temporaries would be
allocated beyond the budget, while the outgoing state is still held): its
next offload copies everything.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ._fsdp import versions
from ._host_views import HostViews
from ._packing import PackChunk
from ._plan import Plan

__all__ = ["HASH_PIECE", "VERIFY_ENV", "UnchangedStorages", "hash_bytes", "hash_packed"]

logger = logging.getLogger("torchferry")

HASH_PIECE = 32 << 20  # bytes of a storage hashed per batch of ops (bounds the temporaries)
VERIFY_ENV = "TORCHFERRY_VERIFY_SKIPS"

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


def _on(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, without a host sync (pinned, non-blocking)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _consts(device: torch.device) -> _Consts:
    k = _consts_cache.get(device)
    if k is None:
        def col(values: Sequence[int]) -> torch.Tensor:
            return _on([[_i64(v)] for v in values], device)

        rounds = []
        for r in range(len(LANES[0][1])):
            shifts = [lane[1][r][0] for lane in LANES]
            mults = [lane[1][r][1] for lane in LANES]
            rounds.append((None if shifts[0] is None else col(shifts),
                           None if shifts[0] is None else col([(1 << (64 - s)) - 1 for s in shifts]),
                           None if mults[0] is None else col(mults)))
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
            t &= mask  # a logical shift: int64's is arithmetic
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
        torch._foreach_copy_(list(staging.split_with_sizes(split)[1::2]), sources[i:j])
        cums = _mix(staging.view(torch.int64), start // 8 - 1).cumsum(1)
        lo = [(offsets[m] - start) // 8 for m in batch]
        hi = [(offsets[m] + sizes[m] - start + 7) // 8 for m in batch]
        out.append((cums.index_select(1, _on(hi, device)) - cums.index_select(1, _on(lo, device))).T)
        i = j
    return torch.cat(out)


class _Rules(NamedTuple):
    """Per plan and host views: which storages may be skipped, who views them, where packed ones sit."""

    plan: Plan
    views: HostViews
    members: list[list[int]]  # per storage: indices into plan.tensors
    eligible: list[bool]  # some bytes, no .grad, no optimizer state
    packed_at: dict[int, tuple[int, int]]  # storage -> (chunk index, position in the chunk)


def _rules(plan: Plan, views: HostViews) -> _Rules:
    members: list[list[int]] = [[] for _ in plan.storages]
    eligible = [n > 0 for n in plan.nbytes]
    for ti, r in enumerate(plan.tensors):
        members[r.storage_index].append(ti)
        if r.name.endswith(".grad") or (r.name.startswith("optimizer") and ".state[" in r.name):
            eligible[r.storage_index] = False
    packed_at = {si: (k, j) for k, ch in enumerate(views.chunks) for j, si in enumerate(ch.storages)}
    return _Rules(plan, views, members, eligible, packed_at)


class UnchangedStorages:
    """One ferry's baseline for [Note: unchanged storages]: the versions and device hashes taken
    at the last reload, used by the next offload."""

    def __init__(self) -> None:
        self._rules: _Rules | None = None
        self.forget()

    def forget(self) -> None:
        """Drops the baseline (a re-plan, a reconcile, the host views dropped)."""
        self._plan: Plan | None = None
        self._views: HostViews | None = None
        self._hashes: torch.Tensor | None = None  # [storages, 2] int64 on the device
        self._versions: dict[int, int] = {}  # tensor index -> version at the baseline
        self._hashed: set[int] = set()

    def drop_rules(self) -> None:
        """Also drops the per-plan tables (they hold the plan and the host views)."""
        self.forget()
        self._rules = None

    def _rules_for(self, plan: Plan, views: HostViews) -> _Rules:
        if self._rules is None or self._rules.plan is not plan or self._rules.views is not views:
            self._rules = _rules(plan, views)
        return self._rules

    @torch.inference_mode(False)  # the hooks of a layer-wise reload may run in inference mode
    def reloaded(self, plan: Plan, views: HostViews, sources: list[torch.Tensor],
                 storages: Iterable[int] | None = None, tensors: Iterable[int] | None = None) -> None:
        """Takes the baseline of storages just made resident (all of ``plan`` if ``storages`` is
        ``None``); their copies must be complete for the current stream, no kernel queued since.

        Never raises: on any error (the hash's temporaries out of device memory) the baseline is
        dropped and the next offload copies everything; the reload itself is complete.
        """
        try:
            if storages is None or plan is not self._plan or views is not self._views:
                self.forget()
                self._plan, self._views = plan, views
                self._hashes = torch.empty(len(plan.storages), 2, dtype=torch.int64, device=plan.device)
            rules = self._rules_for(plan, views)
            ts = list(range(len(plan.tensors)) if tensors is None else tensors)
            self._versions.update(zip(ts, versions([plan.tensors[i].tensor for i in ts])))
            todo = [si for si in (range(len(plan.storages)) if storages is None else storages)
                    if rules.eligible[si]]
            self._hash_into(self._hashes, todo, rules, sources)
            self._hashed.update(todo)
        except Exception:
            self.forget()
            logger.warning("torchferry: could not hash the reloaded state; the next offload copies all of it",
                           exc_info=True)

    @torch.inference_mode(False)
    def take(self, plan: Plan, views: HostViews, sources: list[torch.Tensor],
             rewritten: Iterable[int] = ()) -> set[int]:
        """Storage indices whose pool slots still hold their exact bytes (consumes the baseline).

        Args:
            plan, views, sources: what the offload moves, its host views, its device views.
            rewritten: storages whose slots were written since the baseline (early copies).

        Raises:
            RuntimeError: in verify mode, a storage judged unchanged differs from its slot.
        """
        hashed, base, recorded = self._hashed, self._hashes, self._versions
        valid = plan is self._plan and views is self._views and views.intact()
        self.forget()
        if not valid or not hashed:
            return set()
        rules = self._rules_for(plan, views)
        now = versions([r.tensor for r in plan.tensors])
        rewritten = set(rewritten)
        cand = [si for si in sorted(hashed) if si not in rewritten
                and all(recorded.get(ti) == now[ti] for ti in rules.members[si])]
        if not cand:
            return set()
        try:
            same = {si for si, s in zip(cand, self._compare(base, cand, rules, sources)) if s}
        except torch.OutOfMemoryError:  # memory is short at an offload: copy instead
            logger.info("torchferry: no device memory to hash the state; the offload copies all of it")
            return set()
        if os.environ.get(VERIFY_ENV, "0") not in ("", "0"):
            _verify(plan, views, sources, same, rules)
        return same

    def _compare(self, base: torch.Tensor, cand: list[int], rules: _Rules,
                 sources: list[torch.Tensor]) -> list[bool]:
        """Per candidate, whether its hash now equals the baseline's (one host sync)."""
        cur = torch.empty_like(base)
        self._hash_into(cur, cand, rules, sources)
        idx = _on(cand, base.device)
        return (cur.index_select(0, idx) == base.index_select(0, idx)).all(1).tolist()

    @staticmethod
    def _hash_into(out: torch.Tensor, todo: list[int], rules: _Rules, sources: list[torch.Tensor]) -> None:
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for si in todo:
            at = rules.packed_at.get(si)
            if at is None:
                out[si] = hash_bytes(sources[si])
            else:
                by_chunk.setdefault(at[0], []).append((at[1], si))
        for k, items in by_chunk.items():
            items.sort()
            h = hash_packed(rules.views.chunks[k], [j for j, _ in items], [sources[si] for _, si in items])
            out.index_copy_(0, _on([si for _, si in items], out.device), h)


def _verify(plan: Plan, views: HostViews, sources: list[torch.Tensor], same: set[int], rules: _Rules) -> None:
    """Compares every storage judged unchanged with its pool slot (``TORCHFERRY_VERIFY_SKIPS=1``)."""
    for si in sorted(same):
        scratch = torch.empty(plan.nbytes[si], dtype=torch.uint8)
        scratch.copy_(sources[si])
        if not torch.equal(scratch, views.slots[si]):
            names = ", ".join(plan.tensors[ti].name for ti in rules.members[si])
            raise RuntimeError(
                f"torchferry: {VERIFY_ENV}: the storage of {names} was judged unchanged since the "
                "reload but differs from its host copy; a write was missed (please report it)"
            )
