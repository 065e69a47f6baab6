"""A trainer's phases under one :class:`Dock`: framework-neutral (verl's dock mode is a thin adapter over it).

[Note: a trainer under a phase dock]
A colocated trainer runs its engines' phases (a model's forward-only "eval", its "train" with the
optimizer) between the rollout's wakes. A :class:`PhaseDock` turns each phase into dock names:

* each engine (any object the trainer names it by, weakly kept) has a state set for its parameters
  (``engine<N>.params``) and one for its optimizer state (``engine<N>.optimizer``, once it has state),
  given as ferries by the caller; what the trainer keeps on the device of it (``kept``: objects whose
  device bytes are measured) is reserved as ``engine<N>.resident`` (``Dock.reserve``): counted at every
  decision, never evicted, measured again at each phase entry and exit and at each wake;
* entering a phase acquires its sets and a byte-count claimant ``engine<N>.workspace.<mode>`` for what
  the phase allocates besides them (activations, gradients, temporaries); leaving releases them (they
  stay resident until the room is needed: [Note: choosing victims] in ``dock``);
* the workspace is measured: its first phase of each mode counts the whole rest of the budget, then
  the peak the phase allocated above what it held at its start (``torch.cuda.max_memory_allocated``,
  reset at each entry) less what the sets grew by in it (the first step's optimizer state), plus
  :data:`WORKSPACE_MARGIN`, the largest seen so far;
* an optimizer without state entering a train phase is checked first: its first step's state
  ([Note: first-step state] in ``first_step``) must fit beside what the phase holds;
* claimants woken by :meth:`PhaseDock.wake` (a rollout's weights and KV cache) make room before the
  rollout maps its memory and count until :meth:`PhaseDock.asleep` or the next phase entry (a driver
  that slept the rollout where this process cannot see it);
* the step's order of phases is learnt ([Note: a step's phases learnt] in ``phases``): once planned,
  victims are chosen by when they are needed next and each phase starts bringing in the next.

The caller says what its framework means (which ferry is a set, what stays resident); the phase dock
asks the :class:`Dock` (``has``, ``nbytes``, ``resize``) rather than catching its errors. A phase whose
sets and workspace exceed the budget raises ``ValueError`` before the trainer's code runs.
``tests/cpu/test_integration_verl_dock.py`` (verl) and ``tests/cpu/test_integration_skyrl.py`` (SkyRL's
helpers) run it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._ferry.ferry import Ferry
from .._transfer.signals import deferred
from .dock import Dock
from .first_step import first_step_bytes
from .measure import objects_bytes, targets_of
from .phases import PhaseOrder
from .records import NoRoom, OverBudget

__all__ = ["WORKSPACE_MARGIN", "EngineNames", "PhaseDock"]

WORKSPACE_MARGIN = 0.10  # a phase's workspace claimant: its largest measured peak plus this fraction
MIN_BUDGET_BYTES = 1 << 20


class EngineNames:
    """One engine's names in the dock, and what its phases measured."""

    def __init__(self, index: int) -> None:
        self.tag = tag = f"engine{index}"
        self.params, self.optimizer = f"{tag}.params", f"{tag}.optimizer"
        self.resident = f"{tag}.resident"  # what the trainer keeps on the device of it
        self.workspace = {"eval": f"{tag}.workspace.eval", "train": f"{tag}.workspace.train"}
        self.measured: dict[str, int] = {}  # mode -> largest workspace seen, bytes
        self.open: dict[str, Any] = {}  # while in a phase: the names held, the start
        self.depth: dict[str, int] = {}  # mode -> contexts of it entered inside the open one
        self.kept: tuple[object, ...] = ()  # what the trainer keeps on the device (measured at each decision)
        self.kept_why = ""  # why, for messages

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the engine may hold in the dock."""
        return (self.params, self.optimizer, self.resident, *self.workspace.values())


class PhaseDock:
    """A trainer's engines, phases and rollout claimants under one :class:`Dock` ([Note: a trainer under a
    phase dock]).

    Args:
        budget: bytes, or a fraction in (0, 1] of the device's memory (resolved at the first phase).
        label: how messages name it (``"verl dock"``).
        hint: where the budget comes from, for messages (``"TORCHFERRY_VERL_DOCK / patch(dock=...)"``).
    """

    def __init__(self, budget: int | float, *, label: str = "phase dock", hint: str = "its budget") -> None:
        self.budget, self.label, self.hint = budget, label, hint
        self.dock: Dock | None = None
        self.engines: weakref.WeakKeyDictionary[Any, EngineNames] = weakref.WeakKeyDictionary()
        self.awake: set[str] = set()  # claimants woken since the last phase entry
        self.order = PhaseOrder()  # the step's phases, learnt: [Note: a step's phases learnt]
        self.phase_log: deque[tuple[str, tuple[str, ...]]] = deque(maxlen=256)  # (event, names), the latest
        self.peak_seen = 0  # torch.cuda.max_memory_allocated before each reset of it, bytes (take_peak)
        self._next_index = 0  # engine<N>: never reused, also after an engine is collected
        self.sets: dict[str, Ferry] = {}  # the state sets registered in the dock: name -> its ferry

    # --------------------------------------------------------------- the dock and its names
    def dock_on(self, device: torch.device) -> Dock:
        """The dock, made on ``device`` at the first call.

        Raises:
            ValueError: a fractional budget without a GPU, or one that comes to less than 1 MiB.
        """
        if self.dock is None:
            budget = self.budget
            if isinstance(budget, float):
                if device.type != "cuda":
                    raise ValueError(f"torchferry: {self.label}: a fractional budget ({budget}) needs a GPU; "
                                     f"give bytes on {device}")
                total = torch.cuda.get_device_properties(device).total_memory
                budget = int(budget * total)
                if budget < MIN_BUDGET_BYTES:
                    raise ValueError(f"torchferry: {self.label}: the budget {self.budget} of {device}'s {total} "
                                     f"bytes is {budget} bytes: give a larger fraction or bytes")
            self.dock = Dock(budget, device=device)
        return self.dock

    @property
    def planned(self) -> bool:
        """Whether the dock was planned with the step's learnt order."""
        return self.order.planned

    @property
    def cycle(self) -> list[frozenset[str]]:
        """The phases learnt so far (each the names it holds)."""
        return self.order.cycle

    def holds(self, ferry: Ferry) -> bool:
        """Whether ``ferry`` is one of the dock's sets."""
        return self._name_of(ferry) is not None

    def _name_of(self, ferry: Ferry) -> str | None:
        return next((n for n, f in self.sets.items() if f is ferry), None)

    def forget(self, ferry: Ferry) -> None:
        """Drops ``ferry``'s set (it stays where it is), for another dock to take it.

        Raises:
            RuntimeError: a phase of this dock holds it.
        """
        name = self._name_of(ferry)
        if name is not None and self.dock is not None:
            self.dock.remove(name)
            del self.sets[name]
            self.order.added(self.dock)

    @property
    def reserved(self) -> set[str]:
        """The engines' ``engine<N>.resident`` names registered in the dock."""
        d = self.dock
        return set() if d is None else {e.resident for e in list(self.engines.values()) if d.has(e.resident)}

    def load(self, ferry: Ferry, who: str = "a load") -> None:
        """A load of a docked set outside a phase (a framework's load helper): resident when it returns (it stays,
        lazily)."""
        name = self._name_of(ferry)
        assert self.dock is not None and name is not None
        self._drop_dead(self.dock)
        with deferred():  # a signal held during the acquire is raised after the release
            try:
                if name in self.dock.in_use:
                    self.dock.require(name)
                    return
                self.dock.acquire(name)
            except (OverBudget, NoRoom) as err:
                raise type(err)(f"torchferry: {self.label}: {who} of {name} outside a phase does not fit the "
                                f"budget ({self.hint}): {err}") from err
            self.dock.release(name)

    # --------------------------------------------------------------------- phases
    def engine(self, key: Any) -> EngineNames:
        """``key``'s names, made at its first phase (they leave the dock when ``key`` is collected)."""
        e = self.engines.get(key)
        if e is None:
            e = self.engines[key] = EngineNames(self._next_index)
            self._next_index += 1
            weakref.finalize(key, self._forget_engine, e.names)
        return e

    def enter(self, key: Any, mode: str, *, device: torch.device, params: Ferry | None = None,
              optimizer: Ferry | None = None, first_step: torch.optim.Optimizer | None = None,
              kept: Sequence[object] = (), kept_why: str = "") -> None:
        """A phase's entry: what the trainer keeps resident measured, the sets and the workspace acquired.

        Args:
            key: the engine.
            mode: ``"eval"`` or ``"train"``.
            device: the engine's device.
            params, optimizer: the ferries this phase holds (``None``: not a set of this phase).
            first_step: an optimizer without state this train phase steps: its first step must fit.
            kept: what the trainer keeps on the device of this engine (reserved); ``kept_why`` says why.

        Raises:
            ValueError: the phase does not fit the budget (one line; nothing acquired).
        """
        e = self.engine(key)
        if mode in e.open:  # a context of the same mode inside the open one: nothing more to hold
            e.depth[mode] = e.depth.get(mode, 0) + 1
            return
        try:
            with deferred():  # a signal during the entry is raised once the phase is open: it closes again below
                self._open(e, mode, device, params, optimizer, first_step, kept, kept_why)
        except BaseException:
            if mode in e.open:  # opened by this call (an open one returned above)
                self.dock_on(device).release(*e.open.pop(mode)[0])
            raise

    def _open(self, e: EngineNames, mode: str, device: torch.device, params: Ferry | None,
              optimizer: Ferry | None, first_step: torch.optim.Optimizer | None, kept: Sequence[object],
              kept_why: str) -> None:
        e.kept, e.kept_why = tuple(kept), kept_why
        dock = self.dock_on(device)
        self.asleep()  # the driver slept the rollout before this phase
        self._drop_dead(dock)
        names: list[str] = []
        try:
            self._reserve(dock)
            for name, ferry in ((e.params, params), (e.optimizer, optimizer)):
                if ferry is not None:
                    names.append(self._ensure_set(dock, name, ferry))
            if first_step is not None:  # its first step makes the state: will it fit?
                self._check_first_step(dock, e, first_step, device, sum(dock.nbytes(n) for n in names))
            self._size_workspace(dock, e, mode, names)
            names.append(e.workspace[mode])
            dock.acquire(*names)
        except (OverBudget, NoRoom) as err:  # nothing acquired: the trainer's code has not run (others: as raised)
            raise type(err)(f"torchferry: {self.label}: the {mode} phase of {e.tag} does not fit its budget "
                            f"({self.hint}): {err}") from err
        try:
            self.order.record(dock, names)
            started = dock.prefetch_next() if self.planned else ()
        except BaseException:  # Ctrl-C or out of memory starting a prefetch: the phase does not open
            dock.release(*names)
            raise
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        e.open[mode] = (tuple(names), start, bool(started), self._state_bytes(dock, e, device), device)
        self.phase_log.append(("enter", tuple(names)))

    def leave(self, key: Any, mode: str, *, optimizer: Ferry | None = None,
              kept: Sequence[object] | None = None) -> None:
        """A phase's exit: the workspace measured, the sets released (they stay resident while the budget
        allows), the next phase's sets started.

        Args:
            optimizer: the optimizer's ferry if it now has state to move (its first step made it).
            kept: what the trainer keeps on the device now (``None``: as at the entry).

        Raises:
            ValueError: the optimizer state its first step made can never fit the budget (the phase's
                names are released first).
        """
        e = self.engines.get(key)
        if e is None or mode not in e.open or self.dock is None:
            return
        if e.depth.get(mode, 0):  # a nested context of the same mode: the outer one leaves
            e.depth[mode] -= 1
            return
        if kept is not None:
            e.kept = tuple(kept)
        dock = self.dock
        self._drop_dead(dock)
        names, start, prefetched, state0, device = e.open.pop(mode)
        # an optimizer this phase held and replaced: its set follows the new one once the phase's names are released
        late = optimizer is not None and e.optimizer in names and self.sets.get(e.optimizer) is not optimizer
        try:
            if optimizer is not None and not late:
                self._ensure_set(dock, e.optimizer, optimizer)
                if e.optimizer not in names:  # this phase holds it from now on
                    self.order.joins(e.optimizer)
            if device.type != "cuda":  # no device memory to share: nothing to measure
                e.measured.setdefault(mode, 0)
            elif not prefetched:  # a prefetch's allocations are not the phase's
                # the sets' own growth (AdamW's state made by the first step, gradients kept) is not workspace
                grown = max(0, self._state_bytes(dock, e, device) - state0)
                peak = torch.cuda.max_memory_allocated(device) - start - grown
                e.measured[mode] = max(e.measured.get(mode, 0), int(peak))
        except ValueError as err:  # a budget's refusal stays one (OverBudget)
            raise type(err)(f"torchferry: {self.label}: after the {mode} phase of {e.tag}: {err}") from err
        finally:
            dock.release(*names)
        if late and optimizer is not None:
            self._ensure_set(dock, e.optimizer, optimizer)
        self._reserve(dock)  # the first step's state of an optimizer kept resident, gradients kept
        self._size_workspace(dock, e, mode, [])  # measured now: what prefetches until its next entry plan with
        self.phase_log.append(("leave", names))
        if self.planned:
            dock.prefetch_next()

    def close_phases(self) -> None:
        """Releases every phase still open (the trainer's own code ends them)."""
        for e in list(self.engines.values()):
            for mode in list(e.open):
                names = e.open.pop(mode)[0]
                e.depth.pop(mode, None)
                if self.dock is not None:
                    self.dock.release(*names)

    def take_peak(self) -> int:
        """The device's peak allocated bytes since the last call (``torch.cuda.max_memory_allocated``,
        which each phase entry resets to measure the phase's workspace; 0 without a GPU dock)."""
        d = self.dock
        if d is None or d.device is None or d.device.type != "cuda":
            return 0
        peak, self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated(d.device)), 0
        return peak

    def _forget_engine(self, names: tuple[str, ...]) -> None:
        """An engine was garbage-collected: its sets and workspaces leave the dock (their ferries with them)."""
        d = self.dock
        for n in names:
            if d is not None and d.has(n) and n not in d.in_use:
                d.remove(n)
                self.sets.pop(n, None)
        self.order.removed(d, names)

    def _state_bytes(self, dock: Dock, e: EngineNames, device: torch.device) -> int:
        """Bytes the engine's registered sets count now, and what the trainer keeps of it on the device."""
        return (sum(dock.nbytes(n) for n in (e.params, e.optimizer) if n in self.sets)
                + (objects_bytes(e.kept, device) if e.kept else 0))

    def _reserved_bytes(self, dock: Dock) -> int:
        return sum(dock.nbytes(e.resident) for e in list(self.engines.values()) if dock.has(e.resident))

    def _reserve(self, dock: Dock) -> None:
        """What the trainer keeps on the device of every engine, measured now and reserved.

        Raises:
            ValueError: an engine keeps more than the budget (one line, naming why).
        """
        device = dock.device
        assert device is not None
        for e in list(self.engines.values()):
            nbytes = objects_bytes(e.kept, device) if e.kept else 0
            if nbytes > dock.budget_bytes:
                raise OverBudget(f"{e.tag} keeps {nbytes} bytes on the device ({e.kept_why or 'kept'}), more than "
                                 f"the budget of {dock.budget_bytes} bytes: raise it or turn that offload on")
            if nbytes or dock.has(e.resident):
                if not dock.has(e.resident):
                    self.order.added(dock)
                dock.reserve(e.resident, nbytes)

    def _check_first_step(self, dock: Dock, e: EngineNames, optimizer: torch.optim.Optimizer, device: torch.device,
                          held: int) -> None:
        """Refuses a first train phase whose optimizer state ([Note: first-step state] in ``first_step``) would
        not fit the budget beside ``held`` bytes and every reserved byte: better before the step than after it.
        An optimizer whose layout is not known is measured after its step instead."""
        made = first_step_bytes(optimizer, device)
        held += self._reserved_bytes(dock)
        if made is None or held + made <= dock.budget_bytes:
            return
        raise OverBudget(f"{e.optimizer} would hold about {made} bytes after the first step "
                         f"({type(optimizer).__name__}'s state as its first step makes it) beside {held} bytes held, "
                         f"more than the budget of {dock.budget_bytes} bytes; raise {self.hint}")

    def _ensure_set(self, dock: Dock, name: str, ferry: Ferry) -> str:
        """``name``'s set is ``ferry`` from now on: registered at its first phase; the set of an object the trainer
        replaced (a re-created optimizer, another model) leaves the dock for the new one's (its ferry stays where it
        is): the dock moves what the engine holds now."""
        old = self.sets.get(name)
        if old is ferry:
            return name
        if old is not None:
            dock.remove(name)
            del self.sets[name]
        dock.add(name, ferry)
        self.sets[name] = ferry
        self.order.added(dock)
        return name

    def _drop_dead(self, dock: Dock) -> None:
        """Sets whose objects were all collected (an optimizer replaced and dropped) leave the dock before a decision
        would move them: nothing of them is the trainer's any more."""
        dead = tuple(n for n, f in self.sets.items() if n not in dock.in_use and not targets_of(f))
        for n in dead:
            dock.remove(n)
            del self.sets[n]
        if dead:
            self.order.removed(dock, dead)

    def _size_workspace(self, dock: Dock, e: EngineNames, mode: str, sets: list[str]) -> None:
        """The workspace claimant: the rest of the budget until measured (beside the phase's sets, what is reserved
        and what an open phase holds in use: a context nested in one of the other mode), then the largest measure
        plus :data:`WORKSPACE_MARGIN` (at most the budget: more would never fit)."""
        name = e.workspace[mode]
        if mode in e.measured:
            want = min(int(e.measured[mode] * (1 + WORKSPACE_MARGIN)), dock.budget_bytes)
        else:
            busy = sum(dock.nbytes(n) for n in dock.in_use if n not in sets and n != name)
            want = max(0, dock.budget_bytes - sum(dock.nbytes(n) for n in sets) - self._reserved_bytes(dock) - busy)
        if not dock.has(name):
            dock.add_claimant(name, want)
            self.order.added(dock)
        elif dock.nbytes(name) != want:
            dock.resize(name, want)

    # --------------------------------------------------------------------- claimants (the rollout)
    def wake(self, claimants: Mapping[str, int], device: torch.device | None = None, what: str = "") -> None:
        """Room made for each of ``claimants`` (name -> bytes), which stay awake until :meth:`asleep` or the next
        phase entry; one phase each (a rollout's weights and KV cache may wake apart). ``what`` names them
        for messages (``"the rollout's"``).

        Raises:
            ValueError: one takes more than the budget (checked before anything changes), or does not fit.
        """
        if not claimants:
            return
        if self.dock is None:
            if device is None:
                return  # no phase has run and no device named: nothing to count yet
            self.dock_on(device)
        dock = self.dock
        assert dock is not None
        self._drop_dead(dock)
        if dock.device is not None:
            self._reserve(dock)  # a checkpoint load since the last phase: counted before the wake
        for name, nbytes in claimants.items():
            if nbytes > dock.budget_bytes:
                raise OverBudget(f"torchferry: {self.label}: {what} {name} take {nbytes} bytes, more than the budget "
                                 f"of {dock.budget_bytes} bytes: the budget ({self.hint}) must hold them and what "
                                 "stays beside them")
        for name, nbytes in claimants.items():
            if not dock.has(name):
                dock.add_claimant(name, nbytes, sleep=_nothing, wake=_nothing, empty_cache=True)
                self.order.added(dock)
            elif dock.nbytes(name) != nbytes:
                self.asleep()
                if dock.is_resident(name):  # woken by a prefetch of the planned step
                    dock.evict(name)
                dock.resize(name, nbytes)
                self.order.added(dock)
        for name in claimants:
            if name in self.awake:
                continue
            try:
                dock.acquire(name)
            except (OverBudget, NoRoom) as err:
                raise type(err)(f"torchferry: {self.label}: {what} {name} do not fit the budget: {err}") from err
            self.awake.add(name)
            self.order.record(dock, (name,))
            self.phase_log.append(("rollout", (name,)))
            if self.planned:
                dock.prefetch_next()

    def asleep(self) -> None:
        """The woken claimants asleep: their bytes no longer count."""
        if self.dock is None or not self.awake:
            return
        names = tuple(sorted(self.awake))
        self.awake.clear()
        self.dock.release(*names)
        self.dock.evict(*names)


def _nothing() -> None:
    """The rollout's own resume / the driver's sleep move its memory; the dock only counts it."""
