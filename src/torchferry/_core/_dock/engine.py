"""The dock's engine (:class:`DockEngine`): its state, budget accounting and decisions, carried out by its
:class:`~torchferry._core._dock.mover.Mover`.

[Note: dock accounting]
The budget counts bytes the dock knows, not ``torch.cuda.memory_allocated``:
each resident state set's bytes as they are now (the storages it holds on the
device, measured at every decision: [Note: a set counts its bytes now] in
``measure``), each evicted set's ``ferry.state_bytes``, each awake claimant's
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
Every public call measures the sets once at its start (``refresh``) and
again each set it moves, right after the move; the decisions in between
read those numbers. State that grows inside a ``use()`` (gradients, an
optimizer's first step) is seen at its ``release()``: if more than the budget
is then held, the idle sets and claimants leave as far as the budget needs,
chosen as for a ``use()`` (``_restore``), so the next phase starts within it.
Bytes reserved with ``Dock.reserve`` (state a framework keeps on the device, which
the dock never moves) count at every decision, as an awake claimant that is never
a victim. An evicted set given new state on the device behind the dock's back is
taken in as resident at the next decision ([Note: state loaded behind the dock's
back] in ``measure``), and right after a ``load_state_dict`` of one of its targets.

[Note: one dock per ferry]
Two docks holding one ferry would each evict it while the other's ``use()`` holds it. ``Dock.add`` looks the
ferry up in ``_HOLDERS`` (ferry -> weak reference to the engine of its dock, both held weakly: the engine lives as
long as its dock) with ``DockEngine.holder`` and refuses it while another dock that is still alive holds it;
``remove()``, ``close()`` and the dock's garbage collection let it go.

[Note: prefetch]
``prefetch(name)`` plans the victims ``use(name)`` would need once the sets
now in use are released (with a schedule, of two groups of equal cost the
one with fewer members in use now), and acts only if none of them is in use
now: then the victims leave at once (their D2H copies overlap the current phase's
compute) and a state set starts loading as soon as its room is free. Nothing
else is evicted for a prefetch, so it never adds traffic ``use()`` would not
have made; a claimant's ``wake()`` runs in ``use()``, only its room is made
ahead. A prefetch that could not start is retried by every later dock call.

[Note: released without a copy]
A set evicted after a forward-only phase holds the bytes its host copy has: the dock calls ``offload()``,
and skipping the D2H copies of storages whose host copy is still exact is the ferry's job.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch

from .._ferry.ferry import Ferry
from .measure import appeared_bytes, ensure_plan, eviction_keeps, is_closed, kept_bytes, replan_if_moved, targets_of
from .mover import Mover
from .records import NoRoom, OverBudget, _Claimant, _fmt, _Set
from .schedule import Schedule, belady, held, lru
from .serial import DockLock

__all__ = ["DockEngine"]

logger = logging.getLogger("torchferry")

# ferry -> the engine of its dock, see [Note: one dock per ferry]
_HOLDERS: weakref.WeakKeyDictionary[Ferry, weakref.ref[DockEngine]] = weakref.WeakKeyDictionary()


class DockEngine:
    """The mechanism of one :class:`~torchferry.Dock`, held as ``dock._engine``: its state, accounting and decisions.

    The dock checks the arguments and words the errors of bad calls; the
    engine keeps the sets, claimants and schedule, does the budget arithmetic
    and chooses the victims, and its :class:`Mover` (``mover``) carries out
    the moves and keeps their record. It raises only what its state tells:
    names that need more than the budget now, or no room while what holds
    it is in use.

    Args:
        budget_bytes: the budget, an int > 0 (see [Note: dock accounting]).
        device: the state sets' device, or ``None`` until the first set.
        owner: the dock it serves; only its id is kept (for messages), so the
            engine lives exactly as long as its dock.
    """

    def __init__(self, budget_bytes: int, device: torch.device | None, *, owner: object) -> None:
        self.budget = budget_bytes
        self.sets: dict[str, _Set] = {}
        self.claimants: dict[str, _Claimant] = {}
        self.mover = Mover(budget_bytes, self.sets, self.claimants, device)
        self.schedule: Schedule | None = None
        self.pos = -1  # index of the schedule's phase last used (-1: before the first)
        self.closed = False
        self._ident = id(owner)
        self.lock = DockLock()  # held by each of the dock's calls: [Note: one thread drives a dock] in serial
        self._tick = 0
        self._pending: list[str] = []  # prefetches waiting for room, see [Note: prefetch]
        self._next_order = 0

    @property
    def device(self) -> torch.device | None:
        """The state sets' device (``None`` before the first set)."""
        return self.mover.device

    # registration ---------------------------------------------------------------
    def _order(self) -> int:
        self._next_order += 1
        return self._next_order - 1

    @staticmethod
    def holder(ferry: Ferry) -> DockEngine | None:
        """The engine of the live dock that holds ``ferry``, if any (see [Note: one dock per ferry])."""
        ref = _HOLDERS.get(ferry)
        engine = ref() if ref is not None else None
        if engine is None or not any(s.ferry is ferry for s in engine.sets.values()):
            return None
        return engine

    def label(self) -> str:
        """The dock, for messages: its address, budget and sets."""
        return f"Dock at {self._ident:#x} with budget_bytes={self.budget} and sets {list(self.sets)}"

    def add_set(self, name: str, ferry: Ferry) -> None:
        """Registers a checked set where it is: plans a resident ferry that has no plan, measures it, holds it."""
        ensure_plan(ferry)
        self.mover.device = ferry.device
        self.sets[name] = s = _Set(name, ferry, self._order())
        self.measure(s)
        _HOLDERS[ferry] = weakref.ref(self)
        me = weakref.ref(self)

        def loaded(*_: object) -> None:  # see [Note: state loaded behind the dock's back] in measure
            engine = me()
            if engine is not None and engine.sets.get(name) is s:
                engine.after_load()

        for t in targets_of(ferry):
            if isinstance(t, (torch.nn.Module, torch.optim.Optimizer)):
                s.hooks.append(t.register_load_state_dict_post_hook(loaded))

    def add_claimant(self, name: str, nbytes: int, sleep: Callable[[], object] | None,
                     wake: Callable[[], object] | None, empty_cache: bool) -> None:
        """Registers a checked claimant, asleep."""
        self.claimants[name] = _Claimant(name, nbytes, self._order(), sleep, wake, empty_cache)

    def reserve(self, name: str, nbytes: int) -> None:
        """Registers (or re-sizes) checked reserved bytes; back within the budget if they grew."""
        c = self.claimants.get(name)
        before = None if c is None else c.nbytes
        if c is None:
            self.claimants[name] = _Claimant(name, nbytes, self._order(), None, None, False, awake=True, fixed=True)
        else:
            c.nbytes = nbytes
        try:
            self.refresh()
            self._restore()
        except BaseException:  # the room could not be made: the reservation is as it was
            if before is None:
                del self.claimants[name]
            else:
                self.claimants[name].nbytes = before
            raise

    def reserved(self, names: tuple[str, ...] = ()) -> int:
        """Bytes reserved (``Dock.reserve``) under names other than ``names``."""
        return sum(c.nbytes for c in self.claimants.values() if c.fixed and c.name not in names)

    def after_load(self) -> None:
        """A target's ``load_state_dict`` returned: measured again, back within the budget."""
        with self.lock.held("load_state_dict()'s decision", self.label):
            self.refresh()
            self._restore()
            self._poll()

    def check_open(self, names: Iterable[str]) -> None:
        """Refuses to move a set whose ferry was closed behind the dock's back, naming the set and the dock."""
        for n in names:
            s = self.sets.get(n)
            if s is not None and is_closed(s.ferry):
                raise RuntimeError(f"torchferry: Dock: the ferry of state set {n!r} was closed while in the dock "
                                   f"({self.label()}); dock.remove({n!r}) and add a new Ferry")

    def drop(self, name: str) -> None:
        """Forgets ``name`` (idle; its moves waited for): the set stays where it is, its ferry is let go."""
        s = self.sets.pop(name, None)
        if s is not None:
            for h in s.hooks:
                h.remove()
            if s.handle is not None:
                s.handle.wait()
            self.mover.hand_off(s)
            ref = _HOLDERS.get(s.ferry)
            if ref is not None and ref() is self:
                del _HOLDERS[s.ferry]
        else:
            del self.claimants[name]
        self._pending = [n for n in self._pending if n != name]
        self.mover.forget(name)

    def close(self) -> None:
        """Forgets every set and claimant (none in use) and the schedule; the dock takes no new ones."""
        for name in [*self.sets, *self.claimants]:
            self.drop(name)
        self.schedule, self.pos, self.closed = None, -1, True

    def plan(self, schedule: Schedule | None) -> None:
        """Declares a checked schedule (``None``: least recently used), from before its first phase."""
        self.schedule = schedule
        self.pos = -1

    # accounting -----------------------------------------------------------------
    def item(self, name: str) -> _Set | _Claimant:
        """The record of the set or claimant ``name``."""
        return self.sets.get(name) or self.claimants[name]

    @property
    def in_use(self) -> frozenset[str]:
        """Names held by a ``use()`` now."""
        return frozenset(n for n, item in (*self.sets.items(), *self.claimants.items()) if item.in_use)

    def nbytes(self, name: str) -> int:
        """Bytes counted for ``name``, a set's as last measured."""
        s = self.sets.get(name)
        return s.nbytes if s is not None else self.claimants[name].nbytes

    def measure(self, s: _Set) -> int:
        """Measures ``s`` now (see [Note: a set counts its bytes now]); returns its bytes."""
        return self.mover.measure(s)

    def refresh(self, adopt: bool = True) -> None:
        """Measures every set, at the start of a decision (see [Note: dock accounting]); an evicted set holding
        state on the device again is taken in as resident ([Note: state loaded behind the dock's back]), unless
        ``adopt`` is off (a reading, which moves nothing: :meth:`appeared` counts those bytes instead); a resident
        set a submodule's move left over old storages is planned again (``replan_if_moved``)."""
        for s in self.sets.values():
            if adopt and appeared_bytes(s.ferry):
                self.mover.adopt(s)
            if adopt:
                replan_if_moved(s.ferry)
            self.measure(s)

    def appeared(self) -> int:
        """Bytes evicted sets hold on the device again, not yet taken in (a reading between decisions)."""
        return sum(appeared_bytes(s.ferry) for s in self.sets.values())

    def _grown(self, name: str) -> str:
        """`` (grew while resident ...)`` for a set counted above its last plan, else ``""``."""
        s = self.sets.get(name)
        if s is None or s.nbytes <= s.ferry.state_bytes:
            return ""
        return f" (grew while resident: its last plan had {s.ferry.state_bytes} bytes)"

    def resident(self, name: str) -> bool:
        """Whether a set is on the device (loading counts), or a claimant awake or in use."""
        s = self.sets.get(name)
        if s is not None:
            return not s.ferry.residency.on_host
        c = self.claimants[name]
        return c.awake or (c.transient and c.in_use > 0)

    def held(self, *, physical: bool = False, after_release: bool = False) -> int:
        """Bytes counted against the budget (see [Note: dock accounting])."""
        return held(self.sets.values(), self.claimants.values(), physical=physical, after_release=after_release)

    # decisions ------------------------------------------------------------------
    def _victims(self, names: tuple[str, ...], *, base: int, ahead: bool) -> list[str] | None:
        """What must leave for ``names`` to be resident together (``None``: cannot be done).

        ``ahead`` (a prefetch): plan as if the uses now open were left, and
        let sets in use be candidates (the caller acts only if none is chosen).
        """
        incoming = sum(self.incoming(n) for n in names if not self.resident(n))
        need = self.held(after_release=ahead) + incoming - self.budget
        if need <= 0:
            return []
        candidates = []
        for n, item in (*self.sets.items(), *self.claimants.items()):
            if n in names or not self.resident(n) or (item.in_use and not ahead):
                continue
            if isinstance(item, _Claimant) and not item.movable:
                continue  # a byte count's bytes are freed by its user, reserved ones never
            candidates.append(n)
        freed = self.freed(candidates)
        candidates = [n for n in candidates if freed[n] > 0]  # an eviction that frees nothing is no victim
        if sum(freed[n] for n in candidates) < need:
            return None
        busy = {n for n in candidates if self.item(n).in_use}
        if self.schedule is None:
            return lru(candidates, need, busy, self.item, freed.__getitem__)
        return belady(self.schedule, candidates, need, base, busy, self.sets, freed.__getitem__)

    def incoming(self, name: str) -> int:
        """Bytes bringing ``name`` in adds on the device: a set's less the storages its offload kept there
        (they count already: [Note: kept storages count once] in ``measure``), a claimant's bytes."""
        s = self.sets.get(name)
        return self.claimants[name].nbytes if s is None else s.nbytes - kept_bytes(s.ferry)

    def freed(self, names: Iterable[str]) -> dict[str, int]:
        """Bytes the eviction of each resident set, or the sleep of each claimant, in ``names`` would free
        now: a set's counted bytes less the storages its offload would keep ([Note: an eviction frees what
        it releases] in ``measure``)."""
        sets = self.sets.values()
        now = held(sets, ())
        return {n: (now - held(sets, (), evicting={n: eviction_keeps(self.sets[n].ferry)}) if n in self.sets
                    else self.claimants[n].nbytes) for n in names}

    def _no_room(self, names: tuple[str, ...]) -> str:
        want = ", ".join(f"{n!r} ({_fmt(self.nbytes(n))})" for n in names if not self.resident(n))
        held_ = [(n, self.nbytes(n)) for n in sorted(self.in_use) if self.resident(n) and n not in names]
        holders = ", ".join(f"{n!r} {_fmt(b)}" for n, b in held_) or "nothing"
        idle = [n for n, s in self.sets.items() if n not in names and not s.in_use and self.resident(n)]
        kept = [(n, self.nbytes(n) - f) for n, f in self.freed(idle).items() if f < self.nbytes(n)]
        stuck = ("; an eviction would leave on the device " + ", ".join(f"{n!r} {_fmt(b)}" for n, b in kept)
                 + " (a tensor torchferry does not manage shares those storages: drop it to free them)") if kept else ""
        return (
            f"torchferry: Dock.use: cannot make room for {want} within the budget of {_fmt(self.budget)}: "
            f"{_fmt(self.held())} is held, and what is in use cannot be evicted ({holders}){stuck}; "
            "leave those use() blocks first, or raise budget_bytes. Nothing was moved"
        )

    def acquire(self, names: tuple[str, ...]) -> None:
        """``Dock.acquire`` of checked names: measures, chooses the victims, moves, marks the names in use.

        Raises:
            ValueError: the names need more than the budget together now (nothing moved).
            RuntimeError: the room is held by what is in use (nothing moved).
        """
        self.refresh()
        total, fixed = sum(self.nbytes(n) for n in names), self.reserved(names)
        if total + fixed > self.budget:
            each = ", ".join(f"{n!r} {self.nbytes(n)} bytes{self._grown(n)}" for n in names)
            beside = f" beside {_fmt(fixed)} reserved" if fixed else ""
            raise OverBudget(
                f"torchferry: Dock.use: {list(names)} need {_fmt(total)} together{beside} but the budget is "
                f"{_fmt(self.budget)} ({each}): use them in separate phases or raise budget_bytes; nothing was moved"
            )
        self._poll()
        pos = self.schedule.match(frozenset(names), self.pos) if self.schedule is not None else None
        base = self.pos if pos is None else pos
        victims = self._victims(names, base=base, ahead=False)
        if victims is None:
            raise NoRoom(self._no_room(names))
        with torch.profiler.record_function("torchferry::dock.use"):
            hits = [n for n in names if self.resident(n)]
            prefetched = [n for n in names if n in self.sets and self.sets[n].prefetched]
            self._pending = [n for n in self._pending if n not in names]
            self._bring_in(names, victims, background=False)
            for n in names:
                if n in self.sets:
                    s = self.sets[n]
                    self.mover.hand_off(s)
                    s.prefetched = False
        self._tick += 1
        for n in names:
            item = self.item(n)
            item.in_use += 1
            item.last_used = self._tick
        if pos is not None:
            self.pos = pos
        self.mover.counts.update(uses=1, hits=len(hits), prefetch_hits=len(prefetched))

    def release(self, names: tuple[str, ...]) -> None:
        """``Dock.release`` of checked names in use: idle again; back within the budget if state grew."""
        for n in names:
            self.item(n).in_use -= 1
        self.refresh()
        self._restore()
        self._poll()

    def prefetch(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """``Dock.prefetch`` of checked names (see [Note: prefetch]); returns those started or resident."""
        self.refresh()
        self._poll()
        started = []
        with torch.profiler.record_function("torchferry::dock.prefetch"):
            for n in names:
                if self._prefetch_one(n):
                    started.append(n)
        return tuple(started)

    def next_phase(self) -> tuple[str, ...]:
        """The registered names of the schedule's phase after the one last used, in registration order."""
        assert self.schedule is not None
        phase = self.schedule.phases[(self.pos + 1) % len(self.schedule.phases)]
        return tuple(n for n in (*self.sets, *self.claimants) if n in phase)

    def evict(self, names: tuple[str, ...]) -> None:
        """Evicts the checked idle sets and puts the claimants to sleep now (no-ops for what is out)."""
        self._pending = [n for n in self._pending if n not in names]
        self.check_open(n for n in names if n in self.sets and self.resident(n))
        for n in names:
            if n in self.sets and self.resident(n):
                self.mover.evict(self.sets[n], background=False)
            elif n in self.claimants and self.claimants[n].awake and self.claimants[n].movable:
                self.mover.sleep(self.claimants[n], background=False)

    def wait(self) -> None:
        """Waits for every move issued so far and hands prefetched sets to the current stream."""
        for s in self.sets.values():
            if s.handle is not None:
                s.handle.wait()
            self.mover.hand_off(s)
        self.mover.prune_leaving()

    def _bring_in(self, names: tuple[str, ...], victims: list[str], *, background: bool) -> None:
        """Evicts ``victims`` and brings ``names`` in (see [Note: dock accounting])."""
        self.check_open((*victims, *(n for n in names if not self.resident(n))))
        loads = [self.sets[n] for n in names if n in self.sets and not self.resident(n)]
        wakes = [self.claimants[n] for n in names
                 if n in self.claimants and not self.claimants[n].transient and not self.claimants[n].awake]
        out_sets = [self.sets[v] for v in victims if v in self.sets]
        for v in victims:
            if v in self.claimants:
                self.mover.sleep(self.claimants[v], background=background)
        if len(out_sets) == 1 and loads and not background and not self.mover.fits_now(self.incoming(loads[0].name)):
            self.mover.swap(out_sets.pop(), loads.pop(0))
        for s in out_sets:
            self.mover.evict(s, background=background)
        for s in loads:
            self.mover.wait_room(self.incoming(s.name))
            self.mover.load(s, background=background)
        for c in wakes:
            self.mover.wake(c)
        if not background:  # the caller allocates a byte-count claimant's bytes as soon as use() returns
            self.mover.wait_room(sum(self.claimants[n].nbytes for n in names if n in self.claimants
                                     and self.claimants[n].transient and not self.claimants[n].in_use))

    def _prefetch_one(self, name: str) -> bool:
        if name in self._pending:
            self._pending.remove(name)
        if self.resident(name):
            return True
        victims = self._victims((name,), base=self.pos, ahead=True)
        if victims is None or any(self.item(v).in_use for v in victims):
            return False
        self.check_open((*victims, name))
        s = self.sets.get(name)
        for v in victims:
            if v in self.claimants:
                self.mover.sleep(self.claimants[v], background=True)
            else:
                self.mover.evict(self.sets[v], background=True)
        if s is not None:
            if self.mover.fits_now(self.incoming(name)):
                self.mover.load(s, background=True)
            else:
                self._pending.append(name)  # loads when its room is free (see _poll)
        return True

    def _poll(self) -> None:
        """Starts prefetch loads whose room has become free (see [Note: prefetch])."""
        if not self._pending:
            return
        self.mover.prune_leaving()
        still = []
        for n in self._pending:
            s = self.sets[n]
            if self.resident(n):
                continue
            if self.held() + self.incoming(n) > self.budget:
                continue  # the room went elsewhere: use() will bring it in
            if self.mover.fits_now(self.incoming(n)):
                self.mover.load(s, background=True)
            else:
                still.append(n)
        self._pending = still

    def _restore(self) -> None:
        """Brings the dock back within the budget after state grew in a use (see [Note: dock accounting]).

        The idle sets leave and the idle claimants sleep as far as the budget
        needs, chosen as for a ``use()``; all idle ones if even that is not
        enough (what is in use then holds the rest).
        """
        need = self.held() - self.budget
        if need <= 0:
            return
        victims = self._victims((), base=self.pos, ahead=False)
        if victims is None:  # what is in use holds more than the budget: free what is idle (and frees something)
            idle = [n for n, item in (*self.sets.items(), *self.claimants.items())
                    if self.resident(n) and not item.in_use and not (isinstance(item, _Claimant) and not item.movable)]
            victims = [n for n, f in self.freed(idle).items() if f > 0]
        logger.debug("dock: %d bytes over the budget after a use (state grew); evicting %s", need, victims)
        self.check_open(victims)
        for v in victims:
            if v in self.claimants:
                self.mover.sleep(self.claimants[v], background=False)
            else:
                self.mover.evict(self.sets[v], background=False)
