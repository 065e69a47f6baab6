"""Hooks torchferry puts on a user's modules and optimizers, refusing to be copied with them.

[Note: a module copied while its state is away]
While a ferry holds a module's or optimizer's state on the host (offloaded, or coming back layer by
layer), its hooks are in the module's and optimizer's hook dicts, which ``copy.deepcopy`` and
``torch.save(model)`` copy with the rest: the pickle failed on a local function ("Can't pickle local
object 'OffloadGuards._forward_hook.<locals>.hook'") and the deep copy kept the forward guard, so the
copy refused every forward for good, naming a ferry that could never reload it.
A copy made then would also read the ferry's host pool while its D2H copies may still be in flight.
So each such hook is a :class:`Uncopyable`: copying or pickling it raises a ``RuntimeError`` saying
to reload first or to copy the ``state_dict()`` (which waits for the copies); the original is left
as it was (a deep copy and a pickle only read it). An optimizer object itself is not refused so:
PyTorch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, so its
hook dicts (and these hooks) are never copied (``docs/reliability.md``, "Not guaranteed").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EARLY", "PREFETCHING", "Uncopyable"]


class Uncopyable:
    """A hook (``fn``) that refuses ``copy.deepcopy``, ``copy.copy`` and pickling; ``during()`` says
    what is under way (``"its state is offloaded (Ferry(...))"``)."""

    __slots__ = ("_during", "_fn")

    def __init__(self, fn: Callable, during: Callable[[], str]) -> None:
        self._fn, self._during = fn, during

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def _refuse(self) -> RuntimeError:
        return RuntimeError(
            f"torchferry: cannot copy or pickle a module or optimizer while {self._during()}: its tensors "
            "view (or are being copied to) the ferry's host pool; reload it first (ferry.reload()), or copy "
            "or save its state_dict(), which waits for the copies; nothing was changed")

    def __deepcopy__(self, memo: object) -> object:
        raise self._refuse()

    def __copy__(self) -> object:
        raise self._refuse()

    def __reduce_ex__(self, protocol: object) -> object:
        raise self._refuse()


def PREFETCHING() -> str:  # noqa: N802  # what a layer-wise reload's hooks say
    return "a layer-wise reload is under way (reload(prefetch=...); ferry.reload() completes it)"


def EARLY() -> str:  # noqa: N802  # what an armed offload during forward's hooks say
    return "an offload during forward is armed (offload_during_forward(); the next offload() ends it)"
