"""Pinning ahead (``_ferry/pin_ahead.py``, [Note: pin ahead]) and the quiet background pool it uses:
started at once or after the optimizer's first step, once, never raising into training."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

from torchferry._core._host.budget import HostBudgetError
from torchferry._core._ferry.pin_ahead import PinAhead
from torchferry._core._state.plan import build_plan
from torchferry._core._host.pool import HostPool


class _FakeHost:
    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[dict] = []
        self.error = error

    def reserve(self, plan, *, background=False, quiet=False, skip_grads=False):
        self.calls.append({"plan": plan, "background": background, "quiet": quiet, "skip_grads": skip_grads})
        if self.error is not None:
            raise self.error
        return "future"


class _FakeState:
    """The two things PinAhead uses of a StateSet, on a device it takes for a GPU."""

    def __init__(self, targets, error=None, device="cuda") -> None:
        self.device = torch.device(device)
        self.device_fixed = True
        self.host = _FakeHost(error)
        self.pool = HostPool(pin=False)  # empty: pinning ahead only starts on an empty pool
        self._targets = targets

    def plan(self):
        return build_plan(self._targets, torch.device("cpu"))


def _model_and_opt():
    m = nn.Linear(8, 8)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def _step(m, opt):
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_starts_at_once_in_the_background_when_the_state_is_complete():
    m, opt = _model_and_opt()
    _step(m, opt)  # the optimizer has its state
    st = _FakeState((m, opt))
    ahead = PinAhead.arm(st, st.plan())
    assert len(st.host.calls) == 1 and st.host.calls[0]["background"] and st.host.calls[0]["quiet"]
    assert st.host.calls[0]["plan"].state_bytes == st.plan().state_bytes
    assert not st.host.calls[0]["skip_grads"]  # at construction: the state as it is
    assert ahead.claim() == "future" and ahead.claim() is None  # handed out once


def test_waits_for_the_first_optimizer_step_then_starts_once():
    m, opt = _model_and_opt()  # no optimizer state yet: a pool sized now would be too small
    st = _FakeState((m, opt))
    params_only = st.plan().state_bytes
    ahead = PinAhead.arm(st, st.plan())
    assert st.host.calls == [] and ahead.future is None
    _step(m, opt)
    assert len(st.host.calls) == 1 and st.host.calls[0]["skip_grads"]  # grads still exist right after step()
    assert st.host.calls[0]["plan"].has_grads and st.host.calls[0]["plan"].state_bytes > 3 * params_only
    _step(m, opt)
    assert len(st.host.calls) == 1  # the hook removed itself


def test_not_armed_on_the_cpu():
    m, _ = _model_and_opt()
    st = _FakeState((m,), device="cpu")
    assert PinAhead.arm(st, st.plan()) is None and st.host.calls == []


@pytest.mark.parametrize("error", [HostBudgetError("over the node's budget", 10, 5), RuntimeError("cudaHostRegister failed")])
def test_a_failure_is_logged_not_raised(error, caplog):
    m, _ = _model_and_opt()
    st = _FakeState((m,), error=error)
    with caplog.at_level(logging.INFO, logger="torchferry"):
        ahead = PinAhead.arm(st, st.plan())
    assert ahead.future is None and "first offload pins instead" in caplog.text


def test_a_dropped_ferry_does_not_pin_after_the_step():
    m, opt = _model_and_opt()
    st = _FakeState((m, opt))
    ahead = PinAhead.arm(st, st.plan())
    del ahead
    gc.collect()
    _step(m, opt)
    assert st.host.calls == []


def test_cancel_removes_the_step_hook():
    m, opt = _model_and_opt()
    st = _FakeState((m, opt))
    PinAhead.arm(st, st.plan()).cancel()
    _step(m, opt)
    assert st.host.calls == []


def test_quiet_background_failure_leaves_an_empty_pool_and_the_next_reserve_allocates(monkeypatch):
    import torchferry._core._host.pool as pool_mod

    real = pool_mod.HostBuffer
    fail = {"n": 1}

    def flaky(nbytes, **kw):
        if fail["n"]:
            fail["n"] -= 1
            raise RuntimeError("cudaHostRegister failed")
        return real(nbytes, **kw)

    monkeypatch.setattr(pool_mod, "HostBuffer", flaky)
    pool = HostPool(pin=False)
    fut = pool.reserve(4096, background=True, quiet=True)
    with pytest.raises(RuntimeError):
        fut.result(timeout=30)  # the future itself still tells
    pool.reserve(4096)  # no raise from the failed background one: it allocates now
    assert pool.nbytes == 4096 and pool.view(0, 16).numel() == 16


def test_loud_background_failure_raises_at_the_next_use(monkeypatch):
    import torchferry._core._host.pool as pool_mod

    def broken(nbytes, **kw):
        raise RuntimeError("cudaHostRegister failed")

    monkeypatch.setattr(pool_mod, "HostBuffer", broken)
    pool = HostPool(pin=False)
    pool.reserve(4096, background=True)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pool.view(0, 16)


def test_a_second_background_reserve_gets_the_pending_future():
    pool = HostPool(pin=False)
    first = pool.reserve(1 << 20, background=True)
    assert pool.reserve(1 << 20, background=True) is first
    assert first.result(timeout=30) >= 0 and pool.nbytes == 1 << 20


def test_skip_grads_sizes_the_pool_for_the_state_after_zero_grad():
    from torchferry._core._host.layout import HostLayout

    m, opt = _model_and_opt()
    m(torch.ones(2, 8)).sum().backward()
    opt.step()  # grads still set, as in a step post-hook
    host = HostLayout(HostPool(pin=False), None)
    host.reserve(build_plan((m, opt), torch.device("cpu")), skip_grads=True)
    opt.zero_grad(set_to_none=True)
    after = build_plan((m, opt), torch.device("cpu"))
    assert not after.has_grads and host.pool.nbytes == host.layout(after).total  # exact, no grads


def test_another_step_post_hook_after_ours_still_runs_and_step_completes():
    """Our hook must not remove itself while torch iterates over the step post-hooks
    (that raised 'OrderedDict mutated during iteration' after the parameters were updated)."""
    m, opt = _model_and_opt()
    st = _FakeState((m, opt))
    ahead = PinAhead.arm(st, st.plan())
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(1))
    _step(m, opt)
    _step(m, opt)
    assert seen == [1, 1] and len(st.host.calls) == 1
    ahead.cancel()


def test_waits_until_every_optimizer_without_state_has_stepped():
    m1, o1 = _model_and_opt()
    m2, o2 = _model_and_opt()
    st = _FakeState((m1, m2, o1, o2))
    params_only = st.plan().state_bytes
    ahead = PinAhead.arm(st, st.plan())
    _step(m1, o1)
    assert st.host.calls == []  # o2 has no state yet: a pool sized now would be too small
    _step(m2, o2)
    assert len(st.host.calls) == 1 and ahead.future == "future"
    adam = sum(v.untyped_storage().nbytes() for o in (o1, o2) for st_ in o.state.values()
               for v in st_.values() if torch.is_tensor(v))
    assert adam >= 2 * params_only  # exp_avg and exp_avg_sq of both models' parameters
    assert st.host.calls[0]["plan"].state_bytes >= params_only + adam  # sized for both optimizers' state


def test_not_started_once_the_pool_holds_a_block():
    """After an offload the pool holds the state; growing it from the step hook could drop a block
    an H2D copy still reads: pinning ahead stays out."""
    m, opt = _model_and_opt()
    st = _FakeState((m, opt))
    PinAhead.arm(st, st.plan())
    st.pool.reserve(4096)  # an offload happened before the first step
    _step(m, opt)
    assert st.host.calls == []


def test_optimizer_only_ferry_before_its_first_step_is_armed_from_its_parameters_device(monkeypatch):
    """No tensor yet, no device given: the parameters' device says where the state will be."""
    import torchferry._core._ferry.pin_ahead as pa

    m, opt = _model_and_opt()
    st = _FakeState((opt,), device="cpu")
    st.device_fixed = False
    assert pa._param_device([opt]) == torch.device("cpu")
    assert PinAhead.arm(st, st.plan()) is None  # CPU parameters: nothing to pin
    monkeypatch.setattr(pa, "_param_device", lambda opts: torch.device("cuda", 0))
    ahead = PinAhead.arm(st, st.plan())
    assert ahead is not None and st.host.calls == []
    _step(m, opt)
    assert len(st.host.calls) == 1 and st.host.calls[0]["plan"].state_bytes > 0


def test_any_error_in_the_hook_is_logged_not_raised_into_step(caplog):
    m, opt = _model_and_opt()
    st = _FakeState((m, opt), error=MemoryError("no memory"))
    ahead = PinAhead.arm(st, st.plan())  # noqa: F841  (kept: the hook holds it weakly)
    with caplog.at_level(logging.INFO, logger="torchferry"):
        _step(m, opt)  # does not raise
    assert "first offload pins instead" in caplog.text
