"""The dock's records: what it counts (:class:`DockStats`), the moves it made (:class:`Move`), and one record per
state set and claimant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

from .._ferry.ferry import Ferry
from .._api.handle import TransferHandle

__all__ = ["DockStats", "Move", "NoRoom", "OverBudget"]


def _fmt(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 1e9:.2f} GB)"


class OverBudget(ValueError):
    """What a decision asks for cannot fit the budget together (``Dock.use``'s ``ValueError``; nothing moved)."""


class NoRoom(RuntimeError):
    """The room a decision needs is held by what is in use (``Dock.use``'s ``RuntimeError``; nothing moved)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DockStats:
    """What a dock has done. Bytes in bytes."""

    uses: int = 0
    """``use()`` / ``acquire()`` calls."""
    hits: int = 0
    """Names a use found resident (or awake) already: no move."""
    prefetch_hits: int = 0
    """State sets a use found loaded (or loading) by an earlier ``prefetch()``."""
    loads: int = 0
    """State-set reloads issued (prefetches included)."""
    prefetch_loads: int = 0
    """Reloads issued by ``prefetch()`` (in the background)."""
    evictions: int = 0
    """State-set offloads issued (prefetches included)."""
    prefetch_evictions: int = 0
    """Offloads issued by ``prefetch()``, overlapping the current phase."""
    swaps: int = 0
    """Evict-and-load pairs run by :func:`torchferry.swap` (both copy engines at once)."""
    wakes: int = 0
    """Claimant ``wake()`` calls."""
    sleeps: int = 0
    """Claimant ``sleep()`` calls."""
    bytes_loaded: int = 0
    """Bytes of the reloads issued."""
    bytes_evicted: int = 0
    """Bytes of the offloads issued (copies the ferry skips included)."""
    waits: int = 0
    """Times a load or wake waited for an outgoing set's copies to finish (see [Note: dock accounting])."""
    adoptions: int = 0
    """Evicted sets found holding state on the device again (loaded behind the dock's back: [Note: state loaded
    behind the dock's back] in ``measure``), counted resident from then."""


class Move(NamedTuple):
    """One move the dock made, in :attr:`Dock.moves`."""

    seq: int
    """Increasing number of the move, from 0."""
    kind: Literal["load", "evict", "wake", "sleep"]
    name: str
    nbytes: int
    handle: TransferHandle | None
    """The ferry's handle for loads and evictions; ``None`` for claimants."""
    background: bool
    """Issued by ``prefetch()``."""
    swap: bool
    """Half of a :func:`torchferry.swap`."""
    at: float
    """``time.perf_counter()`` when issued."""


@dataclasses.dataclass(eq=False)
class _Set:
    name: str
    ferry: Ferry
    order: int  # registration order (ties of the LRU)
    nbytes: int = 0  # bytes counted now, measured at each decision (see [Note: a set counts its bytes now])
    # the device storages nbytes counts: StorageImpl address -> bytes (resident)
    storages: Mapping[int, int] = dataclasses.field(default_factory=dict)
    last_used: int = -1  # tick of the last use
    in_use: int = 0
    handle: TransferHandle | None = None  # the last move's
    side: bool = False  # reloaded on the prefetch stream, not yet handed to the compute stream
    prefetched: bool = False  # loaded by prefetch(), not used since
    hooks: list = dataclasses.field(default_factory=list)  # its targets' load_state_dict post-hooks (RemovableHandle)


@dataclasses.dataclass(eq=False)
class _Claimant:
    name: str
    nbytes: int
    order: int
    sleep: Callable[[], object] | None
    wake: Callable[[], object] | None
    empty_cache: bool
    last_used: int = -1
    in_use: int = 0
    awake: bool = False
    fixed: bool = False  # Dock.reserve(): always counted (awake), never a victim

    @property
    def transient(self) -> bool:
        """A byte count only: its bytes count while a use holds it, then are taken as freed."""
        return self.sleep is None and not self.fixed

    @property
    def movable(self) -> bool:
        """The dock can free its bytes (``sleep()``): neither a byte count nor reserved."""
        return self.sleep is not None
