"""GPU tier: pinning, release, stream ordering. Skipped cleanly without CUDA."""

import pytest
import torch

from torchferry import Ferry, Residency
from tests.helpers import Mixed, assert_same, identities, snapshot

pytestmark = pytest.mark.gpu
DEV = "cuda"
IDS = torch.tensor([[1, 5, 7], [32, 0, 3]])


def _trained():
    torch.manual_seed(0)
    m = Mixed(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(IDS.to(DEV)).backward()
    opt.step()
    m(IDS.to(DEV)).backward()
    return m, opt


def test_round_trip_pinned_bit_exact_identity():
    m, opt = _trained()
    before, ids = snapshot(m, opt), identities(m, opt)
    ferry = Ferry(m, opt)
    assert ferry.device == torch.device("cuda", torch.cuda.current_device())
    h = ferry.offload()
    h.wait()
    assert ferry.residency is Residency.HOST and ferry.pinned
    for p in m.parameters():
        assert p.device.type == "cpu" and p.is_pinned()
        assert p.grad.device.type == "cpu" and p.grad.is_pinned()
    for st in opt.state.values():
        for k, v in st.items():
            assert v.device.type == "cpu", k
            if k != "step":  # AdamW's step counter already lived on the host
                assert v.is_pinned(), k
    assert_same(before, snapshot(m, opt))
    ferry.reload()
    assert ferry.residency in (Residency.H2D_IN_FLIGHT, Residency.DEVICE)
    assert all(p.device.type == "cuda" for p in m.parameters())
    assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    m(IDS.to(DEV)).backward()
    opt.step()


def test_device_cuda_without_an_index_is_the_current_device():
    """``Ferry(..., device="cuda")`` means ``cuda:<current>``, as in torch (it was refused at the
    first offload: "... is on cuda:0, but the ferry's device is cuda"), also for an optimizer
    without state yet."""
    m = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(m.parameters())
    want = m.weight.detach().clone()
    ferry = Ferry(m, device="cuda")
    opt_ferry = Ferry(opt, device="cuda")
    assert ferry.device == opt_ferry.device == torch.device("cuda", torch.cuda.current_device())
    m(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    ferry.offload()
    opt_ferry.offload()
    ferry.reload()
    opt_ferry.reload()
    torch.cuda.synchronize()
    assert m.weight.is_cuda and all(v.is_cuda for v in opt.state[m.weight].values() if v.dim())
    stepped = m.weight.detach().clone()
    assert not torch.equal(stepped, want)  # the step moved it
    ferry.offload()
    ferry.reload()
    torch.cuda.synchronize()
    assert torch.equal(m.weight.detach(), stepped)


def test_pool_exact_size_and_memory_released():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = [torch.randn(n, device=DEV) for n in (64 << 20, 16 << 20, 3 << 20, 12345)]
    want = [t.clone() for t in big]
    state_bytes = sum(t.untyped_storage().nbytes() for t in big)
    ferry = Ferry(*big)
    torch.cuda.synchronize()
    reserved_before = torch.cuda.memory_reserved()
    ferry.offload().wait()
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved()
    assert reserved_before - reserved_after >= 0.99 * state_bytes, (reserved_before, reserved_after, state_bytes)
    assert state_bytes <= ferry.host_bytes <= 1.01 * state_bytes
    ferry.reload()
    for t, w in zip(big, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_offload_sees_pending_writes_and_release_waits_for_the_copy():
    x = torch.randn(32 << 20, device=DEV)  # 128 MiB
    ferry = Ferry(x)
    ferry.offload()
    ferry.reload()
    expected = (x * 3).cpu()
    # Queue a long kernel, then the write the offload must see.
    torch.cuda._sleep(50_000_000)
    x.mul_(3)
    # Delay the D2H stream too, so the released block would be recycled first
    # if the release did not wait for the copy.
    with torch.cuda.stream(ferry._streams.d2h):
        torch.cuda._sleep(50_000_000)
    h = ferry.offload()
    scribble = torch.full((32 << 20,), float("nan"), device=DEV)  # may reuse x's old block
    h.wait()
    torch.testing.assert_close(x, expected, atol=0, rtol=0)
    del scribble
    ferry.reload()
    torch.testing.assert_close(x.cpu(), expected, atol=0, rtol=0)


def test_reload_consumed_on_another_stream_while_a_long_kernel_runs():
    w = torch.randn(4096, 4096, device=DEV)
    want = w.clone()
    ferry = Ferry(w)
    ferry.offload().wait()
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=DEV)
    torch.cuda._sleep(50_000_000)  # the current stream is busy
    h = ferry.reload()
    h.wait_stream(side)
    with torch.cuda.stream(side):
        out = w @ a
        ref = want @ a
    side.synchronize()
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(w, want, atol=0, rtol=0)
    # and the current stream is ordered after the copy without any wait
    torch.testing.assert_close((w + 0).cpu(), want.cpu(), atol=0, rtol=0)


def test_cycles_hold_memory_flat():
    m, opt = _trained()
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    ferry.reload().wait()
    host, reserved = ferry.host_bytes, torch.cuda.memory_reserved()
    for _ in range(50):
        ferry.offload()
        ferry.reload()
    torch.cuda.synchronize()
    assert ferry.host_bytes == host
    assert torch.cuda.memory_reserved() == reserved


def test_compat_helpers_on_gpu():
    from torchferry.compat import verl

    m, opt = _trained()
    before = snapshot(m, opt)
    verl.offload_fsdp2_model_to_cpu(m)
    verl.offload_fsdp_optimizer(opt)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in m.parameters())
    verl.load_fsdp2_model_to_gpu(m)
    verl.load_fsdp_optimizer(opt, torch.cuda.current_device())
    assert_same(before, snapshot(m, opt))


_ARENA_CHECK = r"""
import torch
from torchferry import Ferry
from torchferry._core._transfer.arena import arena_supported
from torchferry._public.env import core_settings
assert arena_supported(core_settings())
torch.manual_seed(0)
ts = [torch.randn(n, device="cuda") for n in (40 << 20, 3 << 20, 7 << 20 | 5, 1000, 25 << 20)]
want = [t.cpu() for t in ts]
state = sum(t.untyped_storage().nbytes() for t in ts)
ferry = Ferry(*ts)
ferry.offload().wait()
torch.cuda.empty_cache()
base = torch.cuda.memory_reserved()
ferry.reload().wait()
ptrs = {t.untyped_storage().data_ptr() for t in ts if t.untyped_storage().nbytes() > (1 << 20)}
segs = [s for s in torch.cuda.memory_snapshot()
        if any(s["address"] <= p < s["address"] + s["total_size"] for p in ptrs)]
assert len(segs) == 1, [(s["address"], s["total_size"]) for s in segs]
for t, w in zip(ts, want):
    torch.testing.assert_close(t.cpu(), w, atol=0, rtol=0)
ferry.offload().wait()
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() <= base + 0.01 * state, (torch.cuda.memory_reserved(), base)
ferry.reload()
for t, w in zip(ts, want):
    torch.testing.assert_close(t.cpu(), w, atol=0, rtol=0)
print("arena ok")
"""


def test_reload_arena_one_segment_and_full_release():
    """After empty_cache, reload puts the large storages in one segment ([Note: reload arena]),
    and the next offload + empty_cache returns all of it. In a fresh process: free blocks that
    earlier tests left cached in partly used segments would take some storages by best fit."""
    import subprocess
    import sys

    from torchferry._core._transfer.arena import arena_supported
    from torchferry._public.env import core_settings

    if not arena_supported(core_settings()):
        pytest.skip("allocator settings disable the reload arena")
    p = subprocess.run([sys.executable, "-c", _ARENA_CHECK], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "arena ok" in p.stdout, p.stderr[-3000:]


_ARENA_FOREIGN_CHECK = r"""
import torch
from torchferry import Ferry
x = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
del x
y = torch.empty(60 << 20, dtype=torch.uint8, device="cuda")  # carved from x's cached segment
z = torch.empty(20 << 20, dtype=torch.uint8, device="cuda")  # keeps that segment alive
del y  # a cached free block of 60 MiB in a partly used segment, as a training process has
torch.manual_seed(0)
ts = [torch.randn(n, device="cuda") for n in [10 << 20] * 12 + [3 << 20, 1000]]
want = [t.cpu() for t in ts]
ferry = Ferry(*ts)
ferry.offload().wait()
torch.cuda.empty_cache()
before = {s["address"] for s in torch.cuda.memory_snapshot()}
base = torch.cuda.memory_reserved()
ferry.reload().wait()
new = [s for s in torch.cuda.memory_snapshot() if s["address"] not in before and s.get("segment_type") != "small"]
assert len(new) == 1, [(s["address"], s["total_size"]) for s in new]  # one arena, not one cudaMalloc per storage
for t, w in zip(ts, want):
    torch.testing.assert_close(t.cpu(), w, atol=0, rtol=0)
ferry.offload().wait()
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() <= base, (torch.cuda.memory_reserved(), base)  # the arena went back whole
ferry.reload().wait()
for t, w in zip(ts, want):
    torch.testing.assert_close(t.cpu(), w, atol=0, rtol=0)
print("arena ok")
"""


def test_reload_arena_seeded_beside_cached_free_blocks():
    """Free blocks cached in partly used segments (always there in training) no longer switch
    the arena off: the reload makes one new segment, and offload + empty_cache returns it."""
    import subprocess
    import sys

    from torchferry._core._transfer.arena import arena_supported
    from torchferry._public.env import core_settings

    if not arena_supported(core_settings()):
        pytest.skip("allocator settings disable the reload arena")
    p = subprocess.run([sys.executable, "-c", _ARENA_FOREIGN_CHECK], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "arena ok" in p.stdout, p.stderr[-3000:]


def test_two_ferries_share_the_copy_streams():
    a, b = Ferry(torch.ones(10, device=DEV)), Ferry(torch.ones(10, device=DEV))
    assert a._streams is b._streams


def test_swap_within_a_budget_bit_exact():
    import torchferry

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a = [torch.randn(64 << 20, device=DEV) for _ in range(4)]  # 1 GiB out
    b = [torch.randn(64 << 20, device=DEV) for _ in range(4)]  # 1 GiB in
    want_a, want_b = [t.cpu() for t in a], [t.cpu() for t in b]
    fa, fb = Ferry(*a), Ferry(*b)
    fb.offload().wait()
    torch.cuda.empty_cache()
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    h_out, h_in = torchferry.swap(fa, fb, gpu_budget_bytes=base + (256 << 20))
    h_out.wait()
    h_in.wait()
    # The incoming blocks reuse the outgoing ones as their copies finish: the
    # device never holds more than the budget (one 256 MiB block of headroom).
    assert torch.cuda.max_memory_reserved() <= reserved + (256 << 20), (torch.cuda.max_memory_reserved(), reserved)
    for t, w in zip(a, want_a):
        torch.testing.assert_close(t, w, atol=0, rtol=0)
    for t, w in zip(b, want_b):
        torch.testing.assert_close(t.cpu(), w, atol=0, rtol=0)


def test_small_tensors_packed_round_trip_bit_exact():
    g = torch.Generator(device=DEV).manual_seed(0)
    ts = [torch.randn(64 << 10, device=DEV, generator=g) for _ in range(4096)]  # 4096 x 256 KiB
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    h = ferry.offload()
    # Kernels queued right after the offload on blocks it released: the small storages are freed
    # without an event each (the caller's stream waits for their gathers), the large by event.
    scribble = torch.full((256 << 20,), float("nan"), device=DEV)
    small = [torch.full((64 << 10,), float("nan"), device=DEV) for _ in range(4096)]
    h.wait()
    assert len(ferry._set.host.layout(ferry._offloaded.plan).chunks) == 16  # 1 GiB in 64 MiB chunks
    for t, w in zip(ts, want):
        assert t.is_pinned()
        torch.testing.assert_close(t, w.cpu(), atol=0, rtol=0)
    del scribble, small
    ferry.reload()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_small_storages_beside_large_ones_round_trip_bit_exact_under_reuse():
    """Large storages' DMAs queued first, then the packed small ones' gathers (which wait for the
    caller's stream only); blocks reused at once by the caller's stream, over several cycles."""
    g = torch.Generator(device=DEV).manual_seed(1)
    big = [torch.randn(32 << 20, device=DEV, generator=g) for _ in range(4)]  # 4 x 128 MiB
    small = [torch.randn(1000 + i, device=DEV, generator=g) for i in range(3000)]  # ~12 MB, 1 chunk
    want = [t.clone() for t in big + small]
    ferry = Ferry(*big, *small)
    for _ in range(3):
        h = ferry.offload()
        junk = [torch.full((1000 + i,), float("nan"), device=DEV) for i in range(3000)]
        junk.append(torch.full((64 << 20,), float("nan"), device=DEV))
        h.wait()
        del junk
        ferry.reload()
        for t, w in zip(big + small, want):
            torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_background_pinning_then_first_offload_pinned_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    ts = [torch.randn(16 << 20, device=DEV) for _ in range(4)]  # 256 MiB
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    fut = ferry.reserve_host(background=True)
    x = torch.randn(4096, 4096, device=DEV)
    for _ in range(20):  # training goes on meanwhile
        x = torch.tanh(x @ x)
    ferry.offload().wait()  # waits for the pool if it is not ready yet
    assert fut.result(timeout=120) > 0 and ferry.pinned and ferry.pinned_bytes == ferry.host_bytes
    assert all(t.is_pinned() for t in ts)
    ferry.reload().wait()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_partly_pinned_pool_round_trip_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    ts = [torch.randn(4 << 20, device=DEV) for _ in range(4)] + [torch.randn(1000, device=DEV) for _ in range(50)]
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts, max_pinned_bytes=(32 << 20) + 4096)  # the first two 16 MiB slots
    for _ in range(2):
        ferry.offload().wait()
        assert [t.is_pinned() for t in ts[:4]] == [True, True, False, False]
        assert not ts[-1].is_pinned() and ferry.pinned_bytes == 32 << 20 and not ferry.pinned
        ferry.reload().wait()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_cpu_tensors_stay_put_when_the_ferry_is_on_a_gpu():
    """AdamW's ``step`` counters are CPU tensors of a GPU model's optimizer: a GPU ferry leaves
    them alone. Through offload and reload each stays the same object, on the CPU, over the same
    memory (not the host pool), with its value; everything on the GPU goes and comes back."""
    from torchferry._core._state.host_blocks import in_host_pool
    from torchferry._core._state.plan import build_plan

    m, opt = _trained()
    steps = [st["step"] for st in opt.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps)
    before = [(id(s), s.data_ptr(), s.clone()) for s in steps]
    plan = build_plan([m, opt])
    assert plan.device.type == "cuda"
    planned = {id(r.tensor) for r in plan.tensors}
    assert not any(id(s) in planned for s in steps)
    assert all(p.device.type == "cuda" for p in m.parameters())

    def unmoved():
        now = [st["step"] for st in opt.state.values()]
        for s, (ident, ptr, value) in zip(now, before):
            assert id(s) == ident and s.device.type == "cpu" and s.data_ptr() == ptr
            assert not in_host_pool(s.data_ptr())
            assert torch.equal(s, value)

    ferry = Ferry(m, opt)
    ferry.offload().wait()
    assert ferry.residency is Residency.HOST
    assert all(p.device.type == "cpu" and in_host_pool(p.data_ptr()) for p in m.parameters())
    unmoved()
    ferry.reload().wait()
    assert all(p.device.type == "cuda" for p in m.parameters())
    unmoved()
    opt.step()  # the counters are still the optimizer's: the step advances them in place
    assert all(int(s) == int(v) + 1 for s, (_, _, v) in zip(steps, before))


def _wait_pool(ferry, seconds=120.0):
    import time

    t = time.perf_counter()
    while not ferry._pool.ready():
        assert time.perf_counter() - t < seconds, "pinning ahead did not finish"
        time.sleep(0.01)


def test_pin_ahead_pins_at_construction_and_the_first_offload_does_not(tmp_path, monkeypatch):
    """[Note: pin ahead]: Ferry() starts the pool in the background; once it is ready the first
    offload lands in pinned memory without allocating (same block), bit-exact."""
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    ts = [torch.randn(16 << 20, device=DEV) for _ in range(8)]  # 512 MiB
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    assert ferry.host_bytes == ferry.state_bytes  # being allocated already
    x = torch.randn(4096, 4096, device=DEV)
    for _ in range(20):  # training goes on meanwhile
        x = torch.tanh(x @ x)
    _wait_pool(ferry)
    block = ferry._pool.block_id
    assert ferry.reserve_host() > 0  # the pinning seconds, reported once
    assert ferry.reserve_host() == 0.0
    ferry.offload().wait()
    assert ferry._pool.block_id == block and ferry.pinned and all(t.is_pinned() for t in ts)
    ferry.reload().wait()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)
    off = Ferry(*[torch.ones(4 << 20, device=DEV)], pin_ahead=False)
    assert off.host_bytes == 0  # opted out: pinned by the first offload, as before
    off.close()


def test_pin_ahead_waits_for_the_first_step_and_sizes_without_grads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ferry = Ferry(m, opt)  # before the first step: no optimizer state yet
    assert ferry.host_bytes == 0
    m(torch.randn(8, 1024, device=DEV)).sum().backward()
    opt.step()
    assert ferry.host_bytes > 0  # started by the step post-hook
    opt.zero_grad(set_to_none=True)
    _wait_pool(ferry)
    block, host = ferry._pool.block_id, ferry.host_bytes
    before = [p.detach().clone() for p in m.parameters()]
    ferry.offload().wait()
    assert ferry._pool.block_id == block and ferry.host_bytes == host  # no regrowth: sized without grads
    assert host <= 1.01 * ferry.state_bytes
    ferry.reload().wait()
    for p, w in zip(m.parameters(), before):
        torch.testing.assert_close(p, w, atol=0, rtol=0)
    ferry.close()


def test_pin_ahead_optimizer_only_ferry_and_other_step_hooks(tmp_path, monkeypatch):
    """An optimizer-only ferry made before the first step is armed from its parameters' device;
    another step post-hook registered after ours still runs (ours does not remove itself mid-step)."""
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    m = torch.nn.Linear(1024, 1024).to(DEV)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ferry = Ferry(opt)
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(1))
    assert ferry.host_bytes == 0
    m(torch.randn(8, 1024, device=DEV)).sum().backward()
    opt.step()
    assert seen == [1] and ferry.host_bytes > 0 and ferry.device.type == "cuda"
    opt.zero_grad(set_to_none=True)
    _wait_pool(ferry)
    block = ferry._pool.block_id
    want = {k: v.clone() for k, v in opt.state[m.weight].items()}
    ferry.offload().wait()
    assert ferry._pool.block_id == block
    ferry.reload().wait()
    for k, v in want.items():
        torch.testing.assert_close(opt.state[m.weight][k], v, atol=0, rtol=0)
    ferry.close()
