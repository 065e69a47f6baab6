"""A ferry call's all-or-nothing step, written once.

[Note: one rollback]
Each ferry call that moves state (``offload()``, ``reload()``, the start of a
layer-wise reload, the reconcile of state replaced while offloaded) first does
its fallible work, then records its decisions on the ferry: the residency,
what is offloaded, the last handle, the layer-wise reload under way, the reload
arena and the forward guards. :class:`Rollback` takes those as they were
before the decisions; if anything raises before the call returns (an
out-of-memory, ``KeyboardInterrupt``, ``SystemExit`` from a SIGTERM handler),
it runs the move's undo and puts every field and the guards back, in a section
no signal interrupts ([Note: an undo is not interrupted] in
``torchferry._core._transfer.signals``), then lets the exception go on
([Note: all or nothing] in ``torchferry._core._ferry.interrupts``). A move that
completed before raising (``committed()``: [Note: a release rolled forward] in
``torchferry._core._transfer.release``) is not undone: its decisions stand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._state.plan import Plan
from .._transfer.signals import uninterruptible

__all__ = ["Rollback"]


class Rollback:
    """``with Rollback(ferry, guards=plan) as rb:`` around a call's move and decisions; ``rb.undo`` and
    ``rb.committed`` are set once the move exists (attribute writes: nothing between the move and the
    ``with`` can raise).

    Args:
        ferry: the :class:`~torchferry.Ferry` whose fields are taken now and put back on a failure.
        undo: the move's undo (idempotent), run first on a failure; ``None``: nothing to undo.
        guards: the plan whose modules' and optimizers' guards were installed before the call
            (put back on a failure), or ``None``: none were (any installed since are removed).
        committed: whether the move completed although the block raised: then nothing is undone.
    """

    def __init__(self, ferry: Any, undo: Callable[[], None] | None = None, *, guards: Plan | None = None,
                 committed: Callable[[], bool] | None = None) -> None:
        self._ferry, self.undo, self._guards, self.committed = ferry, undo, guards, committed
        self._saved = (ferry._offloaded, ferry._residency, ferry._last, ferry._prefetch, ferry._set.arena)

    def __enter__(self) -> Rollback:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        if exc_type is None or (self.committed is not None and self.committed()):
            return False
        f = self._ferry
        with uninterruptible():  # see [Note: an undo is not interrupted]
            if self.undo is not None:
                self.undo()
            if self._guards is None:
                f._guards.remove()
            else:
                f._guards.install(self._guards.modules, self._guards.optimizers)
            f._offloaded, f._residency, f._last, f._prefetch, f._set.arena = self._saved
        return False
