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
