"""Ctrl-C held back while a transfer call re-points tensors, so that no call is left half done.

[Note: all or nothing]
A transfer call (``offload``, ``reload``, a reconcile, a layer-wise reload's
start) changes three kinds of state: device storages (allocated, copied,
released), tensor objects (their impls exchanged with parked twins, see
[Note: parked TensorImpls]) and the ferry's own records (residency, guards,
plan, the baseline of [Note: unchanged storages]). An exception between two
of those changes used to leave them disagreeing: residency HOST with the
tensors on the device, guards still raising, and a retried ``reload()`` that
exchanged the impls a second time, so the parameters ended up with the host
twins' impls and every autograd hook registered on them silently stopped
firing (DDP's reducer, optimizer-in-backward).

Two mechanisms make every call all or nothing:

1. Synchronous exceptions (any ``BaseException``: an out-of-memory, an error
   in a hash, a ``KeyboardInterrupt`` or ``SystemExit`` raised by code the
   call runs): each call does its fallible work first (allocations, copies,
   re-pointing, which undo themselves) and records its decisions last; a
   ``try`` around the whole call undoes what was done, in reverse, before the
   exception leaves it. The state is then as before the call, and a retry
   runs on a clean slate. ``tests/cpu/test_faults.py`` raises at every
   torchferry function call of offload, reload, reconcile, the baseline hash
   and a layer-wise reload's start, one run per call, and checks values,
   residency, guards and that every hook fires once after the retry.
2. Asynchronous ``KeyboardInterrupt`` (SIGINT arrives between any two Python
   bytecodes, also inside an undo): :func:`interrupts_deferred` holds SIGINT
   back for the call (its host part: milliseconds on a GPU, where the copies
   run on streams) and raises ``KeyboardInterrupt`` once the call has
   completed or been undone. A second SIGINT during the call raises at once
   (the user insists; that call may then be torn). Only in the main thread,
   and only while Python's own handler is installed: a handler of the
   caller's is left alone.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["interrupts_deferred"]

_F = TypeVar("_F", bound=Callable)

_state = threading.local()


@contextlib.contextmanager
def _deferred() -> Iterator[None]:
    if getattr(_state, "depth", 0):  # nested (swap -> offload): the outermost call holds SIGINT
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending: list[object] = []

    def hold(signum: int, frame: object) -> None:
        if pending:  # the second Ctrl-C: raise now
            raise KeyboardInterrupt
        pending.append(frame)

    signal.signal(signal.SIGINT, hold)
    _state.depth = 1
    try:
        yield
    finally:
        _state.depth = 0
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


def interrupts_deferred(fn: _F) -> _F:
    """Decorator: SIGINT received during ``fn`` raises ``KeyboardInterrupt`` after it returns or
    raises ([Note: all or nothing]); an exception ``fn`` raised itself takes precedence."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _deferred():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
