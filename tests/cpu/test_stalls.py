"""[Note: stalls recorded] (``_core/_transfer/streams.py``) on the CPU: a wait outside a recording is the
stream's own ``wait_event``; recordings nest; the verl step bench's report attributes calls plus stalls."""

import sys
from pathlib import Path

import pytest

from torchferry._core._transfer import streams


def _exposed(views):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from verl_step.report import _exposed

    return _exposed(views)


def _rank0(step_s, stalls, events=()):
    """A strategy's records as the report reads them: rank 0's steps, one phase, its calls and stalls."""
    return {"per_rank": [{"step_s": step_s, "phase_s": [{"update": x} for x in step_s], "events": list(events),
                          "stall_s": stalls}]}


class _Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_a_wait_outside_a_recording_is_the_streams_own():
    s, ev = _Stream(), object()
    streams.wait_event(s, ev)  # type: ignore[arg-type]
    assert s.waited == [ev]


def test_recordings_nest_and_an_empty_one_counts_nothing():
    with streams.record_stalls() as outer:
        with streams.record_stalls() as inner:
            assert streams._recording.get()[-1] is inner.pairs
        assert streams._recording.get() == (outer.pairs,)
    assert streams._recording.get() == ()
    assert (outer.count, outer.seconds(), inner.count) == (0, 0.0, 0)


def test_a_recording_left_out_of_order_records_nothing_more(monkeypatch):
    """Two recordings entered a-b and left a-b: once ``a`` is left, waits go to ``b`` only, and after ``b``
    to none (a reset by token put ``a``'s list back when ``b`` was left, recording into it for good)."""

    class _Event:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream: object) -> None:
            pass

    monkeypatch.setattr(streams.torch.cuda, "Event", _Event)
    s = _Stream()
    a, b = streams.record_stalls(), streams.record_stalls()
    ra, rb = a.__enter__(), b.__enter__()
    a.__exit__(None, None, None)
    streams.wait_event(s, object())  # type: ignore[arg-type]
    b.__exit__(None, None, None)
    streams.wait_event(s, object())  # type: ignore[arg-type]
    assert (ra.count, rb.count, len(s.waited), streams._recording.get()) == (0, 1, 2, ())


def test_the_report_attributes_calls_and_stalls_per_round():
    call = [{"step": st, "phase": "update", "seconds": 0.5, "host_s": 0.4} for st in (1, 2)]
    views = {"resident": _rank0([5.0, 1.0, 1.2], []),
             "verl": _rank0([6.0, 2.0, 2.1], [{}, {}, {}], [{**e, "seconds": 1.0} for e in call]),
             "torchferry": _rank0([5.5, 1.4, 1.5], [{"update": 9.0}, {"update": 0.25}, {"update": 0.05}], call)}
    out = _exposed(views)
    tf = out["torchferry"]
    assert tf["attributed_s_per_step"]["all"] == [0.75, 0.55]  # the first round is left out
    assert tf["stall_s_per_phase"] == {"update": 0.15}
    assert out["verl"]["attributed_s_per_step"]["all"] == [1.0, 1.0]
    assert tf["attributed_over_verl"] == 0.65


def test_the_report_reads_a_missing_rounds_stalls_as_none():
    views = {"resident": _rank0([5.0, 1.0, 1.2], []), "verl": _rank0([6.0, 2.0, 2.1], [{}, {}, {}]),
             "torchferry": _rank0([5.5, 1.4, 1.5], [None, None, {"update": 0.25}])}
    assert _exposed(views)["torchferry"]["attributed_s_per_step"]["all"] == [0.0, 0.25]


def test_the_report_takes_phases_a_round_lacks_and_a_run_without_verl():
    """A phase missing from a round (a strategy that skipped it, a round cut short) is left out of that
    round's difference; a run without verl's strategy has no ratios instead of a KeyError."""
    base = _rank0([5.0, 1.0, 1.2], [])
    base["per_rank"][0]["phase_s"] = [{"update": 5.0}, {"update": 1.0, "ref": 0.5}, {"update": 1.2}]
    tf = _rank0([5.5, 1.4, 1.5], [{}, {}, {}])
    tf["per_rank"][0]["phase_s"] = [{"update": 5.5}, {"update": 1.4}, {"update": 1.5, "ref": 0.3}]
    out = _exposed({"resident": base, "torchferry": tf})
    phases = out["torchferry"]["exposed_s_per_phase"]
    assert phases["update"] == pytest.approx(0.35) and phases["ref"] is None  # no round has ref in both
    assert "over_verl" not in out["torchferry"]
    assert out["resident_phase_s"]["ref"]["all"] == [0.5]


def test_a_ratio_to_a_verl_figure_under_its_own_spread_is_none():
    """verl's exposed seconds 0.02 [-0.3, 0.4]: a ratio to it (here 25x) would decide nothing."""
    views = {"resident": _rank0([5.0, 1.0, 1.0, 1.0], []),
             "verl": _rank0([6.0, 0.7, 1.02, 1.4], [{}, {}, {}, {}]),
             "torchferry": _rank0([5.5, 1.5, 1.5, 1.5], [{}, {}, {}, {}])}
    out = _exposed(views)
    assert out["torchferry"]["exposed_transfer_s_per_step"]["median"] == 0.5
    assert out["torchferry"]["over_verl"] is None
