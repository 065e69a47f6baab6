"""The dock's schedule, its budget arithmetic and its choice of victims.


[Note: choosing victims]
Sets leave only when the budget needs their room ("lazy"): a set that fits
stays resident across phases and costs nothing. When room is needed, idle
sets and awake claimants (never the ones in use) are chosen:

* without a schedule, least recently used first, until enough bytes are free;
* with a declared schedule (:meth:`Dock.plan`), Belady's rule extended to
  sizes: among the groups of candidates that free enough bytes, the one whose
  sets must come back with the fewest bytes (a set that the schedule never
  uses again costs nothing, nor does a claimant: the dock moves none of its
  bytes), then the one whose soonest-needed member is needed furthest in the
  future (Belady; with sets of one size this is exactly Belady's choice),
  then the fewest bytes freed. When the rollout's KV cache needs room in a
  GRPO step, plain Belady would evict the 30 GB optimizer state (needed
  three phases ahead) rather than the 15 GB reference model (needed next);
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from .._api.residency import Residency
from .measure import kept_storages
from .records import _Claimant, _Set

__all__ = ["Schedule"]

_EXHAUSTIVE_MAX = 12  # candidates up to which every group of victims is compared (2**12 groups)


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """The phases of a step, in order, each the names one ``use()`` takes; repeated cyclically.

    ``Schedule.of(["rollout", "ref", "actor_params", ("actor_params", "actor_opt")])``.
    A ``use()`` whose names equal a phase's moves the dock's position there
    (the next such phase from the current one); other uses leave it where it is.
    """

    phases: tuple[frozenset[str], ...]
    """Names of each phase (state sets and claimants), in the order the step uses them."""

    def __post_init__(self) -> None:
        if not isinstance(self.phases, tuple) or not self.phases:
            raise ValueError(f"torchferry.Schedule: phases must be a non-empty tuple, got {self.phases!r}")
        for i, phase in enumerate(self.phases):
            if not isinstance(phase, frozenset) or not phase or not all(isinstance(n, str) for n in phase):
                raise ValueError(f"torchferry.Schedule: phase {i} must be a non-empty frozenset of names, "
                                 f"got {phase!r}")

    @classmethod
    def of(cls, phases: Sequence[str | Iterable[str]]) -> Schedule:
        """Builds a schedule from phases given as one name or an iterable of names each.

        Raises:
            ValueError: no phases, an empty phase, a name repeated within a phase.
        """
        if isinstance(phases, str):
            raise ValueError("torchferry.Schedule: give a sequence of phases, not one string")
        out = []
        for i, phase in enumerate(phases):
            names = (phase,) if isinstance(phase, str) else tuple(phase)
            if not names:  # said in the caller's terms, before the frozenset check would
                raise ValueError(f"torchferry.Schedule: phase {i} is empty: give each phase a name or names")
            if len(set(names)) != len(names):
                raise ValueError(f"torchferry.Schedule: phase {i} names {names} more than once")
            out.append(frozenset(names))
        if not out:
            raise ValueError("torchferry.Schedule: give at least one phase (a name or names each)")
        return cls(tuple(out))

    @property
    def names(self) -> frozenset[str]:
        """Every name the schedule uses."""
        return frozenset().union(*self.phases)

    def distance(self, name: str, base: int) -> float:
        """Phases from position ``base`` to the next phase that uses ``name`` (1..len), ``inf`` if none."""
        n = len(self.phases)
        for k in range(1, n + 1):
            if name in self.phases[(base + k) % n]:
                return k
        return math.inf

    def match(self, names: frozenset[str], base: int) -> int | None:
        """Index of the next phase after ``base`` (cyclically, itself last) whose names are ``names``."""
        n = len(self.phases)
        for k in range(1, n + 1):
            i = (base + k) % n
            if self.phases[i] == names:
                return i
        return None



def held(sets: Iterable[_Set], claimants: Iterable[_Claimant], *, physical: bool = False,
         after_release: bool = False, evicting: Mapping[str, Mapping[int, int]] | None = None) -> int:
    """Bytes counted against the budget (see [Note: dock accounting] in ``_engine``): each set's
    ``nbytes`` as last measured; an evicted set, the storages its offload kept on the device
    (:func:`~.measure.kept_storages`), each once across the sets and not where a resident set
    counts it already ([Note: kept storages count once] in ``measure``).

    Args:
        physical: also count sets whose offload is still copying.
        after_release: as if every use now open were left (byte-count
            claimants in use then count nothing).
        evicting: sets to count as if evicted now (name -> the storages their
            offload would keep: :func:`~.measure.eviction_keeps`), for the
            bytes an eviction frees ([Note: an eviction frees what it releases]).
    """
    total = 0
    counted: set[int] = set()  # storages a set counts in its nbytes
    kept: dict[int, int] = {}
    for s in sets:
        r = s.ferry.residency
        if evicting is not None and s.name in evicting:
            kept.update(evicting[s.name])
        elif not r.on_host or (physical and r is Residency.D2H_IN_FLIGHT):
            total += s.nbytes - sum(n for key, n in s.storages.items() if key in counted)  # shared: once
            counted.update(s.storages)
            if r.on_host:  # in flight: its nbytes (the plan's) counts its kept storages too
                counted.update(kept_storages(s.ferry))
        else:
            kept.update(kept_storages(s.ferry))
    total += sum(n for key, n in kept.items() if key not in counted)
    for c in claimants:
        if c.awake or (c.transient and c.in_use > 0 and not after_release):
            total += c.nbytes
    return total


def lru(candidates: list[str], need: int, busy: set[str], item: Callable[[str], _Set | _Claimant],
        nbytes: Callable[[str], int]) -> list[str]:
    """Least recently used first (for a prefetch, the ones idle now before those in use); ``nbytes``: what
    each candidate's eviction frees ([Note: an eviction frees what it releases] in ``measure``)."""
    def key(n: str) -> tuple[bool, int, int]:
        it = item(n)
        return (n in busy, it.last_used, it.order)

    out, freed = [], 0
    for n in sorted(candidates, key=key):
        if freed >= need:
            break
        out.append(n)
        freed += nbytes(n)
    return out


def belady(schedule: Schedule, candidates: list[str], need: int, base: int, busy: set[str],
           sets: Mapping[str, _Set], nbytes: Callable[[str], int]) -> list[str]:
    """See [Note: choosing victims]; ``busy`` members count against a group, for prefetches; ``nbytes``: what
    each candidate's eviction frees, a set's cost its counted bytes (its reload copies them all)."""
    dist = {n: schedule.distance(n, base) for n in candidates}
    size = {n: nbytes(n) for n in candidates}  # freed by the eviction
    cost = {n: (sets[n].nbytes if n in sets and dist[n] != math.inf else 0) for n in candidates}  # back in


    def key(group: Sequence[str]) -> tuple:
        return (sum(cost[n] for n in group), sum(n in busy for n in group),
                -min(dist[n] for n in group), sum(size[n] for n in group), sorted(group))

    if len(candidates) > _EXHAUSTIVE_MAX:  # greedy: cheapest, idle, furthest first
        out, freed = [], 0
        for n in sorted(candidates, key=lambda n: (cost[n], n in busy, -dist[n], n)):
            if freed >= need:
                break
            out.append(n)
            freed += size[n]
        return out
    best = None
    for r in range(1, len(candidates) + 1):
        for group in itertools.combinations(candidates, r):
            freed = sum(size[n] for n in group)
            if freed < need or any(freed - size[n] >= need for n in group):
                continue  # not enough, or not minimal
            k = key(group)
            if best is None or k < best[0]:
                best = (k, list(group))
    assert best is not None
    return best[1]
