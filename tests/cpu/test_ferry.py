"""The Ferry on the CPU (``_ferry/ferry.py``): round trips bit-exact with identity kept, the residency
state machine, idempotent calls, guards while offloaded, atomic failures (pool, out of memory,
an interrupt between copies), close() and what a closed or dropped ferry holds (reported
against commit df8fb81), stats and logging.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import torchferry
import torchferry._core._state.plan
from tests.helpers import IDS, assert_same, identities, snapshot, trained
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool


def test_round_trip_is_bit_exact_and_keeps_identity():
    m, opt = trained()
    m(IDS).backward()  # grads present
    before, ids = snapshot(m, opt), identities(m, opt)
    user_view = m.proj.weight[1:3]  # an alias the ferry does not know
    want_view = user_view.clone()
    storages = {r.name: r.tensor.untyped_storage() for r in torchferry._core._state.plan.build_plan([m, opt]).tensors}
    aliased = "targets[0].proj.weight"
    ferry = Ferry(m, opt)
    assert ferry.residency is Residency.DEVICE
    handle = ferry.offload()
    handle.wait()
    assert handle.done() and ferry.residency is Residency.HOST
    # Every device storage released but the alias's, kept; every known tensor now views the host pool.
    assert all(s.nbytes() == 0 for n, s in storages.items() if n != aliased)
    assert storages[aliased].nbytes() > 0 and torch.equal(user_view, want_view)
    assert_same(before, snapshot(m, opt))  # host copies readable after wait()
    ferry.reload().wait()
    assert ferry.residency is Residency.DEVICE
    assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    assert m.head.weight is m.emb.weight
    torch.testing.assert_close(user_view, m.proj.weight[1:3], atol=0, rtol=0)
    assert user_view.untyped_storage().data_ptr() == m.proj.weight.untyped_storage().data_ptr()


def test_state_bytes_and_pool_size():
    m, opt = trained()
    plan = torchferry._core._state.plan.build_plan([m, opt])
    want = sum(s.nbytes() for s in plan.storages)
    ferry = Ferry(m, opt)
    ferry.offload()
    assert ferry.state_bytes == want > 0
    # Exact size: the storages plus alignment padding (< 512 B each), no power-of-two rounding.
    assert want <= ferry.host_bytes < want + 512 * len(plan.storages)
    ferry.reload()


def test_training_after_cycles_matches_training_without():
    ref_m, ref_opt = trained(steps=3)
    m, opt = trained(steps=1)
    ferry = Ferry(m, opt)
    for _ in range(2):
        ferry.offload().wait()
        ferry.reload().wait()
        m(IDS).backward()
        opt.step()
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


def test_calls_are_idempotent_and_residency_is_explicit():
    m, opt = trained()
    ferry = Ferry(m, opt)
    r1 = ferry.reload()  # resident: no-op
    assert r1.nbytes == 0 and r1.done()
    h1 = ferry.offload()
    assert ferry.offload() is h1  # offloaded: no-op, same handle
    h2 = ferry.reload()
    assert ferry.reload() is h2
    assert ferry.residency is Residency.DEVICE


def test_forward_and_step_while_offloaded_raise_and_change_nothing():
    m, opt = trained()
    ferry = Ferry(m, opt)
    ferry.offload()
    before = snapshot(m, opt)
    with pytest.raises(RuntimeError, match=r"forward of the Mixed target while its state is offloaded .*call ferry.reload\(\)"):
        m(IDS)
    with pytest.raises(RuntimeError, match=r"forward of Linear 'proj' .*offloaded"):
        m.proj(torch.randn(1, 8))
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) while its state is offloaded"):
        opt.step()
    assert_same(before, snapshot(m, opt))
    ferry.reload()
    m(IDS).backward()  # hooks gone
    opt.step()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
     torch.int32, torch.int64, torch.bool, torch.complex64]
    + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)],
)
def test_every_dtype_round_trips_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3 * 5 * 16,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: (raw.numel() // raw.view(dtype).element_size() * raw.view(dtype).element_size()) // 1]
    odd = t[1:-1]  # a view at an odd offset
    t_bytes = raw.clone()
    ferry = Ferry(t, odd)
    ferry.offload()
    assert torch.equal(t.view(torch.uint8), t_bytes)  # bitwise, NaN payloads included
    ferry.reload()
    assert torch.equal(t.view(torch.uint8), t_bytes)
    assert odd.data_ptr() == t.data_ptr() + odd.element_size()


def test_non_contiguous_and_scalar_tensors():
    base = torch.randn(6, 5)
    strided = base.t()[::2]
    scalar = torch.tensor(3.5)
    before = (base.clone(), strided.clone(), scalar.clone())
    stride = strided.stride()
    ferry = Ferry(strided, scalar)
    ferry.offload()
    assert strided.stride() == stride and strided.device.type == "cpu"
    torch.testing.assert_close(strided, before[1], atol=0, rtol=0)
    assert torch.equal(base, before[0])  # an alias the ferry does not know: its storage kept
    ferry.reload()
    assert torch.equal(base, before[0]) and torch.equal(strided, before[1]) and torch.equal(scalar, before[2])
    assert strided.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_optimizer_ferry_made_before_the_first_step_finds_its_device_later():
    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    ferry = Ferry(opt)  # no state yet: nothing says where it will live
    assert not ferry._set.device_fixed
    ferry.offload()
    ferry.reload()
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    want = [v.clone() for st in opt.state.values() for v in st.values()]
    ferry.offload()
    assert ferry._set.device_fixed and ferry.device == torch.device("cpu")
    ferry.reload()
    got = [v for st in opt.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_context_manager_does_not_mask_the_exception_and_reloads():
    m = nn.Linear(4, 4)
    want = m.weight.detach().clone()
    with pytest.raises(KeyError):
        with Ferry(m) as f:
            f.offload()
            raise KeyError("user error")
    assert f.residency is Residency.DEVICE
    torch.testing.assert_close(m.weight.detach(), want, atol=0, rtol=0)


def test_host_pool_failure_leaves_state_on_device(monkeypatch):
    m, opt = trained()
    before, ids = snapshot(m, opt), identities(m, opt)
    import torchferry._core._host.memory as hm

    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hm, "_Mapping", no_memory)
    ferry = Ferry(m, opt)
    with pytest.raises(RuntimeError, match=r"could not allocate a host pool of \d+ bytes .*available host memory: (\d+ bytes|unknown)"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE and ferry.host_bytes == 0
    assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    m(IDS).backward()  # no guard left behind
    monkeypatch.undo()
    ferry.offload()  # retry after the cause is gone
    ferry.reload()


def test_out_of_memory_during_reload_keeps_state_on_host(monkeypatch):
    m, opt = trained()
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    ferry.offload()
    real = torch.UntypedStorage.resize_
    calls = {"n": 0}

    def oom_on_third(storage, n):  # the third re-allocation fails
        calls["n"] += n > 0
        if calls["n"] == 3 and n > 0:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(storage, n)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", oom_on_third)
    with pytest.raises(RuntimeError, match=r"reload needs \d+ bytes .*ran out of device memory.*nothing was lost"):
        ferry.reload()
    assert ferry.residency is Residency.HOST
    assert all(s.nbytes() == 0 for s in ferry._offloaded.plan.storages)
    assert_same(before, snapshot(m, opt))  # the host copies are intact
    with pytest.raises(RuntimeError, match="offloaded"):
        m(IDS)
    monkeypatch.undo()
    ferry.reload()
    assert_same(before, snapshot(m, opt))


def _interrupt_on_nth_copy(n: int):
    """A Tensor.copy_ replacement whose n-th call raises KeyboardInterrupt."""
    calls = [0]

    def copy_(dst, src, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt("injected between copies")
        return torch._C.TensorBase.copy_(dst, src, *args, **kwargs)

    return copy_


@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_interrupt_between_copies_leaves_a_well_defined_state(monkeypatch, direction):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024))  # 2 MiB weights: one copy each
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 1024)).sum().backward()
    opt.step()
    want = [t.detach().clone() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    ferry = Ferry(m, opt)
    if direction == "reload":
        ferry.offload()
    monkeypatch.setattr(torch.Tensor, "copy_", _interrupt_on_nth_copy(3))
    with pytest.raises(KeyboardInterrupt):
        getattr(ferry, direction)()
    monkeypatch.undo()
    expected = Residency.DEVICE if direction == "offload" else Residency.HOST
    assert ferry.residency is expected
    got = [t.detach() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    if direction == "offload":
        m(torch.randn(2, 1024))  # no guard left behind
    ferry.offload()
    ferry.reload()  # a retry succeeds
    got = [t.detach() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_close():
    m, opt = trained()
    ferry = Ferry(m, opt)
    ferry.offload()
    with pytest.raises(RuntimeError, match=r"close\(\) while the state is offloaded would lose it"):
        ferry.close()
    ferry.reload()
    ferry.close()
    assert ferry.host_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        ferry.offload()


def test_module_targets_are_weakly_held():
    m, opt = trained()
    ferry = Ferry(m)
    del m
    gc.collect()
    with pytest.raises(RuntimeError, match="garbage collected"):
        ferry.offload()


def _hooks(m: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(len(x._forward_pre_hooks) + len(x._forward_hooks) + len(x._state_dict_pre_hooks) for x in m.modules())
    return n + len(opt._optimizer_step_pre_hooks) + len(getattr(opt, "_optimizer_state_dict_pre_hooks", {}))


def test_closed_or_dropped_ferry_holds_no_storage_memory_or_hooks():
    for how in ("close", "drop"):
        m, opt = trained(ids=torch.tensor([[1, 2, 3]]))
        hooks = _hooks(m, opt)
        ferry = Ferry(m, opt)
        for prefetch in (False, True):
            ferry.offload()
            ferry.reload(prefetch=prefetch)
        old = [StorageWeakRef(p.untyped_storage()) for p in m.parameters()]
        pool = weakref.ref(ferry._pool)
        if how == "close":
            ferry.close()
        else:
            del ferry
        gc.collect() if how == "close" else None  # a dropped ferry must go by reference counting alone
        assert _hooks(m, opt) == hooks
        if how == "drop":
            assert pool() is None
        m.to(torch.float64)  # moving the module by other means frees its old storages
        opt.state.clear()
        assert all(r.expired() for r in old), how
        assert not any(in_host_pool(p.data_ptr()) for p in m.parameters())


def test_a_ferry_dropped_while_offloaded_leaves_a_usable_state_on_the_host(caplog):
    """[Note: a ferry dropped while offloaded]: no guard is left naming a reload nobody can call."""
    import logging

    m, opt = trained(ids=torch.tensor([[1, 2, 3]]))
    hooks = _hooks(m, opt)
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    want = snapshot(m, opt)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        del ferry  # by reference counting alone
    assert any("dropped while its state was offloaded" in r.getMessage() for r in caplog.records)
    assert _hooks(m, opt) == hooks
    assert_same(want, snapshot(m, opt))  # bit-exact, on the host
    m(IDS).backward()  # the forward and the step run again
    opt.step()
    with pytest.raises(RuntimeError, match=r"if it was dropped while offloaded, move the state off its pool"):
        Ferry(m, opt)
    for t in [*m.parameters(), *m.buffers()]:  # ordinary copies (model.to(device) on a GPU) move it off
        t.data = t.data.clone()
        if t.grad is not None:
            t.grad = t.grad.clone()
    assert not any(in_host_pool(t.data_ptr()) for t in [*m.parameters(), *m.buffers()])
    again = Ferry(m)
    again.offload()
    again.reload()
    again.close()


def test_stats_logging_and_profiler_ranges(caplog):
    import logging

    m, opt = trained()
    ferry = Ferry(m, opt)
    with caplog.at_level(logging.DEBUG, logger="torchferry"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ferry.offload().wait()
            ferry.reload().wait()
            ferry.offload()
            ferry.offload()  # a no-op: not counted
    st = ferry.stats
    assert (st.offloads, st.reloads) == (2, 1)
    assert st.bytes_offloaded == 2 * ferry.state_bytes and st.bytes_reloaded == ferry.state_bytes
    assert st.last_offload_bytes == ferry.state_bytes and st.last_offload_s is not None and st.last_offload_s >= 0
    assert st.offload_seconds >= st.last_offload_s and st.last_reload_GBps is None or st.last_reload_GBps > 0
    names = [e.name for e in prof.events()]
    assert names.count("torchferry::d2h") == 2 and names.count("torchferry::h2d") == 1
    assert names.count(f"torchferry::d2h bytes={ferry.state_bytes}") == 2  # the bytes, as a nested range
    done = [r.getMessage() for r in caplog.records if " done: " in r.getMessage()]
    assert len(done) == 3 and all("bytes in" in d and "GB/s" in d for d in done)
    ferry.reload()


def test_forget_plan_drops_the_cached_plan_and_the_next_offload_plans_again():
    """State moved by other means (model.cpu() in place of the ferry): forget_plan() drops the
    cached plan (which holds the device storages); refused while offloaded; the next offload works."""
    m = nn.Linear(16, 16)
    ferry = Ferry(m)
    ferry.offload()
    with pytest.raises(RuntimeError, match="forget_plan"):
        ferry.forget_plan()
    ferry.reload()
    assert ferry._set.cache is not None
    ferry.forget_plan()
    assert ferry._set.cache is None and ferry._set.parking is None
    want = m.weight.detach().clone()
    ferry.offload()
    assert m.weight.device.type == "cpu"
    ferry.reload()
    assert torch.equal(m.weight, want)
