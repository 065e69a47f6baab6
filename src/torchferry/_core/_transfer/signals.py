"""SIGINT and SIGTERM held back while state moves: the mechanism of [Note: all or nothing]
(``torchferry._core._ferry.interrupts``, whose ``interrupts_deferred`` holds them for a whole call)
and of the undo sections no signal may tear (:func:`uninterruptible`, [Note: an undo is not
interrupted]).

[Note: an undo is not interrupted]
A second signal of one kind during a call is delivered at once (the sender
insists), so it can raise between any two bytecodes of the call, also inside
the undo of a release that failed part-way ([Note: a release undone from the
pool]). An undo torn there left storages of 0 bytes under a ferry that
reported DEVICE, the state it exists to prevent. So the undo sections (a
release undone or rolled forward, a reload's allocations freed again) run in
:func:`uninterruptible`: every signal arriving there, the second of a kind too,
is held until the section is done, and then delivered as any held signal (at
the end of the call, or at the end of the section outside one). These sections
make no blocking call but the wait for copies already queued, so the process
still answers a third Ctrl-C within that wait.

[Note: a signal between two handler swaps]
:func:`deferred` swaps two handlers in and two out, and a signal can arrive
between two swaps: a SIGTERM whose handler raises ``SystemExit`` after SIGINT's
hold was installed left that hold in place for good (every later Ctrl-C
swallowed); a Ctrl-C between the two restores left SIGTERM's hold in place and
the SIGTERM held during the call undelivered (found by sending real signals at
traced lines). So the swaps run inside the ``try`` whose ``finally`` restores
what it installed (each restore even if a signal raised in an earlier one) and
delivers what was held, and a hold still installed after the block delivers at
once, as the handler it stands for. Test:
``tests/cpu/test_faults.py::test_a_signal_between_two_handler_swaps_is_neither_lost_nor_left_held``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

__all__ = ["HELD_SIGNALS", "deferred", "uninterruptible"]

_state = threading.local()  # depth: calls holding signals (nested); strict: uninterruptible sections open

# The signals held back: Ctrl-C, and what Ray, Slurm and Kubernetes stop a worker with.
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _deliver(signum: int, handler: object, frame: object) -> None:
    """What ``signum`` would have done with ``handler`` installed (that handler is back in place)."""
    if callable(handler):
        handler(signum, frame)
    else:  # SIG_DFL: the default action (SIGTERM: the process ends)
        signal.raise_signal(signum)


def _each(items: list, fn: Callable[..., None]) -> None:
    """``fn(*item)`` for each item in order, every one even if an earlier call raised (or a signal's handler
    raised in between): the last exception leaves, each earlier one as its ``__context__``."""
    if items:
        try:
            fn(*items[0])
        finally:
            _each(items[1:], fn)


def _deliver_all(pending: list[tuple[int, object]], saved: dict[int, object]) -> None:
    """Delivers each held signal in arrival order, every one even if an earlier handler raised."""
    _each(pending, lambda signum, frame: _deliver(signum, saved[signum], frame))


def _restore(saved: list[tuple[int, object]], hold: object) -> None:
    """Each handler of ``saved`` back where ``hold`` still stands, every one even if a signal raised in between."""

    def put_back(signum: int, handler: object) -> None:
        if signal.getsignal(signum) is hold:
            signal.signal(signum, handler)  # type: ignore[arg-type]

    _each(saved, put_back)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds SIGINT and SIGTERM for the block and delivers them, in arrival order, when it is done
    (also when it raised); the second of a kind is delivered at once, except inside
    :func:`uninterruptible`. Nested blocks: the outermost holds. Only in the main thread, and only
    for a signal whose handler is Python's, the caller's or the default."""
    if getattr(_state, "depth", 0):  # nested (swap -> offload): the outermost call holds the signals
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    saved: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in HELD_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler) or handler is signal.SIG_DFL:  # SIG_IGN, or set outside Python: left alone
                saved[signum] = handler
    if not saved:
        yield
        return
    pending: list[tuple[int, object]] = []
    holding = [True]  # False once the block is done; see [Note: a signal between two handler swaps]

    def hold(signum: int, frame: object) -> None:
        first = not any(s == signum for s, _ in pending)
        if holding[0] and (first or getattr(_state, "strict", 0)):
            pending.append((signum, frame))
            return
        # the second of a kind (delivered now, once), or a hold left installed after the block: as the handler
        pending[:] = [(s, f) for s, f in pending if s != signum]
        signal.signal(signum, saved[signum])  # type: ignore[arg-type]
        _deliver(signum, saved[signum], frame)

    try:
        for signum in saved:
            signal.signal(signum, hold)
        _state.depth = 1
        yield
    finally:
        _state.depth = 0
        holding[0] = False
        try:
            _restore(list(saved.items()), hold)
        finally:
            _deliver_all(pending, saved)  # also when the call raised: a SIGTERM is never lost


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """Holds every SIGINT and SIGTERM arriving in the block, the second of a kind too, until it and
    the enclosing :func:`deferred` block (if any) are done ([Note: an undo is not interrupted])."""
    with deferred():
        _state.strict = getattr(_state, "strict", 0) + 1
        try:
            yield
        finally:
            _state.strict -= 1
