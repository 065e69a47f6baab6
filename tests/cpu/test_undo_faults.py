"""A move whose undo fails too stays consistent: the undo of a release that failed part-way either
gives every storage its bytes back (DEVICE) or, where allocating again fails, completes the release
instead (HOST, a reload brings every byte back): [Note: a release rolled forward] in
``torchferry._core._transfer.release``; and no signal tears an undo ([Note: an undo is not
interrupted] in ``torchferry._core._transfer.signals``).

Reproduces the report against 973bb61: the offload's second ``resize_(0)`` raising and the undo's
re-allocation raising ``OutOfMemoryError`` left the ferry DEVICE with 0-byte storages (a forward
raised); so did a third SIGINT arriving inside the undo (the second is delivered at once).
"""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch
from torch import nn

import torchferry
from torchferry import Ferry
from tests.cpu.test_faults import _REAL_RESIZE, MOVES, _check_move_after, _on_pool, _plain_case, _resize_calls
from tests.helpers import assert_same, snapshot

SIGINT = "sigint"


class _Faults:
    """Stands in for ``UntypedStorage.resize_``: at call ``i``, ``actions[i]`` is raised (an exception
    type), or (:data:`SIGINT`) this process is sent a real SIGINT before the call runs."""

    def __init__(self, actions: dict[int, object]) -> None:
        self.actions, self.calls = actions, 0

    def __call__(self, storage: torch.UntypedStorage, size: int):
        i, self.calls = self.calls, self.calls + 1
        action = self.actions.get(i)
        if action == SIGINT:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode: here
        elif action is not None:
            raise action(f"injected at resize_ call {i} (size {size})")  # type: ignore[operator]
        return _REAL_RESIZE(storage, size)

    @property
    def method(self):
        return lambda storage, size: self(storage, size)


def _check_whole_or_offloaded(case, expected: dict, what: str) -> None:
    """DEVICE with every storage whole, or on the host with every tensor on the pool and the forward
    guarded; the values bit-exact either way (on the host: after a reload)."""
    r = case.ferry.residency
    tensors = [t for t in case.tensors() if t.numel()]
    if r.on_host:
        assert all(_on_pool(case)), f"{what}: residency {r.name}, tensors on the pool {_on_pool(case)}"
        with pytest.raises(RuntimeError, match="offloaded"):
            case.model(case.x)
        case.ferry.reload()
        assert case.ferry.residency is torchferry.Residency.DEVICE, what
    else:
        assert r is torchferry.Residency.DEVICE, what
        assert not any(_on_pool(case)), f"{what}: DEVICE but tensors on the pool"
    short = [t.shape for t in tensors
             if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()]
    assert not short, f"{what}: residency {r.name} with storages too small for {short}"
    assert_same(snapshot(case.model, case.opt), expected)


def _double_fault_sweep(name: str, actions_at) -> None:
    """Runs the move once per ``resize_`` call ``k`` it makes, with ``actions_at(k)``; checks the state
    (:func:`_check_whole_or_offloaded`) and that the move and a full cycle work after."""
    prepare, op, retry = MOVES[name]
    n = _resize_calls(name, False)
    for k in range(n):
        case = _plain_case(False)
        other = prepare(case)
        expected = snapshot(case.model, case.opt)
        fault = _Faults(actions_at(k))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.UntypedStorage, "resize_", fault.method)
            with pytest.raises(BaseException):  # noqa: B017 (which one depends on where the faults land)
                op(case, other)
        what = f"{name}: faults {fault.actions} of {n} resize_ calls"
        _check_whole_or_offloaded(case, expected, what)
        _check_move_after(case, other, retry, expected, what)


_UNDO_FAULTS = (torch.OutOfMemoryError, KeyboardInterrupt, RuntimeError, SystemExit)


@pytest.mark.parametrize("later", [1, 2], ids=["undo's first call", "undo's second call"])
@pytest.mark.parametrize("name", list(MOVES))
def test_every_move_stays_consistent_when_its_undo_fails_too(name, later):
    """A ``RuntimeError`` at each ``resize_`` call ``k`` of the move, then another fault at call
    ``k + later`` (inside the undo when ``k`` is in the release: allocating again fails; an
    out-of-memory, a ``KeyboardInterrupt``, ... in turn)."""
    _double_fault_sweep(name, lambda k: {k: RuntimeError, k + later: _UNDO_FAULTS[k % len(_UNDO_FAULTS)]})


@pytest.mark.parametrize("name", list(MOVES))
def test_every_move_stays_consistent_under_three_sigints(name):
    """Three real SIGINTs sent from inside three consecutive ``resize_`` calls: the first is held,
    the second is delivered at once (a ``KeyboardInterrupt`` inside the release), the third arrives
    inside the undo, which holds it until it is done."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _double_fault_sweep(name, lambda k: {k: SIGINT, k + 1: SIGINT, k + 2: SIGINT})
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_offload_whose_undo_runs_out_of_memory_completes_and_raises_the_release_error(monkeypatch):
    """The smallest case of the report: the offload's second ``resize_(0)`` raises and the undo's
    re-allocation runs out of memory: the offload completes (HOST, forward guarded, every storage
    freed), raises the release's error with the undo's as its cause, and a reload is bit-exact."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    ferry = Ferry(m, device="cpu")
    want = {k: v.clone() for k, v in m.state_dict().items()}
    storages = [p.untyped_storage() for p in m.parameters()]
    fault = _Faults({1: RuntimeError, 2: torch.OutOfMemoryError})
    with monkeypatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", fault.method)
        with pytest.raises(RuntimeError, match="resize_ call 1") as info:
            ferry.offload()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert ferry.residency is torchferry.Residency.HOST
    assert [s.nbytes() for s in storages] == [0] * 4
    with pytest.raises(RuntimeError, match="offloaded"):
        m(torch.ones(2, 1024))
    ferry.reload()
    assert [s.nbytes() for s in storages] == [p.numel() * 4 for p in m.parameters()]
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k
    ferry.offload()
    ferry.reload()
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_swap_schedule_takes_everything_when_its_undo_fails():
    """A swap's ``hold()`` frees the storages skipped as unchanged; if that fails part-way and the
    undo's re-allocation fails too, it completes instead: all of them freed, the rest taken
    pending, and ``release_rest()`` frees exactly those."""
    from torchferry._core._schedules.release import ReleaseSchedule
    from torchferry._core._state.plan import build_plan, storage_bytes
    from torchferry._core._transfer.copies import D2HIssued
    from torchferry._core._transfer.release import ReleaseRolledForward
    from torchferry._core._transfer.streams import streams_for

    ts = [torch.randn(1024, generator=torch.Generator().manual_seed(i)) for i in range(4)]  # 4 KiB each
    plan = build_plan(ts)
    sources = [storage_bytes(s, plan.device) for s in plan.storages]
    slots = [src.clone() for src in sources]  # the pool's copies
    ev = types.SimpleNamespace(synchronize=lambda: None)
    issued = D2HIssued(None, None, [(4096, ev), (8192, ev)], [0, 0, 4096, 8192])
    sched = ReleaseSchedule(budget_bytes=16384, base_bytes=16384)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", _Faults({1: RuntimeError, 2: torch.OutOfMemoryError}).method)
        with pytest.raises(ReleaseRolledForward) as info:
            sched.hold(plan, sources, slots, issued, streams_for(torch.device("cpu")), {0, 1})
    assert isinstance(info.value.error, RuntimeError) and isinstance(info.value.undo_error, torch.OutOfMemoryError)
    assert [s.nbytes() for s in plan.storages] == [0, 0, 4096, 4096]
    assert all(torch.equal(slot.view(torch.float32), t0) for slot, t0 in zip(slots, [
        torch.randn(1024, generator=torch.Generator().manual_seed(i)) for i in range(4)], strict=True))
    sched.release_rest()
    assert [s.nbytes() for s in plan.storages] == [0, 0, 0, 0]


def test_an_undo_holds_even_a_second_sigint_until_it_is_done():
    """Inside ``uninterruptible()`` (an undo), two SIGINTs are both held, even within a call that
    delivers the second at once, and both delivered once the call is done."""
    from torchferry._core._transfer.signals import deferred, uninterruptible

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                with uninterruptible():
                    for i in range(2):
                        os.kill(os.getpid(), signal.SIGINT)
                        steps.append(i)
                steps.append("undo done")
        assert steps == [0, 1, "undo done"]
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
                steps.append("held")
                os.kill(os.getpid(), signal.SIGINT)  # outside an undo: the second is delivered at once
                steps.append("not reached")
        assert steps[-1] == "held"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
