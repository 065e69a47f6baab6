"""State the caller drops while it is resident is freed then, not at the next offload.

[Note: state dropped while resident]
After a reload the ferry keeps its plan for the next offload ([Note: optimistic offload] in
``state_set.py``): the storages, the tensor objects and a 1D view of each storage. What the caller
drops meanwhile stayed allocated, held by that plan alone, until the next offload: a gradient set to
``None`` by ``optimizer.zero_grad()`` (``set_to_none=True`` is PyTorch's default), an optimizer
state replaced by ``load_state_dict()``. In verl's step order (``tests/gpu/test_memory_beside_verl_cuda.py``)
update_actor's backward then ran with the last step's gradients still allocated beside the new ones:
its peak was 11.11 GB against 9.50 GB with verl's own helpers on one H100, 1.61 GB over, the
parameters' bytes, which verl's helpers free at ``zero_grad()``.

So while the state is resident and its plan holds gradients, a :class:`ResidentWatch` puts a forward
pre-hook (prepended: before FSDP2's all-gather) on each module target whose parameters hold one of
them; the hook checks, by identity, that those parameters still hold the plan's gradients (about 0.1 us
per parameter, its own parameters only). If one is gone or replaced the plan is forgotten, as after a
reconcile: the dropped gradients are freed before the forward (and the backward that makes new
ones), and the next offload plans again (the fingerprint changed: it would have anyway). A plan
without gradients installs nothing. The hooks go with the next offload (or ``close()``); they do
nothing while a layer-wise reload is under way (its own hooks hold the plan) or while
``torch.compile`` traces (a compiled forward checks nothing: the gradients go at the next offload, as
before). They copy and pickle as no-ops: a resident model may be deep-copied or saved whole. Not
watched: optimizer state replaced by ``load_state_dict()`` while resident (held until the next
offload); optimizer hooks that changed what the optimizer's own hooks iterate over, and a full
fingerprint at ``step()`` (which also sees state *added*, such as new gradients, and would drop the
baseline of [Note: unchanged storages] for nothing), were tried and removed.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


__all__ = ["ResidentWatch", "forget_plan_of", "grads_still_held"]

logger = logging.getLogger("torchferry")


def _inert(*args: object, **kwargs: object) -> None:
    """What a copied or unpickled watch hook becomes: nothing."""
    return None


class _Hook:
    """A watch hook; a copy or a pickle of it is :func:`_inert`."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn

    def __call__(self, *args: object, **kwargs: object) -> None:
        if not torch.compiler.is_compiling():
            self._fn()

    def __deepcopy__(self, memo: object) -> Callable[..., None]:
        return _inert

    def __copy__(self) -> Callable[..., None]:
        return _inert

    def __reduce_ex__(self, protocol: object) -> object:
        return (_rebuild_inert, ())


def _rebuild_inert() -> Callable[..., None]:
    return _inert


class ResidentWatch:
    """Forward pre-hooks on a resident ferry's module targets that let it forget its plan once the
    caller dropped a gradient the plan holds ([Note: state dropped while resident]).

    Args:
        dropped: called (with no argument) when a hook finds a gradient gone; forgets the plan
            (:func:`forget_plan_of`, given the ferry through a weak reference: hooks on the user's
            modules must not keep the ferry alive).
    """

    def __init__(self, dropped: Callable[[], None]) -> None:
        self._dropped = dropped
        self._handles: list[RemovableHandle] = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, modules: list[nn.Module], tensors: list[torch.Tensor]) -> None:
        """Installs one hook per module target whose parameters hold a gradient among ``tensors`` (the
        plan's); none where the plan holds no gradient. Once: a second call while armed does nothing."""
        if self._handles:
            return
        ref = weakref.ref(self)
        ids = {id(t) for t in tensors}
        for m in modules:
            pairs = [(weakref.ref(p), weakref.ref(p.grad)) for p in m.parameters()
                     if p.grad is not None and id(p.grad) in ids]
            if pairs:
                self._handles.append(m.register_forward_pre_hook(_Hook(_checker(ref, pairs)), prepend=True))

    def disarm(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()


def _checker(ref: weakref.ref, pairs: list[tuple[weakref.ref, weakref.ref]]) -> Callable[[], None]:
    def check() -> None:
        watch = ref()
        if watch is None or grads_still_held(pairs):
            return
        watch.disarm()
        watch._dropped()
    return check


def grads_still_held(pairs: list[tuple[weakref.ref, weakref.ref]]) -> bool:
    """Whether every parameter of ``pairs`` still holds its gradient (by identity)."""
    for p_ref, g_ref in pairs:
        p = p_ref()
        if p is None or p.grad is None or p.grad is not g_ref():
            return False
    return True


def forget_plan_of(ferry: Any) -> None:
    """A resident ``ferry``'s plan forgotten once its watch found a gradient of it dropped: what the
    caller dropped is freed now; the next offload plans again (its fingerprint, which lists the
    targets' tensors, differs anyway). Nothing while the ferry is closed, offloaded or reloading
    layer by layer (its hooks hold the plan)."""
    if ferry is None or ferry._closed or ferry._offloaded is not None or ferry._prefetch is not None:
        return
    logger.debug("torchferry: %r: a .grad of its plan was dropped while resident: the plan is forgotten (the "
                 "baseline of skip_unchanged is carried to the next plan)", ferry)
    ferry._set.drop_arena()
    ferry._set.disarm_early()
    ferry._set.forget(carry=True)  # see [Note: a baseline carried across a re-plan] in _schedules/unchanged.py
