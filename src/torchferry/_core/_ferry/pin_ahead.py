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
growing the pool later means pinning again: then pinning waits until every
such optimizer made its first step (step post-hooks) and starts right after,
sized without the ``.grad``s that still exist then (the offload usually comes
after ``zero_grad(set_to_none=True)``; if it does not, the pool grows there).
It only ever starts while the pool is empty: once the state went through the
pool, growing it would drop a block that an H2D copy may still read.

A failure here (host budget, memory, anything) is logged, not raised: the first
``offload()`` allocates the pool itself and raises there, as without pinning
ahead. ``reserve_host()`` hands back the pinning seconds (or their future).
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future

import torch

from .._state.plan import Plan
from .state_set import StateSet

__all__ = ["PinAhead"]

logger = logging.getLogger("torchferry")


def _param_device(optimizers: list) -> torch.device | None:
    """The device of the first parameter of the optimizers' groups (state appears there)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                return p.device
    return None


class PinAhead:
    """Starts a ferry's pool allocation in the background, now or after the optimizers' first step.

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
        self._done = False
        waiting = [opt for opt in plan.optimizers if not opt.state]
        if not waiting:
            self.start(skip_grads=False)  # the state as it is now is what the first offload moves
            return
        ref = weakref.ref(self)

        def after_step(*_: object) -> None:
            me = ref()
            # Every optimizer without state must have made its first step: a pool sized
            # earlier would be too small for the others' state.
            if me is None or me._done or not all(opt.state for opt in waiting):
                return
            me._done = True  # the hook stays registered (removing it here would change the
            #                  dict torch is iterating over) and does nothing from now on
            me.start(skip_grads=True)

        self._hooks = [opt.register_step_post_hook(after_step) for opt in waiting]

    @classmethod
    def arm(cls, state: StateSet, plan: Plan) -> PinAhead | None:
        """A :class:`PinAhead` for a ferry whose state lies (or will lie) on a GPU, else ``None``.

        An optimizer target without state and no device given leaves the ferry's device
        undecided; its parameters' device tells where the state will appear.
        """
        device = state.device if state.device_fixed else _param_device(plan.optimizers)
        if device is None or device.type != "cuda" or not (plan.state_bytes or plan.optimizers):
            return None
        return cls(state, plan)

    def start(self, *, skip_grads: bool) -> None:
        """Reserves the pool for the plan now, in the background (a no-op when it fits).

        Only while the pool is empty (nothing offloaded yet): growing a pool the state
        went through would drop a block that an H2D copy may still be reading, and a
        ferry that already offloaded has no first offload left to speed up.

        Args:
            skip_grads: size it without the ``.grad``s (right after ``optimizer.step()``,
                before the usual ``zero_grad(set_to_none=True)``).
        """
        self._done = True
        if self._state.pool.nbytes:
            return
        try:
            plan = self._state.plan()  # first: it may fix the device, and with it the pool and layout
            self.future = self._state.host.reserve(plan, background=True, quiet=True, skip_grads=skip_grads)
        except Exception as e:  # noqa: BLE001  (never raise into the constructor or optimizer.step())
            logger.info("torchferry: not pinning ahead (%s); the first offload pins instead", e)

    def claim(self) -> Future | None:
        """The pinning seconds' future, once: for the ``reserve_host()`` that comes first."""
        if self._claimed:
            return None
        self._claimed = True
        return self.future

    def cancel(self) -> None:
        """Removes the step hooks (the ferry closes); a pinning under way finishes and is freed
        by the pool's release."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __del__(self) -> None:
        self.cancel()
