"""Copies queued by pointer through the CUDA driver ([Note: copies queued by pointer] in
``torchferry._core._transfer.driver``): from a thread that never touched CUDA, bit-exact both
ways with switch points between the pieces; a layer-wise reload issued from the thread goes
through them (and through ``copy_`` with ``TORCHFERRY_DRIVER_COPIES=0``), bit-exact either way;
a bad setting fails the reload before anything moved."""

from __future__ import annotations

import threading

import pytest
import torch

from torchferry import Ferry, Residency
from torchferry._core._host.memory import HostBuffer
from torchferry._core._schedules import groups, prefetch
from torchferry._core._transfer import driver
from torchferry._core._transfer.switch import SwitchPoints
from torchferry._public.env import DRIVER_ENV

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
NBYTES = (40 << 20) + 4321  # not a multiple of the piece


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            torch.cuda.set_device(DEV)
            out["value"] = fn()
        except BaseException as e:  # handed to the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_copies_by_pointer_from_a_fresh_thread_are_bit_exact_both_ways():
    host = HostBuffer(NBYTES, pin_bytes=NBYTES)
    back = HostBuffer(NBYTES, pin_bytes=NBYTES)
    host.tensor.copy_(torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    dev = torch.zeros(NBYTES, dtype=torch.uint8, device=DEV)
    stream = torch.cuda.Stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))  # the zeros are written before the copies

    def copies() -> tuple[int, int]:
        up, down = driver.queue_for("h2d", stream), driver.queue_for("d2h", stream)
        assert up is not None and down is not None
        sp_up, sp_down = SwitchPoints(DEV, "h2d", every=1 << 20), SwitchPoints(DEV, "d2h", every=3 << 20)
        sp_up.copy_by_pointer(up, dev.data_ptr(), host.tensor.data_ptr(), NBYTES)
        sp_down.copy_by_pointer(down, back.tensor.data_ptr(), dev.data_ptr(), NBYTES)
        stream.synchronize()
        return sp_up.separators, sp_down.separators

    assert _in_thread(copies) == (NBYTES >> 20, NBYTES // (3 << 20))
    assert torch.equal(dev.cpu(), host.tensor)
    assert torch.equal(back.tensor, host.tensor)


def test_a_refused_copy_raises_naming_the_result():
    stream = torch.cuda.Stream(DEV)
    up = driver.queue_for("h2d", stream)
    host = HostBuffer(4096, pin_bytes=4096)
    assert up is not None
    with pytest.raises(RuntimeError, match=r"refused a H2D copy of 16 bytes \(CUresult \d+\)"):
        up(0, host.tensor.data_ptr(), 16)  # to a null device pointer


def _optimizer_ferry():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, opt


def _step(m, opt):
    m(torch.ones(16, 2048, device=DEV)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_reload_from_the_issuer_thread_goes_by_pointer_unless_switched_off(monkeypatch, setting):
    monkeypatch.setenv(DRIVER_ENV, setting)
    monkeypatch.setattr(groups, "TAIL_PIECE_BYTES", 8 << 20)  # 268 MB of AdamW state: ~32 groups
    monkeypatch.setattr(prefetch, "ISSUE_WINDOW_BYTES", 24 << 20)  # the thread waits for the engine
    calls = {"n": 0, "waits": 0}
    real, real_wait = driver.DriverQueue.__call__, driver.DriverQueue.wait

    def counting(self, dst, src, nbytes):
        calls["n"] += 1
        return real(self, dst, src, nbytes)

    def counting_wait(self, event):
        calls["waits"] += 1
        return real_wait(self, event)

    monkeypatch.setattr(driver.DriverQueue, "__call__", counting)
    monkeypatch.setattr(driver.DriverQueue, "wait", counting_wait)
    ref, ref_opt = _optimizer_ferry()
    m, opt = _optimizer_ferry()
    _step(ref, ref_opt)
    _step(m, opt)
    ferry = Ferry(opt)
    for _ in range(2):
        ferry.offload()
        ferry.reload(prefetch=True)
        assert ferry.residency is Residency.PREFETCHING
        _step(ref, ref_opt)
        _step(m, opt)
    torch.cuda.synchronize()
    assert (calls["n"] > 0) == (calls["waits"] > 0) == (setting == "1"), calls
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(ref_opt.state.values(), opt.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ferry.close()


def test_a_bad_setting_fails_at_ferry_and_leaves_the_state_where_it_is(monkeypatch):
    """Read with the core's settings at ``Ferry()`` (it was read at the layer-wise reload): a bad value is
    refused there, before anything moved; one set after ``Ferry()`` does not act."""
    m, opt = _optimizer_ferry()
    _step(m, opt)
    want = [v.clone() for st in opt.state.values() for k, v in st.items() if k == "exp_avg"]
    monkeypatch.setenv(DRIVER_ENV, "maybe")
    with pytest.raises(ValueError, match="TORCHFERRY_DRIVER_COPIES must be on .* got 'maybe'"):
        Ferry(opt)
    held = [v for st in opt.state.values() for k, v in st.items() if k == "exp_avg"]
    assert all(h.device.type == "cuda" for h in held) and all(map(torch.equal, held, want))
    monkeypatch.setenv(DRIVER_ENV, "1")
    ferry = Ferry(opt)
    ferry.offload().wait()
    monkeypatch.setenv(DRIVER_ENV, "maybe")  # after Ferry(): not read
    ferry.reload(prefetch=True)
    _step(m, opt)  # the step completes the reload
    got = [v for st in opt.state.values() for k, v in st.items() if k == "exp_avg"]
    assert len(got) == len(want) and all(g.device.type == "cuda" for g in got)
    ferry.close()
