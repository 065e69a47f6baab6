"""The dock's engine: its state, budget accounting and the moves that carry out its decisions.

[Note: dock accounting]
The budget counts bytes the dock knows, not ``torch.cuda.memory_allocated``:
each resident state set's bytes as they are now (the storages it holds on the
device, measured at every decision: [Note: a set counts its bytes now] in
``_measure``), each evicted set's ``ferry.state_bytes``, each awake claimant's
bytes, and each byte-count claimant while a ``use()`` holds it. So the arithmetic is
the same on the CPU (``Ferry(..., device="cpu")``, where it is tested) as on
a GPU, and what the compute allocates besides the state (activations,
gradients, optimizer temporaries) is declared as a byte-count claimant used
with the phase (``dock.use("actor_params", "actor_opt", "update_workspace")``).
Two views of that sum are kept apart. *Planning* counts a set as gone as soon
as its offload was issued. *Execution* counts it until its D2H copies are
complete: before anything is loaded or woken into that room, and before a
``use()`` of a byte-count claimant returns (its bytes are allocated right
after), the dock waits for the oldest outgoing sets until the new bytes fit
(``DockStats.waits`` counts these waits). Without that wait, the
reload's allocations would come while the outgoing blocks are still held
for their copies (``record_stream``), and the device would briefly hold
both: over budget (the bug [Note: swap budget] describes for one swap).
Every public call measures the sets once at its start (``_refresh``) and
again each set it moves, right after the move; the decisions in between
read those numbers. State that grows inside a ``use()`` (gradients, an
optimizer's first step) is seen at its ``release()``: if more than the budget
is then held, the idle sets and claimants leave as far as the budget needs,
chosen as for a ``use()`` (``_restore``), so the next phase starts within it.

[Note: one dock per ferry]
Two docks holding one ferry would each evict it while the other's ``use()``
holds it. ``Dock.add`` looks the ferry up in ``_HOLDERS`` (ferry -> weak
reference to its dock, both held weakly) and refuses it while another dock
that is still alive holds it; ``remove()``, ``close()`` and the dock's
garbage collection let it go.

[Note: prefetch]
``prefetch(name)`` plans the victims ``use(name)`` would need once the sets
now in use are released (with a schedule, of two groups of equal cost the
one with fewer members in use now), and acts only if none of them is in use
now: then
the victims leave at once (their D2H copies overlap the current phase's
compute) and a state set starts loading as soon as its room is free. Nothing
else is evicted for a prefetch, so it never adds traffic ``use()`` would not
have made; a claimant's ``wake()`` runs in ``use()``, only its room is made
ahead. A prefetch that could not start is retried by every later dock call.

[Note: prefetch hand-off]
``Ferry.reload()`` makes the caller's current stream wait for its copies.
Called on the compute stream, a prefetch would hold back every kernel queued
after it until the whole set had arrived: no overlap. So prefetch reloads run
with the dock's own stream current; the compute stream does not wait, and the
storages come from that stream's blocks, which no other work touches.
Before a prefetched set is used, or evicted, the compute stream is made to
wait for the reload (``handle.wait_stream``): ``use()``, ``acquire()``,
``require()``, ``wait()`` and eviction do it. Without it a forward would read
half-copied parameters, and an offload (whose D2H copies wait only for the
current stream) would copy bytes that had not arrived yet. FSDP2's all-gather
streams wait for the reload by themselves (``Ferry.reload``). Do not move a
docked set behind the dock's back while a prefetch may be in flight; call
``dock.wait()`` first.

[Note: released without a copy]
A set evicted after a forward-only phase (reference log-probabilities) holds
the bytes its host copy already has. The dock simply calls ``offload()``;
skipping the D2H copies of storages whose host copy is still exact is the
ferry's job, not the dock's.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref

import torch

from .._api.args import check_device, shown
from .._ferry.ferry import Ferry
from .._api.handle import TransferHandle
from .._api.residency import Residency
from .._ferry.swap import swap
from .measure import counted_bytes
from .records import Move, _Claimant, _fmt, _Set
from .schedule import Schedule, belady, held, lru

logger = logging.getLogger("torchferry")

_MOVES_KEPT = 4096

# ferry -> its dock, see [Note: one dock per ferry]
_HOLDERS: weakref.WeakKeyDictionary[Ferry, weakref.ref[_Engine]] = weakref.WeakKeyDictionary()


class _Engine:
    """State and internals of :class:`~torchferry.Dock` (its base class; see the module docstring)."""

    def __init__(self, budget_bytes: int, *, device: torch.device | str | None = None) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"torchferry: Dock: budget_bytes must be an int > 0 (bytes), got {budget_bytes!r}")
        self._budget = budget_bytes
        self._device: torch.device | None = check_device(device, "Dock(device=...)")
        self._sets: dict[str, _Set] = {}
        self._claimants: dict[str, _Claimant] = {}
        self._schedule: Schedule | None = None
        self._pos = -1  # index of the schedule's phase last used (-1: before the first)
        self._tick = 0
        self._leaving: list[str] = []  # sets whose offload may still be copying, oldest first
        self._pending: list[str] = []  # prefetches waiting for room, see [Note: prefetch]
        self._stream: torch.cuda.Stream | None = None  # see [Note: prefetch hand-off]
        self._counts = collections.Counter()
        self._moves: collections.deque[Move] = collections.deque(maxlen=_MOVES_KEPT)
        self._seq = 0
        self._next_order = 0
        self._closed = False

    def _order(self) -> int:
        self._next_order += 1
        return self._next_order - 1

    def _check_new_name(self, name: str) -> None:
        if self._closed:
            raise RuntimeError("torchferry: Dock: this dock is closed; make a new Dock")
        if not isinstance(name, str) or not name:
            raise ValueError(f"torchferry: Dock: a name must be a non-empty str, got {name!r}")
        if name in self._sets or name in self._claimants:
            raise ValueError(f"torchferry: Dock: the name {name!r} is already registered")

    def _check_names(self, names: tuple[str, ...], what: str) -> tuple[str, ...]:
        odd = [n for n in names if not isinstance(n, str)]
        if odd:  # dock.use(["a", "b"]) gave "unhashable type: 'list'"
            raise TypeError(f"torchferry: Dock.{what}() takes names as separate str arguments "
                            f"(dock.{what}('a', 'b')), got {shown(odd[0])}")
        if not names:
            raise ValueError(f"torchferry: Dock.{what}: give at least one name")
        unknown = [n for n in names if n not in self._sets and n not in self._claimants]
        if unknown:
            raise ValueError(f"torchferry: Dock.{what}: unknown names {unknown}; registered: "
                             f"{sorted((*self._sets, *self._claimants))}")
        if len(set(names)) != len(names):
            raise ValueError(f"torchferry: Dock.{what}: a name is repeated in {list(names)}")
        return names

    @property
    def _cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def _nbytes(self, name: str) -> int:
        s = self._sets.get(name)
        return s.nbytes if s is not None else self._claimants[name].nbytes

    def _measure(self, s: _Set) -> int:
        """Measures ``s`` now (see [Note: a set counts its bytes now]); returns its bytes."""
        s.nbytes = counted_bytes(s.ferry)
        return s.nbytes

    def _refresh(self) -> None:
        """Measures every set, at the start of a decision (see [Note: dock accounting])."""
        for s in self._sets.values():
            self._measure(s)

    def _grown(self, name: str) -> str:
        """`` (grew while resident ...)`` for a set counted above its last plan, else ``""``."""
        s = self._sets.get(name)
        if s is None or s.nbytes <= s.ferry.state_bytes:
            return ""
        return f" (grew while resident: its last plan had {s.ferry.state_bytes} bytes)"

    # one dock per ferry -------------------------------------------------------------
    @staticmethod
    def _holder(ferry: Ferry) -> _Engine | None:
        """The live dock that holds ``ferry``, if any (see [Note: one dock per ferry])."""
        ref = _HOLDERS.get(ferry)
        dock = ref() if ref is not None else None
        if dock is None or not any(s.ferry is ferry for s in dock._sets.values()):
            return None
        return dock

    def _label(self) -> str:
        return f"Dock at {id(self):#x} with budget_bytes={self._budget} and sets {list(self._sets)}"

    def _drop(self, name: str) -> None:
        """Forgets ``name`` (idle; its moves waited for): the set stays where it is, its ferry is let go."""
        s = self._sets.pop(name, None)
        if s is not None:
            if s.handle is not None:
                s.handle.wait()
            self._hand_off(s)
            ref = _HOLDERS.get(s.ferry)
            if ref is not None and ref() is self:
                del _HOLDERS[s.ferry]
        else:
            del self._claimants[name]
        self._pending = [n for n in self._pending if n != name]
        self._leaving = [n for n in self._leaving if n != name]

    def _resident(self, name: str) -> bool:
        s = self._sets.get(name)
        if s is not None:
            return not s.ferry.residency.on_host
        c = self._claimants[name]
        return c.awake or (c.transient and c.in_use > 0)

    def _held(self, *, physical: bool = False, after_release: bool = False) -> int:
        """Bytes counted against the budget (see [Note: dock accounting])."""
        return held(self._sets.values(), self._claimants.values(), physical=physical, after_release=after_release)

    def _victims(self, names: tuple[str, ...], *, base: int, ahead: bool) -> list[str] | None:
        """What must leave for ``names`` to be resident together (``None``: cannot be done).

        ``ahead`` (a prefetch): plan as if the uses now open were left, and
        let sets in use be candidates (the caller acts only if none is chosen).
        """
        incoming = sum(self._nbytes(n) for n in names if not self._resident(n))
        need = self._held(after_release=ahead) + incoming - self._budget
        if need <= 0:
            return []
        candidates = []
        for n, item in (*self._sets.items(), *self._claimants.items()):
            if n in names or not self._resident(n) or (item.in_use and not ahead):
                continue
            if isinstance(item, _Claimant) and item.transient:
                continue  # its bytes are freed by its user, not by the dock
            candidates.append(n)
        if sum(self._nbytes(n) for n in candidates) < need:
            return None
        busy = {n for n in candidates if (self._sets.get(n) or self._claimants[n]).in_use}
        if self._schedule is None:
            return lru(candidates, need, busy, lambda n: self._sets.get(n) or self._claimants[n], self._nbytes)
        return belady(self._schedule, candidates, need, base, busy, self._sets, self._nbytes)

    def _no_room(self, names: tuple[str, ...]) -> str:
        want = ", ".join(f"{n!r} ({_fmt(self._nbytes(n))})" for n in names if not self._resident(n))
        in_use = sorted(n for n, item in (*self._sets.items(), *self._claimants.items()) if item.in_use)
        held_ = [(n, self._nbytes(n)) for n in in_use if self._resident(n) and n not in names]
        holders = ", ".join(f"{n!r} {_fmt(b)}" for n, b in held_) or "nothing"
        return (
            f"torchferry: Dock.use: cannot make room for {want} within the budget of {_fmt(self._budget)}: "
            f"{_fmt(self._held())} is held, and what is in use cannot be evicted ({holders}); "
            "leave those use() blocks first, or raise budget_bytes. Nothing was moved"
        )

    # execution ------------------------------------------------------------------
    def _log(self, kind: str, name: str, nbytes: int, handle: TransferHandle | None, *, background: bool,
             swapped: bool = False) -> None:
        self._moves.append(Move(self._seq, kind, name, nbytes, handle, background, swapped,  # type: ignore[arg-type]
                                time.perf_counter() if handle is None else handle.issued_at))
        self._seq += 1
        logger.debug("dock: %s %s (%d bytes)%s%s", kind, name, nbytes, " in the background" if background else "",
                     " by swap" if swapped else "")

    def _side_stream(self) -> torch.cuda.Stream:
        # The stream prefetch reloads are issued with, so the compute stream does not wait for them
        # (see [Note: prefetch hand-off]).
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def _hand_off(self, s: _Set) -> None:
        """Makes the current stream wait for a prefetch reload (see [Note: prefetch hand-off])."""
        if s.side:
            assert s.handle is not None
            s.handle.wait_stream(torch.cuda.current_stream(self._device))
            s.side = False

    def _prune_leaving(self) -> None:
        self._leaving = [n for n in self._leaving if self._sets[n].ferry.residency is Residency.D2H_IN_FLIGHT]

    def _wait_room(self, nbytes: int) -> None:
        """Waits for outgoing sets, oldest first, until ``nbytes`` more fit physically."""
        self._prune_leaving()
        while self._leaving and self._held(physical=True) + nbytes > self._budget:
            s = self._sets[self._leaving.pop(0)]
            h = s.handle if s.handle is not None and s.handle.direction == "d2h" else None
            if h is None:  # offloaded behind the dock's back: its last handle is that offload's
                h = getattr(s.ferry, "last_handle", None) or s.ferry.offload()  # offload(): a no-op returning it
            h.wait()
            self._counts.update(waits=1)
            self._prune_leaving()

    def _fits_now(self, nbytes: int) -> bool:
        self._prune_leaving()
        return self._held(physical=True) + nbytes <= self._budget

    def _evict_set(self, s: _Set, *, background: bool) -> None:
        self._hand_off(s)
        h = s.ferry.offload()
        s.handle, s.prefetched = h, False
        self._measure(s)  # the offload planned what it moved
        self._leaving.append(s.name)
        self._counts.update(evictions=1, bytes_evicted=h.nbytes, prefetch_evictions=int(background))
        self._log("evict", s.name, h.nbytes, h, background=background)

    def _load_set(self, s: _Set, *, background: bool) -> None:
        if background and self._cuda:
            with torch.cuda.stream(self._side_stream()):
                h = s.ferry.reload()
            s.side = True
        else:
            h = s.ferry.reload()
        s.handle, s.prefetched = h, background
        self._measure(s)
        self._counts.update(loads=1, bytes_loaded=h.nbytes, prefetch_loads=int(background))
        self._log("load", s.name, h.nbytes, h, background=background)

    def _sleep(self, c: _Claimant, *, background: bool) -> None:
        assert c.sleep is not None
        c.sleep()
        c.awake = False
        self._counts.update(sleeps=1)
        self._log("sleep", c.name, c.nbytes, None, background=background)

    def _wake(self, c: _Claimant) -> None:
        assert c.wake is not None
        self._wait_room(c.nbytes)
        if c.empty_cache and self._cuda:
            torch.cuda.empty_cache()
        c.wake()
        c.awake = True
        self._counts.update(wakes=1)
        self._log("wake", c.name, c.nbytes, None, background=False)

    def _settle_allocator(self) -> None:
        """Lets the caching allocator free blocks whose copies are done, so ``memory_allocated`` is current.

        Blocks released with ``record_stream`` stay counted until the
        allocator processes their events, which it does at its next
        allocation; a 1-byte allocation is that allocation.
        """
        if self._cuda:
            torch.empty(1, dtype=torch.uint8, device=self._device)

    def _bring_in(self, names: tuple[str, ...], victims: list[str], *, background: bool) -> None:
        """Evicts ``victims`` and brings ``names`` in (see [Note: dock accounting])."""
        loads = [self._sets[n] for n in names if n in self._sets and not self._resident(n)]
        wakes = [self._claimants[n] for n in names
                 if n in self._claimants and not self._claimants[n].transient and not self._claimants[n].awake]
        out_sets = [self._sets[v] for v in victims if v in self._sets]
        for v in victims:
            if v in self._claimants:
                self._sleep(self._claimants[v], background=background)
        if len(out_sets) == 1 and loads and not background and not self._fits_now(loads[0].nbytes):
            self._swap(out_sets.pop(), loads.pop(0))
        for s in out_sets:
            self._evict_set(s, background=background)
        for s in loads:
            self._wait_room(s.nbytes)
            self._load_set(s, background=background)
        for c in wakes:
            self._wake(c)
        if not background:  # the caller allocates a byte-count claimant's bytes as soon as use() returns
            self._wait_room(sum(self._claimants[n].nbytes for n in names if n in self._claimants
                                and self._claimants[n].transient and not self._claimants[n].in_use))

    def _swap(self, out: _Set, into: _Set) -> None:
        """One set out and one in on both copy engines; ``into`` waits only for the bytes it needs."""
        out_bytes, in_bytes = out.nbytes, into.nbytes
        self._wait_room(in_bytes - out_bytes)  # other outgoing sets first
        self._hand_off(out)
        budget = None
        if self._cuda:
            self._settle_allocator()
            budget = torch.cuda.memory_allocated(self._device) + self._budget - self._held(physical=True)
        try:
            h_out, h_in = swap(out.ferry, into.ferry, gpu_budget_bytes=budget)
        except ValueError:
            # swap() checks against memory_allocated(), which also counts memory the dock does
            # not know; nothing moved: do it one after the other instead.
            logger.debug("dock: swap(%s, %s) refused; evicting then loading", out.name, into.name, exc_info=True)
            self._evict_set(out, background=False)
            self._wait_room(in_bytes)
            self._load_set(into, background=False)
            return
        out.handle, out.prefetched = h_out, False
        into.handle, into.prefetched = h_in, False
        self._measure(out)
        self._measure(into)
        self._leaving.append(out.name)
        self._counts.update(evictions=1, loads=1, swaps=1, bytes_evicted=h_out.nbytes, bytes_loaded=h_in.nbytes)
        self._log("evict", out.name, h_out.nbytes, h_out, background=False, swapped=True)
        self._log("load", into.name, h_in.nbytes, h_in, background=False, swapped=True)

    def _prefetch_one(self, name: str) -> bool:
        if name in self._pending:
            self._pending.remove(name)
        if self._resident(name):
            return True
        victims = self._victims((name,), base=self._pos, ahead=True)
        if victims is None or any((self._sets.get(v) or self._claimants[v]).in_use for v in victims):
            return False
        s = self._sets.get(name)
        for v in victims:
            if v in self._claimants:
                self._sleep(self._claimants[v], background=True)
            else:
                self._evict_set(self._sets[v], background=True)
        if s is not None:
            if self._fits_now(s.nbytes):
                self._load_set(s, background=True)
            else:
                self._pending.append(name)  # loads when its room is free (see _poll)
        return True

    def _poll(self) -> None:
        """Starts prefetch loads whose room has become free (see [Note: prefetch])."""
        if not self._pending:
            return
        self._prune_leaving()
        still = []
        for n in self._pending:
            s = self._sets[n]
            if self._resident(n):
                continue
            if self._held() + s.nbytes > self._budget:
                continue  # the room went elsewhere: use() will bring it in
            if self._fits_now(s.nbytes):
                self._load_set(s, background=True)
            else:
                still.append(n)
        self._pending = still

    def _restore(self) -> None:
        """Brings the dock back within the budget after state grew in a use (see [Note: dock accounting]).

        The idle sets leave and the idle claimants sleep as far as the budget
        needs, chosen as for a ``use()``; all idle ones if even that is not
        enough (what is in use then holds the rest).
        """
        need = self._held() - self._budget
        if need <= 0:
            return
        victims = self._victims((), base=self._pos, ahead=False)
        if victims is None:  # what is in use holds more than the budget: free what is idle
            victims = [n for n, item in (*self._sets.items(), *self._claimants.items())
                       if self._resident(n) and not item.in_use
                       and not (isinstance(item, _Claimant) and item.transient)]
        logger.debug("dock: %d bytes over the budget after a use (state grew); evicting %s", need, victims)
        for v in victims:
            if v in self._claimants:
                self._sleep(self._claimants[v], background=False)
            else:
                self._evict_set(self._sets[v], background=False)
