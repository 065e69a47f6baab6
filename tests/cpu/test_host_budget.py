"""Host memory: the node budget (refusal leaves everything intact, ranks counted together),
background pinning, release_host(), a partly pinned pool, and the cached plan."""

import functools
import json
import os

import pytest
import torch
from torch import nn

from tests.helpers import Mixed, assert_same, snapshot
from tests.spawn import run_spawned
from torchferry import Ferry, HostBudgetError, Residency
from torchferry._host_views import pin_boundary as _pin_boundary
from torchferry._host_budget import NodeLedger
from torchferry._host_memory import in_host_pool
from torchferry._packing import layout


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path, monkeypatch):
    """Each test gets its own node ledger, so parallel test runs do not see each other."""
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHFERRY_HOST_BUDGET_BYTES", raising=False)
    yield


def _trained():
    torch.manual_seed(0)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.arange(6).view(2, 3)).float().sum().backward()
    opt.step()
    return m, opt


def test_budget_refusal_names_bytes_and_options_and_leaves_state_intact():
    m, opt = _trained()
    before = snapshot(m, opt)
    ferry = Ferry(m, opt, host_budget_bytes=1000)
    need = ferry.state_bytes
    assert need > 1000
    with pytest.raises(HostBudgetError, match=r"needs \d+ bytes .* only \d+ bytes .*host budget of 1000 bytes") as ei:
        ferry.offload()
    msg = str(ei.value)
    assert "release_host" in msg and "TORCHFERRY_HOST_BUDGET_BYTES" in msg
    assert "max_pinned_bytes=...) pins less, but the pool still needs the host memory" in msg
    assert ei.value.needed >= need and ei.value.available == 1000
    assert isinstance(ei.value, RuntimeError)
    assert ferry.residency is Residency.DEVICE and ferry.host_bytes == 0  # nothing allocated
    assert_same(before, snapshot(m, opt))  # nothing moved
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())
    assert NodeLedger().usage() == {}  # nothing recorded
    with pytest.raises(HostBudgetError):
        ferry.reserve_host()
    with pytest.raises(HostBudgetError):
        ferry.reserve_host(background=True)  # refused at once, not in the thread
    m(torch.arange(6).view(2, 3))  # still usable where it is


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "64")
    ferry = Ferry(torch.ones(100))
    with pytest.raises(HostBudgetError, match="host budget of 64 bytes"):
        ferry.offload()
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "lots")
    with pytest.raises(ValueError, match="TORCHFERRY_HOST_BUDGET_BYTES='lots' is not a number"):
        Ferry(torch.ones(100))


def test_refusal_when_the_node_has_too_little_free_memory(monkeypatch):
    import torchferry._host_budget as hb

    monkeypatch.setattr(hb, "meminfo", lambda: {"MemTotal": 10 << 20, "MemAvailable": 1 << 20})
    t = torch.ones(1 << 20)  # 4 MiB
    ferry = Ferry(t)
    with pytest.raises(HostBudgetError, match=r"free memory \(MemAvailable 1048576 bytes"):
        ferry.offload()
    assert t.untyped_storage().nbytes() == 4 << 20 and torch.equal(t, torch.ones(1 << 20))


def test_ledger_records_held_bytes_and_gives_them_back():
    a, b = torch.ones(1000), torch.ones(3000)
    fa, fb = Ferry(a), Ferry(b)
    fa.offload()
    fb.offload()
    me = str(os.getpid())
    assert NodeLedger().usage()[me] == {"held": fa.host_bytes + fb.host_bytes, "pending": 0}
    fa.reload()
    fa.release_host()
    assert fa.host_bytes == 0 and NodeLedger().usage()[me]["held"] == fb.host_bytes
    fb.reload()
    fb.close()
    assert me not in NodeLedger().usage()
    fa.offload()  # a released ferry allocates again
    assert fa.host_bytes > 0 and torch.equal(a.clone(), torch.ones(1000))
    fa.reload()
    assert torch.equal(a, torch.ones(1000))


def test_ledger_drops_dead_processes_and_torn_files(tmp_path):
    ledger = NodeLedger(str(tmp_path / "l.json"))
    with open(ledger.path, "w") as f:
        json.dump({"999999999": {"held": 1 << 40, "pending": 0}}, f)  # no such pid
    assert ledger.usage() == {}
    with open(ledger.path, "w") as f:
        f.write("{torn")
    ledger.request(10, budget=100, what="x")
    assert ledger.usage() == {str(os.getpid()): {"held": 0, "pending": 10}}


def _rank_body(rank: int, world: int, ledger_dir: str, budget: int) -> None:
    import torch.distributed as dist

    os.environ["TORCHFERRY_LEDGER_DIR"] = ledger_dir
    t = torch.ones(1 << 18)  # 1 MiB per rank
    ferry = Ferry(t, host_budget_bytes=budget)
    # Rank 0 takes its pool first; rank 1 then finds the budget used by rank 0.
    if rank == 0:
        ferry.offload()
    dist.barrier()
    if rank == 1:
        with pytest.raises(HostBudgetError, match=r"1 process\(es\) of this node"):
            ferry.offload()
        assert ferry.residency is Residency.DEVICE and torch.equal(t, torch.ones(1 << 18))
    dist.barrier()
    if rank == 0:
        ferry.reload()
        ferry.release_host()
    dist.barrier()
    if rank == 1:
        ferry.offload()  # rank 0 gave its pool back
        ferry.reload()
        assert torch.equal(t, torch.ones(1 << 18))
    dist.barrier()


def test_ranks_of_a_node_share_one_budget(tmp_path):
    run_spawned(functools.partial(_rank_body, ledger_dir=str(tmp_path), budget=(1 << 20) + (1 << 19)), world=2)


def test_background_reserve_then_offload_is_bit_exact():
    m, opt = _trained()
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    fut = ferry.reserve_host(background=True)
    ferry.offload().wait()  # may arrive before the pool is ready: waits for it
    assert fut.result(timeout=60) >= 0.0 and ferry.host_bytes >= ferry.state_bytes
    ferry.reload().wait()
    assert_same(before, snapshot(m, opt))
    assert ferry.reserve_host(background=True).result() == 0.0  # already fits


def test_background_reserve_failure_surfaces_at_offload(monkeypatch):
    import torchferry._pool as pool_mod

    def boom(*a, **k):
        raise RuntimeError("torchferry: could not allocate a host pool (simulated)")

    t = torch.arange(1000.0)
    ferry = Ferry(t)
    with monkeypatch.context() as mp:
        mp.setattr(pool_mod, "HostBuffer", boom)
        fut = ferry.reserve_host(background=True)
        with pytest.raises(RuntimeError, match="simulated"):
            fut.result(timeout=60)
        with pytest.raises(RuntimeError, match="simulated"):
            ferry.offload()
        assert ferry.residency is Residency.DEVICE and torch.equal(t, torch.arange(1000.0))
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(1000.0))
    assert str(os.getpid()) in NodeLedger().usage()  # the failed one was settled, the new one held
    assert NodeLedger().usage()[str(os.getpid())]["pending"] == 0


def test_release_host_while_offloaded_is_refused():
    t = torch.ones(10)
    ferry = Ferry(t)
    ferry.offload()
    with pytest.raises(RuntimeError, match=r"release_host\(\) while the state is offloaded.*reload\(\) first"):
        ferry.release_host()
    assert ferry.residency is Residency.HOST
    ferry.reload()
    assert torch.equal(t, torch.ones(10))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GB"])
def test_byte_options_are_validated(bad):
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Ferry(torch.ones(3), max_pinned_bytes=bad)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Ferry(torch.ones(3), host_budget_bytes=bad)


def test_pin_boundary_never_splits_a_copy():
    sizes = [3 << 20, 0, 100, 5 << 20, 2000, 1 << 20]
    offsets, total, chunks = layout(sizes)
    ends = sorted([offsets[i] + n for i, n in enumerate(sizes) if n >= 1 << 20] + [c.pool_offset + c.nbytes for c in chunks])
    assert _pin_boundary(offsets, sizes, chunks, total) == total
    assert _pin_boundary(offsets, sizes, chunks, 0) == 0
    for cap in (1, (3 << 20) + 10, (8 << 20) + 600, total - 1):
        b = _pin_boundary(offsets, sizes, chunks, cap)
        assert b <= cap and (b == 0 or b in ends)
        assert all(e <= b or e > cap for e in ends)  # the largest copy end under the cap


def test_partly_pinned_pool_round_trip_on_cpu():
    ts = [torch.randn(1 << 18) for _ in range(3)] + [torch.randn(7) for _ in range(5)]
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts, max_pinned_bytes=(1 << 20) + 100)
    for _ in range(2):
        ferry.offload()
        ferry.reload()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


def test_cached_plan_follows_replaced_parameters_and_new_grads():
    m = nn.Linear(4, 4)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    first = ferry._set.cache.plan
    ferry.offload()
    ferry.reload()
    assert ferry._set.cache.plan is first  # steady cycles reuse the plan
    m.weight = nn.Parameter(torch.full((4, 4), 3.0))  # a new tensor object
    ferry.offload()
    assert in_host_pool(m.weight.data_ptr()) and torch.equal(m.weight, torch.full((4, 4), 3.0))
    ferry.reload()
    assert torch.equal(m.weight, torch.full((4, 4), 3.0)) and ferry._set.cache.plan is not first
    m(torch.ones(1, 4)).sum().backward()  # grads appear: the plan grows
    ferry.offload()
    assert in_host_pool(m.weight.grad.data_ptr()) and ferry.state_bytes == 2 * (64 + 16)
    ferry.reload()
    with torch.no_grad():
        m.weight.data = m.weight.data.t()  # same storage, other strides: the host views follow
    want = m.weight.detach().clone()
    ferry.offload()
    assert m.weight.stride() == (1, 4)
    ferry.reload()
    assert torch.equal(m.weight, want) and m.weight.stride() == (1, 4)


# ------------------------------------------------- found by review (each failed before its fix)
def test_replanned_state_never_reuses_the_old_plans_host_views():
    """A buffer changes size and the ferry re-plans in reserve_host(): the host views made for
    the old plan must not be taken for the new one (they were keyed by id(plan), reusable)."""
    m = nn.Linear(1000, 1, bias=False)
    m.register_buffer("b", torch.arange(4, dtype=torch.float32))
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    for i in range(50):
        m.b = torch.tensor([i % 251], dtype=torch.uint8)
        ferry.reserve_host()
        w, b = m.weight.detach().clone(), m.b.clone()
        ferry.offload()
        assert m.b.dtype == torch.uint8 and tuple(m.b.shape) == (1,) and torch.equal(m.b, b)
        ferry.reload()
        assert torch.equal(m.b, b) and torch.equal(m.weight, w)


def test_pool_growth_through_offload_frees_the_old_block_first():
    """Growing state through offload(): the old block is unmapped before the new one is asked
    of the ledger, so a budget that holds the new pool (not both) grants it."""
    m = nn.Linear(1000, 1000, bias=False)  # a 4.0 MB pool
    ferry = Ferry(m, host_budget_bytes=6_000_000)
    ferry.offload()
    ferry.reload()
    m.bias = nn.Parameter(torch.zeros(200_000))  # 4.8 MB: fits the budget, old + new would not
    w = m.weight.detach().clone()
    ferry.offload()
    ferry.reload()
    assert torch.equal(m.weight, w) and torch.equal(m.bias, torch.zeros(200_000))
    assert NodeLedger().usage()[str(os.getpid())]["held"] == ferry.host_bytes == 4_800_000


def test_share_memory_after_a_cached_plan_is_refused():
    m = nn.Linear(4, 4)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    m.share_memory()
    with pytest.raises(NotImplementedError, match="shared memory"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE and m.weight.untyped_storage().nbytes() == 64


def test_budget_inf_and_a_ledger_of_another_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "inf")
    with pytest.raises(ValueError, match="'inf' is not a number of bytes"):
        Ferry(torch.ones(3))
    monkeypatch.delenv("TORCHFERRY_HOST_BUDGET_BYTES")
    ledger = NodeLedger()
    for junk in ("[]", '{"%d": 5}' % os.getpid()):
        with open(ledger.path, "w") as f:
            f.write(junk)
        t = torch.ones(10)
        ferry = Ferry(t)
        ferry.offload()
        ferry.reload()
        ferry.close()
        assert torch.equal(t, torch.ones(10))
