"""GPU tier of torchferry.Dock: device memory within the budget, bit-exact moves, prefetch that overlaps.

Skipped cleanly without CUDA (marker ``gpu``).
"""

import pytest
import torch

from torchferry import Dock, Ferry

pytestmark = pytest.mark.gpu
DEV = "cuda"
MiB = 1 << 20
SLACK = 8 * MiB  # allocator rounding and the 1-byte allocations the dock makes to settle it


def _settled_allocated() -> int:
    torch.cuda.synchronize()
    torch.empty(1, device=DEV)  # the allocator frees blocks whose copies are done at its next allocation
    return torch.cuda.memory_allocated()


def _sets(dock: Dock, n: int, mib: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``n`` sets of ``mib`` MiB of random float32 each, offloaded; name -> (tensor, clone on the host)."""
    out = {}
    for i in range(n):
        t = torch.randn(mib * MiB // 4, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
        want = t.cpu()
        f = Ferry(t)
        f.reserve_host()
        f.offload().wait()
        dock.add(f"s{i}", f)
        out[f"s{i}"] = (t, want)
    return out


def test_device_memory_stays_within_the_budget_and_moves_are_bit_exact():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dock = Dock(512 * MiB)  # room for two of the three sets
    sets = _sets(dock, 3, 256)
    kv = {}
    dock.add_claimant("kv", 256 * MiB, wake=lambda: kv.update(buf=torch.empty(256 * MiB, dtype=torch.uint8, device=DEV)),
                      sleep=lambda: kv.pop("buf"))
    base = _settled_allocated()
    torch.cuda.reset_peak_memory_stats()
    side = torch.cuda.Stream()
    order = ["s0", "s1", "s2", "s0", "kv", "s1", "s2", "kv", "s0", "s1"]
    for name in order:
        with dock.use(name):
            if name in sets:
                t, want = sets[name]
                # A kernel on another stream meanwhile: the moves must not race with it.
                with torch.cuda.stream(side):
                    torch.cuda._sleep(1_000_000)
                torch.testing.assert_close(t.cpu(), want, atol=0, rtol=0)
                t.mul_(1.0)  # a write: the next eviction must copy it
            else:
                kv["buf"].fill_(3)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= dock.budget_bytes + SLACK, (name, peak, dock.budget_bytes)
    st = dock.stats
    assert st.evictions >= 5 and st.swaps >= 1 and st.sleeps >= 1
    dock.evict()
    dock.wait()
    for name, (t, want) in sets.items():
        with dock.use(name):
            torch.testing.assert_close(t.cpu(), want, atol=0, rtol=0)


def test_prefetch_returns_before_its_copies_finish_and_the_compute_stream_does_not_wait():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dock = Dock(5 << 30)  # both fit: the prefetch evicts nothing
    sets = _sets(dock, 2, 2048)  # 2 GiB each: ~40 ms on a PCIe Gen5 link
    with dock.use("s0"):
        torch.cuda.synchronize()
        assert dock.prefetch("s1") == ("s1",)
        h = dock.moves[-1].handle
        assert dock.moves[-1].kind == "load" and dock.moves[-1].background
        ev = torch.cuda.Event()
        ev.record()  # on the compute stream, after the prefetch
        ev.synchronize()
        assert not h.done(), "the compute stream waited for the prefetch's copies"
    with dock.use("s1"):  # waits only for what is left, without a host sync
        t, want = sets["s1"]
        ok = torch.equal(t, want.to(DEV))
    h.wait()
    assert ok
    assert dock.stats.prefetch_hits == 1 and dock.stats.loads == 2 and dock.stats.evictions == 0


def test_prefetch_evicts_an_idle_set_while_compute_runs_and_use_waits_for_its_room():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dock = Dock(1024 * MiB)
    sets = _sets(dock, 2, 512)
    kv = {}
    dock.add_claimant("kv", 512 * MiB, wake=lambda: kv.update(buf=torch.empty(512 * MiB, dtype=torch.uint8, device=DEV)),
                      sleep=lambda: kv.pop("buf"))
    dock.plan(["s0", "s1", "kv"])
    for name in ("s0", "s1"):
        with dock.use(name):
            pass
    base = _settled_allocated() - 1024 * MiB  # both sets resident
    torch.cuda.reset_peak_memory_stats()
    with dock.use("s1"):
        assert dock.prefetch_next() == ("kv",)  # s0 (idle) leaves now, in the background
        h = dock.moves[-1].handle
        assert dock.moves[-1].kind == "evict" and dock.moves[-1].name == "s0" and dock.moves[-1].background
        torch.cuda._sleep(20_000_000)  # compute while s0's copies run
    with dock.use("kv"):  # waits for s0's copies (if any are left) before allocating
        kv["buf"].fill_(1)
    torch.cuda.synchronize()
    assert h.done() and dock.stats.evictions == 1 and dock.stats.prefetch_evictions == 1  # nothing else moved
    assert torch.cuda.max_memory_allocated() - base <= dock.budget_bytes + SLACK
    with dock.use("s0"):
        t, want = sets["s0"]
        torch.testing.assert_close(t.cpu(), want, atol=0, rtol=0)


def test_device_memory_stays_within_the_budget_when_state_grows_while_resident():
    """A regression test (failed before its fix: 1024 MiB allocated after ``use("rollout")`` against an
    896 MiB budget, the dock counting 768 MiB). The update phase keeps its grads
    (``zero_grad(set_to_none=False)``) and makes AdamW's first step, both while resident; at every
    ``use()`` entry and exit the device holds at most the budget, and what moved comes back bit-exact."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    P = 128 * MiB  # a 4096 x 8192 float32 weight; its grad and each AdamW moment are as large
    x = torch.randn(64, 4096, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    base = _settled_allocated()
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 8192, bias=False, device=DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # its "step" counter stays on the host
    fp = Ferry(model)
    fp.reserve_host()
    fp.offload().wait()
    fo = Ferry(opt, device=torch.device(DEV, torch.cuda.current_device()))  # before its first step: 0 bytes
    assert fo.state_bytes == 0
    dock = Dock(4 * P)  # the update phase's state (weight, grad, two moments) exactly
    dock.add("params", fp)
    dock.add("opt", fo)
    kv = {}
    # empty_cache=True, as for vLLM: otherwise the blocks cached at the evicted set's old addresses take its
    # storages at the next reload before the reload arena does, and the arena's filler then holds the unused
    # arena (up to the set's bytes) while resident: memory beyond the state that no dock counts.
    dock.add_claimant("rollout", 2 * P, wake=lambda: kv.update(buf=torch.empty(2 * P, dtype=torch.uint8, device=DEV)),
                      sleep=lambda: kv.pop("buf"), empty_cache=True)
    kept = None
    for step in range(3):
        for phase in (("rollout",), ("params", "opt")):
            with dock.use(*phase):
                inside = _settled_allocated() - base
                assert inside <= dock.budget_bytes + SLACK, (step, phase, "entry", inside, dock.budget_bytes)
                if phase == ("rollout",):
                    kv["buf"].fill_(1)
                else:
                    if kept is not None:  # evicted by the last rollout with its grad, the state stayed
                        grad, state = kept
                        assert torch.equal(model.weight.grad.cpu(), grad)
                        assert all(torch.equal(v.cpu(), state[k]) for k, v in opt.state[model.weight].items())
                    model(x).square().mean().backward()
                    opt.step()  # step 0: AdamW's state is created here (2P on the device)
                    opt.zero_grad(set_to_none=False)  # the grad stays (P on the device)
                    model(x).mean().backward()  # the next micro-batch accumulates into it
                    kept = (model.weight.grad.cpu(), {k: v.cpu() for k, v in opt.state[model.weight].items()})
            after = _settled_allocated() - base
            assert after <= dock.budget_bytes + SLACK, (step, phase, "exit", after, dock.budget_bytes)
            assert dock.resident_bytes <= dock.budget_bytes
        assert dock.nbytes("params") == 2 * P and dock.nbytes("opt") == 2 * P  # counted as they are
        assert dock.resident_bytes == 4 * P and not dock.is_resident("rollout")
    st = dock.stats
    # Each later rollout evicts the parameters with their grad (2P); the state is never evicted.
    assert st.evictions == 2 and st.bytes_evicted == 2 * 2 * P and st.wakes == 3 and st.sleeps == 3
    assert fp.state_bytes == 2 * P
