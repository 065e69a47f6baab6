"""A process-wide optimizer step pre-hook that exists only while something needs it.

Layer-wise reload must complete before *any* optimizer steps (an optimizer
outside the ferry could update a parameter still on the host) and offload
during forward must forget its early copies after any step (a DTensor's
``_foreach_`` updates bump no version counter). Both use a
:class:`GlobalStepHook`: torch's global step pre-hook is registered when the
first entry is added and then stays, an empty loop when nothing is under way.

[Note: a global step hook is never removed]
Removing it with its last entry broke ``optimizer.step()``: the last entry
often goes from inside a step (the reload that the hook completes removes
itself), while torch iterates its dict of global pre-hooks, and any hook
registered after ours (``offload_during_forward()``'s, a ``skip_unchanged``
ferry's, the user's own) then raised ``OrderedDict mutated during
iteration``: the step did not run. A registered, empty hook costs a Python
call per step.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["GlobalStepHook"]


class GlobalStepHook:
    """Calls every registered function before any optimizer's ``step()``."""

    def __init__(self) -> None:
        self._entries: dict[int, Callable[[], object]] = {}
        self._handle = None

    def add(self, key: int, fn: Callable[[], object]) -> None:
        """Registers ``fn`` under ``key`` (replacing an earlier one)."""
        self._entries[key] = fn
        self.install()

    def install(self) -> None:
        """Registers torch's global hook if not yet: call it outside any step before an entry may
        be added from inside one (registering while torch iterates its hooks would break that step)."""
        if self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handle = register_optimizer_step_pre_hook(self._run)

    def discard(self, key: int) -> None:
        """Removes ``key``'s function (the torch hook stays: [Note: a global step hook is never removed])."""
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def _run(self, optimizer: object, args: object, kwargs: object) -> None:
        if self._entries:
            for fn in list(self._entries.values()):
                fn()
