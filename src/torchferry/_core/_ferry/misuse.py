"""Misuse refused before anything moves: a second thread inside a ferry's call, and the caller's
``torch.inference_mode()`` kept out of the ferry's own bookkeeping.

[Note: one thread moves a ferry]
A ferry's call (``offload``, ``reload``, ``swap``, ``close``, ...) changes device storages, tensor
impls and the ferry's records in steps that are only consistent once the call is done ([Note: all
or nothing] in ``.interrupts``). Two threads inside one ferry at once interleave those steps: one
``Ferry`` driven from two threads segfaulted in 3 of 10 runs, and in another setup exchanged the
impls twice, so every weight read freed memory (the forward returned ``-inf``) while the ferry
reported DEVICE. So each ferry has a :class:`OneMover`: a call made while another
thread is inside one of the ferry's calls is refused at once with a ``RuntimeError`` naming that
thread and its call, before anything is read or moved; nothing waits, so two ferries moved by two
threads in opposite orders (``swap(a, b)`` beside ``swap(b, a)``) cannot deadlock. The thread
already inside may enter again (a hook of the caller's run by the call, ``swap`` calling
``_offload``). torchferry's own threads (the H2D issuer of ``_schedules/issuer``, the pin thread of
``_host/pool``) never call a ferry's methods: they are handed jobs, and the caller's thread waits for
them while it holds the ferry.

[Note: the ferry's bookkeeping outside inference mode]
Tensors made under ``torch.inference_mode()`` are inference tensors: an in-place write to one
outside inference mode raises ("Inplace update to inference tensor outside InferenceMode"). A
first ``offload()`` under inference mode made the pool's views, the host twins and the plan's
device views as inference tensors, and every later ``reload()`` (outside it) failed inside
torchferry while writing them; the ferry was jammed. Every call that moves state
therefore runs with inference mode off (``torch.inference_mode(False)``) and gradients off
(``torch.no_grad()``): what the ferry makes is the same whatever mode its caller is in. Inference
mode is per thread, so the issuer and pin threads are made outside it already.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from .._state.tree import tree_memo
from .gc import gc_paused
from .interrupts import interrupts_deferred

__all__ = ["NotCopyable", "OneMover", "moves_state"]

_F = TypeVar("_F", bound=Callable)


class NotCopyable:
    """``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the object refused in one line: a
    ferry holds device streams, a host pool, locks and weak references to its targets, none of which a copy
    could share or rebuild (Python's own errors named a weakref or a lock)."""

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError(f"torchferry: a {type(self).__name__} cannot be copied or pickled (it holds device streams, "
                        "a host pool and weak references to its targets); copy or save the modules and optimizers "
                        f"(their state_dict()) and make a new {type(self).__name__} over the copy")


class OneMover:
    """Who is inside a ferry's calls: one thread at a time, re-entrant ([Note: one thread moves a ferry])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields below only; never held across a call
        self._owner: threading.Thread | None = None
        self._call = ""  # the outermost call under way
        self._depth = 0

    def busy_elsewhere(self) -> bool:
        """Whether another thread is inside one of the ferry's calls now."""
        owner = self._owner
        return owner is not None and owner is not threading.current_thread()

    @contextlib.contextmanager
    def entered(self, call: str, what: Callable[[], str]) -> Iterator[None]:
        """The block as ``call`` (e.g. ``"offload()"``) of the ferry ``what()`` describes.

        Raises:
            RuntimeError: another thread is inside one of its calls; nothing was read or moved.
        """
        me = threading.current_thread()
        with self._lock:
            owner = self._owner
            if owner is not None and owner is not me:
                raise RuntimeError(
                    f"torchferry: {call} refused: {what()} is being moved by another thread ({owner.name!r}, "
                    f"in {self._call}); a ferry is moved by one thread at a time: wait for that call to "
                    "return, or give each thread its own ferry. Nothing was moved")
            if owner is None:
                self._owner, self._call = me, call
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner, self._call = None, ""


def moves_state(call: str) -> Callable[[_F], _F]:
    """Decorator for a ``Ferry`` method that moves or changes state: one thread at a time ([Note: one
    thread moves a ferry]), SIGINT / SIGTERM held back ([Note: all or nothing]), inference mode and
    gradients off ([Note: the ferry's bookkeeping outside inference mode]), the cyclic GC paused
    ([Note: GC pause]) and each module tree walked once ([Note: module walks])."""

    def wrap(fn: _F) -> _F:
        inner = torch.inference_mode(False)(torch.no_grad()(gc_paused()(tree_memo()(fn))))

        @functools.wraps(fn)
        @interrupts_deferred  # around the mover's bookkeeping too: a signal between its lock and its try left
        def wrapper(self, *args, **kwargs):  # the lock held (every later call hung) or the ferry owned for good
            with self._mover.entered(call, self.__repr__):
                return inner(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap
