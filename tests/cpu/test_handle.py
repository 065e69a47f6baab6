"""TransferHandle (``_api/handle.py``): completion, callbacks.
"""

from __future__ import annotations

import torch

from torchferry import TransferHandle


class _FakeEvent:
    """Stands in for a CUDA event of an in-flight copy (the CPU path has none)."""

    def __init__(self):
        self.finished = False

    def query(self):
        return self.finished

    def synchronize(self):
        self.finished = True


def test_add_done_callback_keeps_every_callback_in_order():
    """A regression test (failed before its fix):
    Ferry.offload()/reload() register ferry._completed (the stats update) on the handle; a
    user's add_done_callback on an in-flight GPU handle replaces it, so ferry.stats never gets the
    seconds (last_*_s stays None, *_seconds under-counted)."""
    ev = _FakeEvent()
    h = TransferHandle("h2d", 10, ev)
    called = []
    h.add_done_callback(lambda _: called.append("ferry stats"))
    h.add_done_callback(lambda _: called.append("user"))
    h.wait()
    assert called == ["ferry stats", "user"], called


def test_a_handle_orders_everything_its_transfer_queued_not_only_the_copies():
    """[Note: a handle orders the whole transfer]: with a ``ready_event`` (a reload's baseline hash
    after its copies), ``done()``, ``wait()`` and ``wait_stream()`` follow it; ``event`` stays the
    copies' own (their timing)."""
    copies, ready = _FakeEvent(), _FakeEvent()
    h = TransferHandle("h2d", 10, copies, ready_event=ready)
    assert h.event is copies and h.ready_event is ready
    copies.finished = True
    assert not h.done()  # the copies are done, the hash after them is not
    h.wait()
    assert ready.finished and h.done()

    class _Stream(torch.Stream):  # records what it is made to wait for
        waited: list = []

        def wait_event(self, event):
            self.waited.append(event)

    s = _Stream()
    TransferHandle("h2d", 10, _FakeEvent(), ready_event=ready).wait_stream(s)
    assert s.waited == [ready]
    plain = _FakeEvent()
    TransferHandle("h2d", 10, plain).wait_stream(s)  # without one: the copies' event
    assert s.waited == [ready, plain]
