"""TransferHandle (``_api/handle.py``): completion, callbacks.
"""

from __future__ import annotations

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
    """Reproduces a report of the adversarial review of prefetch, swap, packing, stats and
    the verl integration (failed before its fix): Ferry.offload()/reload() register ferry._completed (the stats update) on the handle; a
    user's add_done_callback on an in-flight GPU handle replaces it, so ferry.stats never gets the
    seconds (last_*_s stays None, *_seconds under-counted)."""
    ev = _FakeEvent()
    h = TransferHandle("h2d", 10, ev)
    called = []
    h.add_done_callback(lambda _: called.append("ferry stats"))
    h.add_done_callback(lambda _: called.append("user"))
    h.wait()
    assert called == ["ferry stats", "user"], called
