"""Signals held back while a transfer call moves state (Ctrl-C, SIGTERM), so that no call is left half done.

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

Three mechanisms make every call all or nothing:

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
2. Asynchronous signals (SIGINT and SIGTERM arrive between any two Python
   bytecodes, also inside a release loop or an undo; Ray, Slurm and Kubernetes
   stop workers with SIGTERM, and a handler that calls ``sys.exit`` there used
   to leave storages freed under a ferry that reported DEVICE):
   :func:`interrupts_deferred` holds both back for the call (its host part:
   milliseconds on a GPU, where the copies run on streams) and delivers them,
   in arrival order, once the call has completed or been undone: Python's
   handler raises ``KeyboardInterrupt``, a handler of the caller's is called
   (its ``SystemExit`` then leaves the call), the default action of SIGTERM
   terminates the process. A second signal of one kind during the call is
   delivered at once (the sender insists; that call may then be torn),
   except inside an undo ([Note: an undo is not interrupted]). Only
   in the main thread (the only one Python runs handlers in), and only for a
   signal whose handler is Python's, the caller's or the default: an ignored
   signal, or one handled outside Python, is left alone. A signal held back
   is delivered also when the call raised: its handler's exception then
   leaves the call, with the call's own as its ``__context__``.
3. The release of device memory (``resize_(0)`` of each storage, the last step
   of an offload) is all or nothing itself: if freeing one raises, the storages
   freed before it are allocated again and given their bytes back from their
   pool slots, which hold them then ([Note: a release undone from the pool] in
   ``torchferry._core._transfer.release``), and the call is undone as in 1.
   Where that undo fails too (no memory to allocate again), the release is
   completed instead and the call completes before it raises ([Note: a release
   rolled forward]): either way no storage is left at 0 bytes under DEVICE.
   ``tests/cpu/test_faults.py`` raises at every storage of the release (and
   sends a real SIGTERM there) for offload, swap and a Dock's eviction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from .._transfer.signals import deferred

__all__ = ["interrupts_deferred"]

_F = TypeVar("_F", bound=Callable)


def interrupts_deferred(fn: _F) -> _F:
    """Decorator: SIGINT and SIGTERM received during ``fn`` are delivered after it returns or
    raises ([Note: all or nothing]): ``KeyboardInterrupt`` from Python's SIGINT handler, the
    caller's handler called, SIGTERM's default action."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with deferred():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
