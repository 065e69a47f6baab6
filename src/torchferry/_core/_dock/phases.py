"""A trainer's step learnt as the order of its phases, for :meth:`Dock.plan`: framework-neutral.

[Note: a step's phases learnt]
A colocated trainer runs the same phases every step (verl's: the rollout's
wake, old log-probs, the reference, update_actor, the weight sync), each
holding some of a dock's names. :class:`PhaseOrder` records each phase as the
set of names it holds; a cycle closes when its first phase comes again after
at least one other phase, and the dock is planned with that cycle, so that
eviction looks ahead ([Note: choosing victims] in ``dock``). A name added to
the dock afterwards makes the planned order learnt again (the plan does not
know it); a name removed while the order is still being learnt drops what was
learnt with it (a plan naming it would be refused). Used by the phase dock
(``phase_dock``, [Note: a trainer under a phase dock]); a trainer that knows
its phases calls :meth:`Dock.plan` itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from .dock import Dock

__all__ = ["PhaseOrder"]


class PhaseOrder:
    """The phases seen since the last change of names, and whether the dock was planned with them."""

    def __init__(self) -> None:
        self.cycle: list[frozenset[str]] = []
        self.planned = False

    def record(self, dock: Dock, names: Iterable[str]) -> None:
        """A phase holding ``names`` begins; plans ``dock`` when it closes a cycle."""
        phase = frozenset(names)
        if self.cycle and phase == self.cycle[0] and len(set(self.cycle)) > 1 and not self.planned:
            dock.plan(list(self.cycle))
            self.planned = True
        if not self.planned:
            self.cycle.append(phase)

    def joins(self, name: str) -> None:
        """The phase under way holds ``name`` from now on (a set made during it: an optimizer's first step)."""
        if self.cycle:
            self.cycle[-1] = self.cycle[-1] | {name}

    def added(self, dock: Dock | None) -> None:
        """A name was added to the dock: a planned order is learnt again."""
        if self.planned:
            self.cycle, self.planned = [], False
            if dock is not None:
                dock.plan(None)

    def removed(self, dock: Dock | None, names: Iterable[str]) -> None:
        """Names left the dock: an order still being learnt that named them is learnt again, a planned
        one too."""
        gone = set(names)
        if not self.planned and any(phase & gone for phase in self.cycle):
            self.cycle = []
        self.added(dock)
