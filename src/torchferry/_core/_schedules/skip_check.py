"""What decides a skip of [Note: unchanged storages] (``unchanged.py``): the per-plan rules, the records
a re-plan keeps ([Note: a baseline carried across a re-plan], [Note: host tensors of earlier plans]) and
the comparison of a storage's hash now with its baseline's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._host.layout import HostViews
from .._state.plan import Plan
from .._transfer.batches import copy_now
from .._transfer.batches import int64_on

__all__ = ["Carried", "Retired", "Rules", "hashed_alike", "rules_of"]

logger = logging.getLogger("torchferry")


class Rules(NamedTuple):
    """Per plan and host views: which storages may be skipped, who views them, where packed ones sit."""

    plan: Plan
    views: HostViews
    members: list[list[int]]  # per storage: indices into plan.tensors
    eligible: list[bool]  # some bytes, no .grad, no optimizer state
    packed_at: dict[int, tuple[int, int]]  # storage -> (chunk index, position in the chunk)


class Retired(NamedTuple):
    """A host twin of a plan the ferry dropped ([Note: host tensors of earlier plans])."""

    twin: torch.Tensor
    block: int  # the pool block its slot is in
    lo: int  # the slot's first byte's address
    hi: int  # one past its last
    seen: object  # its version counter when last read


class Carried(NamedTuple):
    """A baseline kept across a re-plan ([Note: a baseline carried across a re-plan])."""

    kind: str  # the hash that took it
    hashes: torch.Tensor  # [old storages, 2] int64 on the device
    slots: dict[tuple[int, int, int], int]  # (pool block, slot address, bytes) -> its row in hashes


def rules_of(plan: Plan, views: HostViews) -> Rules:
    members: list[list[int]] = [[] for _ in plan.storages]
    eligible = [n > 0 for n in plan.nbytes]
    for ti, r in enumerate(plan.tensors):
        members[r.storage_index].append(ti)
        if r.name.endswith(".grad") or (r.name.startswith("optimizer") and ".state[" in r.name):
            eligible[r.storage_index] = False
    packed_at = {si: (k, j) for k, ch in enumerate(views.chunks) for j, si in enumerate(ch.storages)}
    return Rules(plan, views, members, eligible, packed_at)


def hashed_alike(kind: str, baseline: torch.Tensor, rows: list[int], cand: list[int], plan: Plan, views: HostViews,
                 sources: list[torch.Tensor], rules: Rules, written: list[tuple[int, int]],
                 hash_fn: Callable[..., None], *, verify: bool = False) -> set[int]:
    """The storages ``cand`` whose bytes hash now as ``baseline[rows]`` (same order) did: their slots hold
    them. None whose slot overlaps a range in ``written`` ([Note: host tensors of earlier plans]). ``hash_fn``:
    :func:`~.hash.hash_storages`, as the caller names it. ``verify`` (``CoreSettings.verify_skips``): compare
    each storage judged unchanged with its slot too (:func:`_verify`). On any error (memory short at an offload, a hash
    that failed) none: they are copied."""
    if written:
        keep = [k for k, si in enumerate(cand) if not any(
            lo < (p := views.slots[si].data_ptr()) + plan.nbytes[si] and p < hi for lo, hi in written)]
        cand, rows = [cand[k] for k in keep], [rows[k] for k in keep]
    if not cand:
        return set()
    try:
        cur = torch.empty(len(plan.storages), 2, dtype=torch.int64, device=plan.device)
        hash_fn(kind, cur, cand, sources, views.chunks, rules.packed_at)
        equal = (cur.index_select(0, int64_on(cand, cur.device))
                 == baseline.index_select(0, int64_on(rows, baseline.device))).all(1).tolist()
    except Exception:
        logger.warning("torchferry: could not hash the state at offload; it is copied in full", exc_info=True)
        return set()
    same = {si for si, e in zip(cand, equal, strict=False) if e}
    if verify:
        _verify(plan, views, sources, same, rules)
    return same


def _verify(plan: Plan, views: HostViews, sources: list[torch.Tensor], same: set[int], rules: Rules) -> None:
    """Compares every storage judged unchanged with its pool slot (``TORCHFERRY_VERIFY_SKIPS=1``).

    Raises:
        RuntimeError: one differs (a write was missed), naming its tensors.
    """
    for si in sorted(same):
        scratch = torch.empty(plan.nbytes[si], dtype=torch.uint8)
        copy_now(scratch, sources[si])
        if not torch.equal(scratch, views.slots[si]):
            names = ", ".join(plan.tensors[ti].name for ti in rules.members[si])
            raise RuntimeError(
                f"torchferry: TORCHFERRY_VERIFY_SKIPS: the storage of {names} was judged unchanged since the "
                "reload but differs from its host copy; a write was missed (please report it)"
            )
