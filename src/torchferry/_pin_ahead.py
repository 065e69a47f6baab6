"""Pinning ahead: a ferry's host pool is allocated and pinned in the background from the start.

[Note: pin ahead]
Getting pinned host memory costs far more than copying into it: mapping,
first-touching and registering 24.7 GB took 5.3 s inside a first offload on
one H200 host (4.6 GB/s) against 0.50 s for a steady offload, and on the
device pool's Firecracker machines, whose memory grows as it is first used
(about 3 s per 8 GiB, ``.library/device/KINDS.md``), a 45.7 GB pool took
17.2 s (2.66 GB/s, ``benchmarks/results`` bench of 2026-11-30). So a ferry made
on a GPU starts that work in a background thread at once (``Ferry(...,
pin_ahead=True)``, the default), while training goes on; the first
``offload()`` only waits for what is left of it.

The pool is sized for the plan at that moment. An optimizer target without
state yet (made before its first step) would make that plan too small, and
growing the pool later means pinning again: then pinning waits for the
optimizer's first step (a step post-hook) and starts right after it, sized
without the ``.grad``s that still exist then (the offload usually comes after
``zero_grad(set_to_none=True)``; if it does not, the pool grows there).

A failure here (host budget, memory) is logged, not raised: the first
``offload()`` allocates the pool itself and raises there, as without pinning
ahead. ``reserve_host()`` hands back the pinning seconds (or their future).
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future

from ._host_budget import HostBudgetError
from ._plan import Plan
from ._whole import StateSet

__all__ = ["PinAhead"]

logger = logging.getLogger(__name__)


class PinAhead:
    """Starts a ferry's pool allocation in the background, now or after the first optimizer step.

    Args:
        state: the ferry's :class:`StateSet` (its pool and plan).
        plan: the plan made when the ferry was constructed.

    Attributes:
        future: the pinning seconds (a ``Future``) once started, else ``None``.
    """

    def __init__(self, state: StateSet, plan: Plan) -> None:
        self._state = state
        self._hooks: list = []
        self.future: Future | None = None
        self._claimed = False
        waiting = [opt for opt in plan.optimizers if not opt.state]
        if waiting:
            ref = weakref.ref(self)

            def after_step(*_: object) -> None:
                me = ref()
                if me is not None:
                    me._remove_hooks()
                    me.start()

            self._hooks = [opt.register_step_post_hook(after_step) for opt in waiting]
        else:
            self.start()

    @classmethod
    def arm(cls, state: StateSet, plan: Plan) -> PinAhead | None:
        """A :class:`PinAhead` for a ferry whose state lies on a GPU, else ``None``."""
        if state.device.type != "cuda" or not (plan.state_bytes or plan.optimizers):
            return None
        return cls(state, plan)

    def start(self) -> None:
        """Reserves the pool for the plan now, in the background (a no-op when it fits)."""
        try:
            self.future = self._state.host.reserve(self._state.plan(), background=True, quiet=True, skip_grads=True)
        except (HostBudgetError, RuntimeError, ValueError, NotImplementedError) as e:
            logger.info("torchferry: not pinning ahead (%s); the first offload pins instead", e)

    def claim(self) -> Future | None:
        """The pinning seconds' future, once: for the ``reserve_host()`` that comes first."""
        if self._claimed:
            return None
        self._claimed = True
        return self.future

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def cancel(self) -> None:
        """Removes the step hooks (the ferry closes); a pinning under way finishes and is freed
        by the pool's release."""
        self._remove_hooks()

    def __del__(self) -> None:
        self._remove_hooks()
