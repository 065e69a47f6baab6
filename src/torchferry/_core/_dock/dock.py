"""The public :class:`Dock`: registration, phases (``use``/``acquire``/``release``), prefetch, eviction,
introspection. It checks the arguments and words the errors; its :class:`~.engine.DockEngine` (``_engine``) keeps
the state, does the accounting, decides the victims and moves the sets."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from .._api.args import check_callable, check_device, shown
from .._ferry.ferry import Ferry
from .._ferry.misuse import NotCopyable
from .admit import check_new_set
from .engine import DockEngine
from .records import DockStats, Move, OverBudget, _fmt
from .schedule import Schedule
from .serial import serialized
from .._transfer.signals import deferred

__all__ = ["Dock"]


class Dock(NotCopyable):
    """State sets and claimants of GPU memory under one GPU budget (see the module docstring).

    A ferry belongs to one dock at a time ([Note: one dock per ferry]).
    Its calls may come from several threads: they run one at a time ([Note: one thread drives a dock] in ``serial``).
    """

    def __init__(self, budget_bytes: int, *, device: torch.device | str | None = None) -> None:
        """A dock with nothing in it yet.

        Args:
            budget_bytes: bytes that the resident state sets (their storages as they are now, grown state
                included), the awake claimants and the byte-count claimants in use may hold together on the
                device (see [Note: dock accounting]).
            device: the device of the state sets; default the first added ferry's.

        Raises:
            ValueError: ``budget_bytes`` not a positive int, ``device`` a string or index ``torch.device``
                does not accept, or a CUDA device where CUDA is not available.
            TypeError: ``device`` not a ``torch.device``, str, int or ``None``.
        """
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"torchferry: Dock: budget_bytes must be an int > 0 (bytes), got {budget_bytes!r}")
        dev = check_device(device, "Dock(device=...)")
        if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():  # as Ferry(device=...) does
            raise ValueError(f"torchferry: Dock: device {dev} was asked for, but CUDA is not available")
        self._engine = DockEngine(budget_bytes, dev, owner=self)

    def _check_open(self, call: str) -> None:
        """Refuses ``call`` on a closed dock: its names are gone, so "unknown names" would blame the caller's."""
        if self._engine.closed:
            raise RuntimeError(f"torchferry: {call}: this dock is closed; make a new Dock")

    def _check_new_name(self, name: str) -> None:
        e = self._engine
        self._check_open("Dock")
        if not isinstance(name, str) or not name:
            raise ValueError(f"torchferry: Dock: a name must be a non-empty str, got {name!r}")
        if name in e.sets or name in e.claimants:
            raise ValueError(f"torchferry: Dock: the name {name!r} is already registered")

    def _check_names(self, names: tuple[str, ...], what: str) -> tuple[str, ...]:
        odd = [n for n in names if not isinstance(n, str)]
        if odd:  # dock.use(["a", "b"]) gave "unhashable type: 'list'"
            raise TypeError(f"torchferry: Dock.{what}() takes names as separate str arguments "
                            f"(dock.{what}('a', 'b')), got {shown(odd[0])}")
        if not names:
            raise ValueError(f"torchferry: Dock.{what}: give at least one name")
        e = self._engine
        self._check_open(f"Dock.{what}")
        unknown = [n for n in names if n not in e.sets and n not in e.claimants]
        if unknown:
            raise ValueError(f"torchferry: Dock.{what}: unknown names {unknown}; registered: "
                             f"{sorted((*e.sets, *e.claimants))}")
        if len(set(names)) != len(names):
            raise ValueError(f"torchferry: Dock.{what}: a name is repeated in {list(names)}")
        return names

    # ---------------------------------------------------------------- registration
    def add(self, name: str, ferry: Ferry) -> None:
        """Registers a state set: the ferry's state, counted in bytes as it is at each decision.

        The set stays where it is (resident or offloaded). A resident set
        counts the storages it holds on the device now, state grown since the
        ferry's last plan included (``.grad``s kept, a resized embedding, an
        optimizer's first step: [Note: a set counts its bytes now]); an evicted
        one its ``ferry.state_bytes``. The ferry of an optimizer may be made
        before its first step (give it ``device=`` on a GPU): its state counts
        from the ``release()`` after that step. A resident ferry that has no
        plan yet is planned here (``ferry.reserve_host(background=True)``), so
        that FSDP2's sharded storages of a unit left unsharded count too.

        Raises:
            ValueError: a name already registered, a ferry already added, a
                ferry on another device than the dock's, a set sharing a tensor
                object with a set already added, or a set larger than the budget
                (it could never be resident).
            TypeError: ``ferry`` is not a :class:`~torchferry.Ferry`.
            HostBudgetError: the node cannot hold the host pool its first eviction needs (a resident ferry
                without a plan is planned here).
            RuntimeError: another dock that is still alive holds the ferry
                (:meth:`remove` it there or :meth:`close` that dock first), or
                this dock is closed. Nothing changes in either dock.
        """
        self._check_new_name(name)
        if not isinstance(ferry, Ferry):
            raise TypeError(f"torchferry: Dock.add: {name!r} must be a torchferry.Ferry, got {type(ferry).__name__}")
        check_new_set(self._engine, name, ferry)
        self._engine.add_set(name, ferry)  # after the checks: a refused ferry is left as it was

    def remove(self, name: str) -> None:
        """Forgets a state set or claimant; its ferry may then join another dock.

        The set stays where it is (resident or offloaded: its moves are waited
        for first), a claimant as it is (awake or asleep: its bytes no longer
        count). A schedule that names it keeps it (declare a new one with
        :meth:`plan`).

        Raises:
            ValueError: an unknown name.
            RuntimeError: the name is in use.
        """
        self._check_names((name,), "remove")
        if self._engine.item(name).in_use:
            raise RuntimeError(f"torchferry: Dock.remove: {name!r} is in use; leave its use() block first")
        self._engine.drop(name)

    def close(self) -> None:
        """Forgets every set and claimant (as :meth:`remove`) and refuses new ones; idempotent.

        The sets stay where they are; their ferries may join another dock.
        Dropping a dock (garbage collection) lets its ferries go as well.

        Raises:
            RuntimeError: a name is in use (nothing is forgotten then).
        """
        busy = sorted(self.in_use)
        if busy:
            raise RuntimeError(f"torchferry: Dock.close: {busy} in use; leave their use() blocks first")
        self._engine.close()

    def add_claimant(self, name: str, nbytes: int, *, sleep: Callable[[], object] | None = None,
                     wake: Callable[[], object] | None = None, empty_cache: bool = False) -> None:
        """Registers a claimant of GPU memory that is not a state set.

        With ``sleep`` and ``wake`` (a rollout engine): ``use(name)`` makes
        room for ``nbytes`` and calls ``wake()`` if it sleeps; after the use
        it stays awake, holding its bytes, until the dock needs the room and
        calls ``sleep()`` (or :meth:`evict`). It starts asleep. Without them
        (a byte count: a KV cache the caller allocates, a phase's workspace):
        ``use(name)`` makes room for ``nbytes`` and they count while the use
        lasts; the caller frees the memory by the end of the use.

        Args:
            name: a new name.
            nbytes: bytes the claimant holds while awake or in use.
            sleep: releases the claimant's device memory (synchronously).
            wake: allocates it again.
            empty_cache: call ``torch.cuda.empty_cache()`` before ``wake()``:
                set it when the claimant allocates outside PyTorch's caching
                allocator (vLLM's sleep mode does), which cannot use blocks
                PyTorch keeps cached.

        Raises:
            ValueError: a name already registered, ``nbytes`` negative, not an
                int or larger than the budget, or only one of ``sleep``/``wake``.
            TypeError: ``sleep`` or ``wake`` given but not callable.
        """
        for what, fn in (("sleep", sleep), ("wake", wake)):
            if fn is not None:
                check_callable(fn, f"Dock.add_claimant({what}=...)")
        self._check_new_name(name)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"torchferry: Dock.add_claimant: nbytes of {name!r} must be an int >= 0, got {nbytes!r}")
        budget = self._engine.budget
        if nbytes > budget:
            raise OverBudget(
                f"torchferry: Dock.add_claimant: claimant {name!r} needs {_fmt(nbytes)} but the budget is "
                f"{_fmt(budget)}; it could never fit: raise budget_bytes or shrink it (e.g. the KV cache)"
            )
        if (sleep is None) != (wake is None):
            raise ValueError(f"torchferry: Dock.add_claimant: give {name!r} both sleep and wake, or neither")
        self._engine.add_claimant(name, nbytes, sleep, wake, empty_cache)

    def has(self, name: str) -> bool:
        """Whether ``name`` is registered (a state set, claimant or reserved bytes)."""
        return name in self._engine.sets or name in self._engine.claimants

    def resize(self, name: str, nbytes: int) -> None:
        """A claimant's new byte count (a phase's workspace measured again), counted from its next use.

        Raises:
            ValueError: ``name`` is not a claimant (a set, reserved bytes, unknown), or ``nbytes`` is not an
                int in [0, the budget].
            RuntimeError: the claimant is in use or awake (its old bytes are held now), or this dock is closed.
        """
        self._check_open("Dock.resize")
        c = self._engine.claimants.get(name)
        if c is None or c.fixed:
            raise ValueError(f"torchferry: Dock.resize: {name!r} is not a claimant")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= self._engine.budget:
            raise ValueError(f"torchferry: Dock.resize: {name!r} needs an int of bytes in [0, the budget "
                             f"{self._engine.budget}], got {nbytes!r}")
        if c.in_use or c.awake:
            raise RuntimeError(f"torchferry: Dock.resize: {name!r} holds its bytes now (in use or awake)")
        c.nbytes = nbytes

    def reserve(self, name: str, nbytes: int) -> None:
        """Counts ``nbytes`` that stay on the device beside the sets: state the dock never moves (a model a
        framework keeps resident). Counted at every decision, never evicted, as an awake claimant; called
        again, the new size: if the dock then holds more than the budget, idle sets leave and idle claimants
        sleep as at a ``release()``. :meth:`remove` forgets it.

        Raises:
            ValueError: ``nbytes`` not an int >= 0 or above the budget, or ``name`` a state set or claimant.
            RuntimeError: this dock is closed.
        """
        e = self._engine
        c = e.claimants.get(name)
        if c is None or not c.fixed:
            self._check_new_name(name)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= e.budget:
            raise ValueError(f"torchferry: Dock.reserve: {name!r} needs an int of bytes in [0, the budget "
                             f"{e.budget}], got {nbytes!r}")
        e.reserve(name, nbytes)

    def plan(self, schedule: Sequence[str | Iterable[str]] | Schedule | None) -> None:
        """Declares the step's phases, so that eviction looks ahead (see [Note: choosing victims]).

        Args:
            schedule: a :class:`Schedule`, or its phases (each a name or names);
                ``None``: back to least recently used.

        Raises:
            ValueError: a name not registered, or a malformed schedule.
            TypeError: ``schedule`` is not a :class:`Schedule`, an iterable of phases or ``None``.
            RuntimeError: a schedule given to a closed dock.
        """
        if not (schedule is None or isinstance(schedule, (Schedule, Iterable))):
            raise TypeError(f"torchferry: Dock.plan() takes a Schedule, a list of phases (each a name or "
                            f"names) or None, got {shown(schedule)}")
        if schedule is None:
            self._engine.plan(None)
            return
        sched = schedule if isinstance(schedule, Schedule) else Schedule.of(schedule)
        self._check_open("Dock.plan")
        unknown = sorted(sched.names - self._engine.sets.keys() - self._engine.claimants.keys())
        if unknown:
            raise ValueError(f"torchferry: Dock.plan: unknown names {unknown}; add() or add_claimant() them first")
        self._engine.plan(sched)

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def use(self, *names: str) -> Iterator[None]:
        """Makes the named state sets resident and the named claimants awake for the block.

        Idle sets and claimants leave only as far as the budget needs (see [Note: choosing victims]); with one
        set out and one in, both move at once on the two copy engines (:func:`torchferry.swap`). A set loaded
        here is ready for the current stream (no host sync); one a ``prefetch()`` loaded is waited for only for
        what is left. After the block everything stays where it is until the room is needed.

        The sets are counted as they are now (see [Note: a set counts its bytes now]); state that grows in the
        block is seen at its end: if the dock then holds more than the budget, idle sets leave and idle
        claimants sleep until it is within the budget again. A signal during the entry is raised once the
        names are released again.

        Raises:
            ValueError: an unknown or repeated name, or names that together
                need more than the budget now (the message names each one's
                bytes and which grew while resident; nothing is moved).
            RuntimeError: the room cannot be made because the sets holding it
                are in use (nothing is moved then).
        """
        acquired = False
        try:
            with deferred():  # a signal held during acquire() is raised here, inside the try: the names go back
                self.acquire(*names)
                acquired = True
            yield
        finally:
            if acquired:
                self.release(*names)

    def acquire(self, *names: str) -> None:
        """``use()``'s entry, for frameworks whose load and offload calls are apart (see ``docs/dock.md``).

        Pair every call with :meth:`release` of the same names.
        """
        self._engine.acquire(self._check_names(names, "use"))

    def release(self, *names: str) -> None:
        """``use()``'s exit: the names are idle again (and stay resident: eviction is lazy).

        The sets are measured again: if state grew while in use (gradients
        kept, an optimizer's first step, a parameter replaced by a larger one)
        and the dock now holds more than the budget, idle sets leave and idle
        claimants sleep as far as the budget needs (chosen as for a ``use()``;
        see [Note: dock accounting]).

        Raises:
            ValueError: an unknown or repeated name.
            RuntimeError: a name that is not in use.
        """
        names = self._check_names(names, "release")
        for n in names:
            if self._engine.item(n).in_use <= 0:
                raise RuntimeError(f"torchferry: Dock.release: {n!r} is not in use (release() without acquire())")
        self._engine.release(names)

    def prefetch(self, *names: str) -> tuple[str, ...]:
        """Starts bringing the named sets in while the current phase computes, as far as the budget allows.

        For each name (in order), the victims ``use(name)`` would need once
        the sets now in use are released are evicted at once if none of them
        is in use; a state set then starts loading in the background as soon
        as its room is free (on a GPU, on the dock's stream, so the current
        phase's kernels do not wait for it, see [Note: prefetch hand-off]);
        a claimant only gets its room (``wake()`` runs in ``use()``). Names
        whose victims are in use are left to ``use()``. On the CPU the moves
        are synchronous.

        Returns:
            The names for which something was started (or already resident).

        Raises:
            ValueError: an unknown or repeated name.
        """
        return self._engine.prefetch(self._check_names(names, "prefetch"))

    def prefetch_next(self) -> tuple[str, ...]:
        """``prefetch()`` of the schedule's next phase (after the one last used).

        Raises:
            RuntimeError: no schedule was declared (:meth:`plan`).
        """
        if self._engine.schedule is None:
            raise RuntimeError("torchferry: Dock.prefetch_next: no schedule; declare one with dock.plan([...])")
        ordered = self._engine.next_phase()
        return self.prefetch(*ordered) if ordered else ()  # the phase names only removed sets

    def evict(self, *names: str) -> None:
        """Evicts the named sets (offload) and puts the named claimants to sleep now; no names: all idle ones.

        Offloads are asynchronous (see :meth:`wait`); already evicted names
        and byte-count claimants are no-ops.

        Raises:
            ValueError: an unknown or repeated name.
            RuntimeError: a name in use.
        """
        e = self._engine
        if names:
            names = self._check_names(names, "evict")
            busy = [n for n in names if e.item(n).in_use]
            if busy:
                raise RuntimeError(f"torchferry: Dock.evict: {busy} in use; leave their use() blocks first")
        else:
            names = tuple(n for n, item in (*e.sets.items(), *e.claimants.items()) if not item.in_use)
        e.evict(names)

    def wait(self) -> None:
        """Blocks until every move issued so far has finished, and hands prefetched sets to the current stream."""
        self._engine.wait()

    def require(self, *names: str) -> None:
        """Checks that the named sets are resident (claimants: awake or in use) before touching them.

        A prefetched set is handed to the current stream (it waits for the copies).

        Raises:
            ValueError: an unknown or repeated name.
            RuntimeError: a name that is evicted (or asleep), naming what to do.
        """
        e = self._engine
        for n in self._check_names(names, "require"):
            s = e.sets.get(n)
            if not e.resident(n):
                if s is not None:
                    e.measure(s)
                kind = "state set" if s is not None else "claimant"
                where = "evicted to the host" if s is not None else "asleep"
                raise RuntimeError(
                    f"torchferry: Dock: {kind} {n!r} ({_fmt(e.nbytes(n))}) is {where}; "
                    f"enter `with dock.use({n!r}):` (or dock.acquire) before touching it"
                )
            if s is not None:
                e.mover.hand_off(s)

    # ------------------------------------------------------------- introspection
    @property
    def budget_bytes(self) -> int:
        """The budget, bytes."""
        return self._engine.budget

    @property
    def device(self) -> torch.device | None:
        """The state sets' device (``None`` before the first set)."""
        return self._engine.device

    @property
    def schedule(self) -> Schedule | None:
        """The declared schedule, or ``None`` (least recently used)."""
        return self._engine.schedule

    def ferry(self, name: str) -> Ferry:
        """The ferry of state set ``name``.

        Raises:
            ValueError: not a registered state set.
        """
        sets = self._engine.sets
        if name not in sets:
            raise ValueError(f"torchferry: Dock: no state set named {name!r}; sets: {sorted(sets)}")
        return sets[name].ferry

    def nbytes(self, name: str) -> int:
        """Bytes the dock counts for ``name`` now: a resident set's storages on the device as they are
        now, an evicted set's ``state_bytes``, a claimant's bytes (see [Note: a set counts its bytes now])."""
        self._check_names((name,), "nbytes")
        s = self._engine.sets.get(name)
        if s is not None:
            self._engine.measure(s)
        return self._engine.nbytes(name)

    def is_resident(self, name: str) -> bool:
        """Whether a set is on the device (loading counts), or a claimant awake or in use."""
        self._check_names((name,), "is_resident")
        return self._engine.resident(name)

    @property
    def resident_bytes(self) -> int:
        """Bytes counted against the budget now, sets measured as they are now (outgoing sets not
        counted, see [Note: dock accounting]; state loaded behind the dock's back counted where it is). A
        reading: it moves nothing."""
        self._engine.refresh(adopt=False)
        return self._engine.held() + self._engine.appeared()

    @property
    def free_bytes(self) -> int:
        """``budget_bytes - resident_bytes``, bytes (negative if sets were resident beyond it when added,
        or grew beyond it in a use that is still open)."""
        return self._engine.budget - self.resident_bytes

    @property
    def in_use(self) -> frozenset[str]:
        """Names held by a ``use()`` now."""
        return self._engine.in_use

    @property
    def stats(self) -> DockStats:
        """Counts of what the dock has done (see :class:`DockStats`)."""
        counts = self._engine.mover.counts
        return DockStats(**{f.name: counts[f.name] for f in dataclasses.fields(DockStats)})

    @property
    def moves(self) -> tuple[Move, ...]:
        """The last moves (up to 4096), oldest first."""
        return tuple(self._engine.mover.moves)

    def __repr__(self) -> str:
        e = self._engine
        return (f"Dock(budget_bytes={e.budget}, resident_bytes={self.resident_bytes}, sets={list(e.sets)}, "
                f"claimants={list(e.claimants)}, in_use={sorted(self.in_use)})")


for _call in ("add", "remove", "close", "add_claimant", "resize", "reserve", "plan", "acquire", "release",
              "prefetch", "prefetch_next", "evict", "wait", "require", "nbytes", "is_resident", "__repr__"):
    setattr(Dock, _call, serialized(f"Dock.{_call}()", getattr(Dock, _call)))  # [Note: one thread drives a dock]
for _prop in ("resident_bytes", "in_use"):
    _get = getattr(Dock, _prop).fget
    setattr(Dock, _prop, property(serialized(f"Dock.{_prop}", _get), doc=_get.__doc__))
