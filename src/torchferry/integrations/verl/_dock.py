"""verl's trainer under a :class:`~torchferry.Dock`: ``patch(dock=budget)``.

[Note: verl under a Dock]
With a budget (``patch(dock=...)`` or ``TORCHFERRY_VERL_DOCK``, which the Ray hook passes on;
bytes, or a fraction of the device's memory), verl's train/eval contexts (``BaseEngineCtx``, whose
``__enter__`` / ``__exit__`` call ``FSDPEngine.to``) ask one dock per process instead of moving:

* each FSDP engine (not a ``forward_only`` one, which verl keeps under FSDP2's
  ``CPUOffloadPolicy``) has a state set for what verl offloads of it, registered at its first
  phase: ``engine<N>.params`` (its model's ferry: parameters, gradients, buffers) with
  ``param_offload``, ``engine<N>.optimizer`` (the optimizer's, once it has state) with
  ``optimizer_offload``; what verl keeps on the device is reserved as ``engine<N>.resident``
  ([Note: verl's offload flags under a Dock] in ``._dock_engine``);
* entering a phase acquires its sets and a byte-count claimant ``engine<N>.workspace.<mode>``
  for what the phase allocates besides them (activations, gradients, temporaries), so
  idle sets leave only as far as the budget needs; leaving releases them: they stay resident
  until the room is needed (eviction is lazy, [Note: choosing victims]);
* the workspace is measured: its first phase of each mode counts the whole rest of the budget
  (every idle set leaves), then the peak the phase allocated above what it held at its start
  (``torch.cuda.max_memory_allocated``: the device's peak statistics are reset at each phase
  entry) less what the sets grew by in it (AdamW's state made by the first step), plus 10%, the
  largest seen so far;
* the rollout's weights and KV cache are claimants ``rollout.weights`` / ``rollout.kv_cache``,
  woken at ``rollout.resume(tags)`` (:func:`dock_rollout`, applied to the worker's rollout
  after ``ActorRolloutRefWorker.init_model``), so the dock evicts before the engine maps its
  memory (with ``empty_cache()``: vLLM and SGLang allocate outside PyTorch); which sets leave
  is the dock's choice (the fewest bytes to bring back before their next use, [Note: choosing
  victims]);
* what the worker cannot see, the driver putting the rollout to sleep (verl's colocated
  trainer does it before each training phase, ``sleep_replicas``), is inferred: at the next
  phase entry the rollout's claimants count as asleep;
* once one full step was seen (from a phase back to its first phase), its order of phases
  becomes the dock's schedule (:meth:`~torchferry.Dock.plan`): victims are chosen by when
  they are needed next, and each phase starts bringing in the next (``prefetch_next``): the
  optimizer state behind old_log_prob's compute, its D2H behind the weight sync;
* verl's other calls of the helpers (``update_weights``' offload, LoRA's staging, checkpoints)
  leave a docked set where the dock has it (a load makes it resident); state a checkpoint puts
  on the device while its set is evicted is counted ([Note: state loaded behind the dock's back]
  in ``torchferry._core._dock.measure``);
* a context's exit leaves the dock its entry took, also when ``patch(dock=...)`` chose another
  dock in between (before, the old dock's names stayed in use for good).

Not reached: the reference model under ``CPUOffloadPolicy`` (verl moves it with FSDP2's own
hooks), engines with ``disable_auto_offload``. Wrong budgets and unknown verl versions fail at
``patch()``; a phase whose sets and workspace exceed the budget raises before verl's code runs,
naming what did not fit.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import deque
from typing import Any

import torch

from torchferry import Dock, Ferry

from .._base import REGISTRY, PhaseOrder, SeedHelpers, has_state, helpers_of, local_of
from ._dock_engine import EngineNames, check_first_step, offloads, resident_bytes, why_kept

__all__ = ["VerlDock", "active", "dock_rollout", "docked", "docks"]

logger = logging.getLogger("torchferry")

WORKSPACE_MARGIN = 0.10  # a phase's workspace claimant: its largest measured peak plus this fraction
ROLLOUT_WEIGHTS, ROLLOUT_KV = "rollout.weights", "rollout.kv_cache"
_TAGS = {"weights": ROLLOUT_WEIGHTS, "kv_cache": ROLLOUT_KV}


def dock_rollout(rollout: Any, weights_bytes: int, kv_cache_bytes: int) -> Any:
    """Makes a rollout's memory claimants of the process's verl dock: ``rollout.resume(tags)``
    first makes room for ``rollout.weights`` (``weights_bytes``) and / or ``rollout.kv_cache``
    (``kv_cache_bytes``), then resumes; ``rollout.release()`` marks both asleep (the next phase
    entry does too: [Note: verl under a Dock]). Applied to the worker's rollout by ``patch(dock=...)``;
    call it on a rollout of your own; called again, it takes the new byte counts. A no-op without a
    dock. A ``resume`` that raises leaves its claimants counted until the next phase entry (its memory
    may be half mapped).

    Args:
        rollout: an object with ``async resume(tags)`` (``tags``: a list of ``"weights"`` /
            ``"kv_cache"``) and ``async release()`` (verl's ``BaseRollout``).
        weights_bytes: bytes its weights take on this device (>= 0).
        kv_cache_bytes: bytes its KV cache takes (>= 0).

    Returns:
        ``rollout``, its ``resume`` / ``release`` wrapped (on the instance).

    Raises:
        ValueError: a byte count that is not an int >= 0.
        TypeError: ``rollout`` lacks ``resume`` or ``release``, or they are not ``async``; later, a
            ``resume(tags)`` whose ``tags`` is a str, not a list.
    """
    for what, n in (("weights_bytes", weights_bytes), ("kv_cache_bytes", kv_cache_bytes)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"torchferry: dock_rollout: {what} must be an int >= 0 (bytes), got {n!r}")
    if not callable(getattr(rollout, "resume", None)) or not callable(getattr(rollout, "release", None)):
        raise TypeError(f"torchferry: dock_rollout: {type(rollout).__name__} has no resume(tags) / release()")
    sizes = getattr(rollout, "_torchferry_dock_bytes", None)
    if sizes is not None:  # wrapped already: the new counts
        sizes.update(weights=weights_bytes, kv_cache=kv_cache_bytes)
        return rollout
    resume, release = rollout.resume, rollout.release
    if not (inspect.iscoroutinefunction(resume) and inspect.iscoroutinefunction(release)):
        raise TypeError(f"torchferry: dock_rollout: {type(rollout).__name__}.resume / release must be async "
                        "(verl's BaseRollout's are)")
    sizes = {"weights": weights_bytes, "kv_cache": kv_cache_bytes}

    async def resume_docked(tags, *args, **kwargs):
        if isinstance(tags, str):
            raise TypeError(f"torchferry: resume(tags={tags!r}): tags is a list of str, e.g. [{tags!r}]")
        mode = active()
        if mode is not None:
            mode.rollout_wakes([t for t in tags if t in _TAGS], dict(sizes))
        return await resume(tags, *args, **kwargs)

    async def release_docked(*args, **kwargs):
        out = await release(*args, **kwargs)
        mode = active()
        if mode is not None:  # its memory is free once release() returns
            mode.rollout_asleep()
        return out

    rollout.resume, rollout.release = resume_docked, release_docked
    rollout._torchferry_dock_bytes = sizes
    return rollout


class VerlDock:
    """The process's dock over verl's engines ([Note: verl under a Dock])."""

    def __init__(self, budget: int | float) -> None:
        self.budget = budget
        self.dock: Dock | None = None
        self.engines: weakref.WeakKeyDictionary[Any, EngineNames] = weakref.WeakKeyDictionary()
        self.awake: set[str] = set()  # rollout claimants woken since the last phase entry
        self.order = PhaseOrder()  # the step's phases, learnt: [Note: a step's phases learnt]
        self.phase_log: deque[tuple[str, tuple[str, ...]]] = deque(maxlen=256)  # (event, names), the latest
        self.peak_seen = 0  # torch.cuda.max_memory_allocated before each reset of it, bytes (take_peak)
        self._next_index = 0  # engine<N>: never reused, also after an engine is collected
        self.sets: dict[str, Ferry] = {}  # the state sets registered in the dock: name -> its ferry
        self.reserved: set[str] = set()  # engines' engine<N>.resident in the dock

    # --------------------------------------------------------------- the dock and its names
    def _dock_on(self, device: torch.device) -> Dock:
        if self.dock is None:
            budget = self.budget
            if isinstance(budget, float):
                if device.type != "cuda":
                    raise ValueError(f"torchferry: verl dock: a fractional budget ({budget}) needs a GPU; "
                                     f"give bytes on {device}")
                total = torch.cuda.get_device_properties(device).total_memory
                budget = int(budget * total)
                if budget < 1 << 20:
                    raise ValueError(f"torchferry: verl dock: the budget {self.budget} of {device}'s {total} bytes "
                                     f"is {budget} bytes: give a larger fraction or bytes")
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

    def _names_changed(self) -> None:
        """A set or claimant added: a schedule planned without it is learnt again."""
        self.order.added(self.dock)

    def _record(self, names: tuple[str, ...]) -> None:
        """Learns the step's order of phases ([Note: verl under a Dock])."""
        assert self.dock is not None
        self.order.record(self.dock, names)

    def holds(self, ferry: Ferry) -> bool:
        """Whether ``ferry`` is one of the dock's sets (the helpers then leave it to the dock)."""
        return self._name_of(ferry) is not None

    def _name_of(self, ferry: Ferry) -> str | None:
        return next((n for n, f in self.sets.items() if f is ferry), None)

    def forget(self, ferry: Ferry) -> None:
        """Drops ``ferry``'s set (it stays where it is), for a dock of another budget to take it.

        Raises:
            RuntimeError: a phase of this dock holds it.
        """
        name = self._name_of(ferry)
        if name is not None and self.dock is not None:
            self.dock.remove(name)
            del self.sets[name]
            self._names_changed()

    def load_docked(self, ferry: Ferry) -> None:
        """A helper's load of a docked set outside a phase: resident when it returns (stays, lazily)."""
        name = self._name_of(ferry)
        assert self.dock is not None and name is not None
        try:
            if name in self.dock.in_use:
                self.dock.require(name)
                return
            self.dock.acquire(name)
        except (ValueError, RuntimeError) as err:
            raise type(err)(f"torchferry: verl dock: verl's load of {name} outside a phase does not fit the budget "
                            f"(TORCHFERRY_VERL_DOCK / patch(dock=...)): {err}") from err
        self.dock.release(name)

    # --------------------------------------------------------------------- phases
    def enter(self, engine: Any, mode: str, model: bool, optimizer: bool, helpers: SeedHelpers | None = None) -> None:
        """A train/eval context's entry: what verl keeps resident of the engine measured, its sets and its
        workspace acquired ([Note: verl's offload flags under a Dock])."""
        e = self.engines.get(engine)
        if e is None:
            e = self.engines[engine] = EngineNames(self._next_index)
            self._next_index += 1
            weakref.finalize(engine, self._forget_engine, e.names)
        if mode in e.open:  # a context of the same mode inside the open one: nothing more to hold
            e.depth[mode] = e.depth.get(mode, 0) + 1
            return
        device = _device_of(engine)
        dock = self._dock_on(device)
        self.rollout_asleep()  # the driver slept it before this phase: [Note: verl under a Dock]
        names: list[str] = []
        try:
            self._reserve(dock, device)
            if model:
                names.append(self._ensure_set(dock, e.params, engine.module, helpers))
            if optimizer and engine.optimizer is not None and has_state(engine.optimizer):
                names.append(self._ensure_set(dock, e.optimizer, engine.optimizer, helpers))
            elif mode == "train" and engine.optimizer is not None and not has_state(engine.optimizer):
                # its first step makes the state: will it fit?
                held = sum(dock.nbytes(n) for n in names) + self._reserved_bytes(dock)
                check_first_step(dock, e, engine.optimizer, device, held)
            self._size_workspace(dock, e, mode, names)
            names.append(e.workspace[mode])
            dock.acquire(*names)
        except (ValueError, RuntimeError) as err:  # nothing acquired: verl's code has not run
            raise type(err)(f"torchferry: verl dock: the {mode} phase of {e.tag} does not fit its budget "
                            f"(TORCHFERRY_VERL_DOCK / patch(dock=...)): {err}") from err
        try:
            self._record(tuple(names))
            started = dock.prefetch_next() if self.planned else ()
        except BaseException:  # Ctrl-C or out of memory starting a prefetch: the phase does not open
            dock.release(*names)
            raise
        start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        e.open[mode] = (tuple(names), start, bool(started), self._state_bytes(dock, e, engine, device), device)
        self.phase_log.append(("enter", tuple(names)))

    def leave(self, engine: Any, mode: str, helpers: SeedHelpers | None = None) -> None:
        """A train/eval context's exit: the workspace measured, the sets released (they stay resident
        while the budget allows), the next phase's sets started.

        Raises:
            ValueError: the optimizer state its first step made can never fit the budget (the phase's
                names are released first; the next train phase is refused before verl's code runs).
        """
        e = self.engines.get(engine)
        if e is None or mode not in e.open or self.dock is None:
            return
        if e.depth.get(mode, 0):  # a nested context of the same mode: the outer one leaves
            e.depth[mode] -= 1
            return
        dock = self.dock
        names, start, prefetched, state0, device = e.open.pop(mode)
        try:
            if engine.optimizer is not None and has_state(engine.optimizer) and offloads(engine)[1]:
                self._ensure_set(dock, e.optimizer, engine.optimizer, helpers)
                if e.optimizer not in names:  # this phase holds it from now on
                    self.order.joins(e.optimizer)
            if device.type != "cuda":  # no device memory to share: nothing to measure
                e.measured.setdefault(mode, 0)
            elif not prefetched:  # a prefetch's allocations are not the phase's
                # the sets' own growth (AdamW's state made by the first step, gradients kept) is not workspace
                grown = max(0, self._state_bytes(dock, e, engine, device) - state0)
                peak = torch.cuda.max_memory_allocated(device) - start - grown
                e.measured[mode] = max(e.measured.get(mode, 0), int(peak))
        except ValueError as err:
            raise ValueError(f"torchferry: verl dock: after the {mode} phase of {e.tag}: {err}") from err
        finally:
            dock.release(*names)
        self._reserve(dock, device)  # the first step's state of an optimizer verl keeps resident, gradients kept
        self._size_workspace(dock, e, mode, [])  # measured now: what prefetches until its next entry plan with
        self.phase_log.append(("leave", names))
        if self.planned:
            dock.prefetch_next()

    def close_phases(self) -> None:
        """Releases every phase still open (``unpatch()`` inside a phase: verl's own ``__exit__`` ends it)."""
        for e in list(self.engines.values()):
            for mode in list(e.open):
                names = e.open.pop(mode)[0]
                e.depth.pop(mode, None)
                if self.dock is not None:
                    self.dock.release(*names)

    def _forget_engine(self, names: tuple[str, ...]) -> None:
        """An engine was garbage-collected: its sets and workspaces leave the dock (their ferries with them)."""
        d = self.dock
        for n in names:
            try:
                if d is not None and n not in d.in_use:
                    d.remove(n)
                    self.sets.pop(n, None)
                    self.reserved.discard(n)
            except ValueError:  # never registered
                pass
        self.order.removed(d, names)

    def _state_bytes(self, dock: Dock, e: EngineNames, engine: Any, device: torch.device) -> int:
        """Bytes the engine's registered sets count now, and what verl keeps of it on the device."""
        return sum(dock.nbytes(n) for n in (e.params, e.optimizer) if n in self.sets) + resident_bytes(engine, device)

    def _reserved_bytes(self, dock: Dock) -> int:
        return sum(dock.nbytes(n) for n in self.reserved)

    def _reserve(self, dock: Dock, device: torch.device) -> None:
        """What verl keeps on the device of every engine, measured now and reserved in the dock
        ([Note: verl's offload flags under a Dock]).

        Raises:
            ValueError: an engine keeps more than the budget (one line, naming its flags).
        """
        for engine, e in list(self.engines.items()):
            nbytes = resident_bytes(engine, device)
            if nbytes > dock.budget_bytes:
                raise ValueError(f"{e.tag} keeps {nbytes} bytes on the device ({why_kept(engine)}), more than the "
                                 f"budget of {dock.budget_bytes} bytes: raise it or turn that offload on in verl")
            if nbytes or e.resident in self.reserved:
                if e.resident not in self.reserved:
                    self._names_changed()
                dock.reserve(e.resident, nbytes)
                self.reserved.add(e.resident)

    def take_peak(self) -> int:
        """The device's peak allocated bytes since the last call (``torch.cuda.max_memory_allocated``,
        which each phase entry resets to measure the phase's workspace; 0 without a GPU dock)."""
        d = self.dock
        if d is None or d.device is None or d.device.type != "cuda":
            return 0
        peak, self.peak_seen = max(self.peak_seen, torch.cuda.max_memory_allocated(d.device)), 0
        return peak

    def _ensure_set(self, dock: Dock, name: str, obj: Any, helpers: SeedHelpers | None) -> str:
        if name in self.sets:
            return name
        ferry = (helpers or helpers_of("verl")).make(obj)  # recorded as verl's: [Note: unpatch() brings the state back]
        for other in docks():  # a dock of another budget (patch(dock=...) changed) lets it go
            if other is not self and other.holds(ferry):
                other.forget(ferry)
        dock.add(name, ferry)
        self.sets[name] = ferry
        self._names_changed()
        return name

    def _size_workspace(self, dock: Dock, e: EngineNames, mode: str, sets: list[str]) -> None:
        """The workspace claimant: the rest of the budget until measured, then the largest measure plus
        :data:`WORKSPACE_MARGIN` (at most the budget: more would never fit)."""
        name = e.workspace[mode]
        if mode in e.measured:
            want = min(int(e.measured[mode] * (1 + WORKSPACE_MARGIN)), dock.budget_bytes)
        else:
            want = max(0, dock.budget_bytes - sum(dock.nbytes(n) for n in sets) - self._reserved_bytes(dock))
        try:
            have = dock.nbytes(name)
        except ValueError:
            dock.add_claimant(name, want)
            self._names_changed()
            return
        if have != want:
            dock.remove(name)
            dock.add_claimant(name, want)

    # --------------------------------------------------------------------- rollout
    def rollout_wakes(self, tags: list[str], nbytes: dict[str, int]) -> None:
        """``rollout.resume(tags)``: room made for each tag's claimant, which stays awake until the
        rollout sleeps (``release()`` or the next phase entry)."""
        if not tags:
            return
        if self.dock is None:
            if not torch.cuda.is_available():
                return  # no phase has run and no GPU: nothing to count yet
            self._dock_on(torch.device("cuda", torch.cuda.current_device()))
        dock = self.dock
        assert dock is not None
        if dock.device is not None:
            self._reserve(dock, dock.device)  # a checkpoint load since the last phase: counted before the wake
        for tag in tags:
            name = _TAGS[tag]
            if nbytes[tag] > dock.budget_bytes:  # checked before anything changes
                raise ValueError(f"torchferry: verl dock: the rollout's {tag} take {nbytes[tag]} bytes, more than the "
                                 f"budget of {dock.budget_bytes} bytes: the budget (TORCHFERRY_VERL_DOCK / "
                                 "patch(dock=...)) must hold the rollout's memory (gpu_memory_utilization of the "
                                 "device) and what stays beside it")
            try:
                have = dock.nbytes(name)
            except ValueError:
                have = None
            if have != nbytes[tag]:
                if have is not None:
                    self.rollout_asleep()
                    dock.remove(name)
                dock.add_claimant(name, nbytes[tag], sleep=_nothing, wake=_nothing, empty_cache=True)
                self._names_changed()
        for tag in tags:  # one phase per tag: resume(["weights"]) and resume(["kv_cache"]) come apart
            name = _TAGS[tag]
            if name in self.awake:
                continue
            try:
                dock.acquire(name)
            except (ValueError, RuntimeError) as err:
                raise type(err)(f"torchferry: verl dock: the rollout's {tag} do not fit the budget: {err}") from err
            self.awake.add(name)
            self._record((name,))
            self.phase_log.append(("rollout", (name,)))
            if self.planned:
                dock.prefetch_next()

    def rollout_asleep(self) -> None:
        """The rollout's claimants asleep: their bytes no longer count."""
        if self.dock is None or not self.awake:
            return
        names = tuple(sorted(self.awake))
        self.awake.clear()
        self.dock.release(*names)
        self.dock.evict(*names)


def _nothing() -> None:
    """The rollout's own resume / the driver's sleep move its memory; the dock only counts it."""


def _device_of(engine: Any) -> torch.device:
    ferry = REGISTRY.ferry(engine.module)
    if ferry is not None:
        return ferry.device
    for p in engine.module.parameters():
        local = local_of(p)
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def docks() -> list[VerlDock]:
    """Every verl dock made in this process and kept, one per budget (``unpatch()`` keeps them)."""
    return [vd for key, vd in list(REGISTRY.kept.items()) if key[0] == "verl"]


def active() -> VerlDock | None:
    """The process's dock mode while ``patch(dock=...)`` holds ([Note: verl under a Dock])."""
    state = REGISTRY.patched.get("verl")
    return None if state is None else state.router


def docked() -> VerlDock | None:
    """The process's verl dock while ``patch(dock=...)`` holds, else ``None``: its :class:`~torchferry.Dock`
    (``.dock``: ``stats``, ``moves``, ``resident_bytes``), the phases it saw (``.phase_log``) and
    :meth:`VerlDock.take_peak`."""
    return active()
