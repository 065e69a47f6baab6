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

So while the state is resident a :class:`ResidentWatch` looks at the targets where the caller's code
next reads them: a module target's forward (a pre-hook, prepended: before FSDP2's all-gather), an
optimizer target's ``step()`` (pre-hook) and ``load_state_dict()`` (post-hook). At a forward it checks,
by identity, that each parameter of the plan still holds the gradient the plan holds (about 0.1 us per
parameter); at an optimizer's hooks, and where a gradient differs, it compares the targets' fingerprint
with the plan's (about 2 us per tensor). If a tensor is gone or replaced the plan is forgotten, as after
a reconcile: what the caller dropped is freed at once, and the next offload plans again (the
fingerprint changed: it would have anyway). The hooks go with the next offload (or ``close()``); they
do nothing while a layer-wise reload is under way (its own hooks hold the plan) or while ``torch.compile``
traces (a compiled forward checks nothing: its state is freed at the next offload, as before). They copy and
pickle as no-ops: a resident model may be deep-copied or saved whole.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._state.plan import fingerprint

__all__ = ["ResidentWatch", "forget_if_dropped", "grads_held", "grads_still_held"]


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
    """Hooks on a resident ferry's targets that let it forget its plan once the caller dropped part
    of the state ([Note: state dropped while resident]).

    Args:
        check: ``check(full)`` forgets the plan if the targets no longer match it (``full``: compare the
            whole fingerprint; else the cheap gradient check first) and returns whether to stop watching
            (:func:`forget_if_dropped`, given the ferry through a weak reference: hooks on the user's
            modules must not keep the ferry alive).
    """

    def __init__(self, check: Callable[[bool], bool]) -> None:
        self._check = check
        self._handles: list[RemovableHandle] = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Installs the hooks (once: a second call while armed does nothing)."""
        if self._handles:
            return
        ref = weakref.ref(self)

        def fire(full: bool) -> Callable[[], None]:
            def run() -> None:
                watch = ref()
                if watch is not None and watch._check(full):
                    watch.disarm()
            return run

        cheap, full = _Hook(fire(False)), _Hook(fire(True))
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(cheap, prepend=True))
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(full))
            self._handles.append(opt.register_load_state_dict_post_hook(full))

    def disarm(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()


def grads_held(tensors: list[torch.Tensor]) -> list[tuple[weakref.ref, weakref.ref]]:
    """Per parameter among ``tensors`` whose gradient is among them too: weak references to the
    parameter and that gradient, for :func:`grads_still_held`."""
    ids = {id(t) for t in tensors}
    return [(weakref.ref(t), weakref.ref(t.grad)) for t in tensors
            if isinstance(t, nn.Parameter) and t.grad is not None and id(t.grad) in ids]


def grads_still_held(pairs: list[tuple[weakref.ref, weakref.ref]]) -> bool:
    """Whether every parameter of ``pairs`` still holds its gradient (by identity)."""
    for p_ref, g_ref in pairs:
        p = p_ref()
        if p is None or p.grad is not g_ref() or p.grad is None:
            return False
    return True


def forget_if_dropped(ferry: Any, full: bool) -> bool:
    """``ferry``'s watch check ([Note: state dropped while resident]): forgets its plan if the targets
    dropped or replaced a tensor of it; returns whether to stop watching (the plan forgotten, the
    state offloaded or the ferry closed)."""
    if ferry is None or ferry._closed or ferry._offloaded is not None:
        return True
    run = ferry._prefetch
    if run is not None:
        if not run.finished:
            return False  # its hooks hold the plan: a later hook checks
        ferry._complete_prefetch()  # hands the finished layer-wise reload over, as any ferry call does
    cache = ferry._set.cache
    if cache is None:
        return True
    if not full and grads_still_held(ferry._watch_grads):
        return False
    if fingerprint(ferry._set.targets.resharded()) == cache.fingerprint:
        return False
    ferry._set.drop_arena()
    ferry._set.disarm_early()
    ferry._set.forget()  # what the caller dropped goes now; the next offload plans again
    ferry._watch_grads = []
    return True
