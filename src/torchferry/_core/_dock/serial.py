"""A dock's calls one thread at a time.

[Note: one thread drives a dock]
A dock's decision reads its records, moves sets and writes the records. Two threads inside one dock
interleaved those steps: a set inside one thread's ``use()`` was reported evicted by ``is_resident``, and a
``use()`` ran in the middle of another thread's, between a claimant's ``sleep()`` and the records of it. So
every call of a ``Dock`` (and the decision a target's ``load_state_dict`` asks for) holds the dock's
:class:`DockLock`: a second thread waits for the call under way, and the thread inside may call in again (a
callback of the caller's run by the call). The body of a ``use()`` holds nothing, so threads may use sets of
one dock side by side (a set in use by any thread is never a victim). A call that cannot get the lock within
:data:`WAIT_S` (a callback of the call under way waiting on the thread that calls) is refused, naming the
thread and its call, before anything is read or moved. Ferries refuse a second thread at once instead
([Note: one thread moves a ferry] in ``_ferry/misuse.py``): a dock's move of a ferry that another thread
moves itself raises, and the move is undone ([Note: all or nothing] in ``_ferry/interrupts.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._transfer.signals import deferred

__all__ = ["WAIT_S", "DockLock", "serialized"]

WAIT_S = 60.0
"""Seconds a dock's call waits for another thread's call to return before it is refused."""

_F = TypeVar("_F", bound=Callable[..., Any])


class DockLock:
    """A re-entrant lock that knows which thread holds it and in which call, for the refusal."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: threading.Thread | None = None
        self._call = ""
        self._depth = 0

    @contextlib.contextmanager
    def held(self, call: str, what: Callable[[], str]) -> Iterator[None]:
        """The block as ``call`` of the dock ``what()`` describes, once no other thread is inside one.

        Raises:
            RuntimeError: another thread's call did not return within :data:`WAIT_S`; nothing was moved.
        """
        if not self._lock.acquire(timeout=WAIT_S):
            owner = self._owner
            raise RuntimeError(
                f"torchferry: {call} refused: {what()} is being driven by another thread "
                f"({owner.name if owner else '?'!r}, in {self._call or '?'}) that did not return within "
                f"{WAIT_S:g} s (does a callback of that call wait for this thread?); a dock runs one call at "
                "a time. Nothing was moved")
        try:
            if self._depth == 0:
                self._owner, self._call = threading.current_thread(), call
            self._depth += 1
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._owner, self._call = None, ""
            self._lock.release()


def serialized(call: str, fn: _F) -> _F:
    """``fn``, a method of a ``Dock``, run under its engine's :class:`DockLock` as ``call``."""

    @functools.wraps(fn)
    def one_at_a_time(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine
        # SIGINT / SIGTERM held back for the call, the lock's bookkeeping included: one arriving between the
        # lock's acquire and its try left the lock held for good ([Note: all or nothing] in _ferry/interrupts.py)
        with deferred(), engine.lock.held(call, engine.label):
            return fn(self, *args, **kwargs)

    return one_at_a_time  # type: ignore[return-value]
