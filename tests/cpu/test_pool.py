"""The host pool (``_host/pool.py``) and the reload arena (``_transfer/arena.py``): exact size,
persistence, growth, and failures while growing.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from torchferry import Ferry
from torchferry._core._host.budget import NodeLedger
from torchferry._core._host.pool import HostPool


def test_pool_is_exact_size_persistent_and_grows():
    pool = HostPool(pin=False)
    assert pool.nbytes == 0
    pool.reserve(10_000)
    assert pool.nbytes == 10_000
    first = pool.view(0, 10)
    pool.reserve(5_000)  # smaller: kept
    assert pool.nbytes == 10_000 and pool.view(0, 10).data_ptr() == first.data_ptr()
    pool.reserve(20_000)
    assert pool.nbytes == 20_000
    pool.release()
    assert pool.nbytes == 0
    with pytest.raises(AssertionError, match="outside the pool"):
        pool.view(0, 1)


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
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


def test_failed_pool_growth_does_not_break_later_offloads(monkeypatch):
    import torchferry._core._host.memory as hm

    m = nn.Linear(16, 16)
    opt = torch.optim.Adam(m.parameters())
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload()
    m(torch.randn(2, 16)).sum().backward()
    opt.step()  # the state grows: the next offload needs a larger pool

    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hm, "_Mapping", no_memory)
    with pytest.raises(RuntimeError, match="could not allocate a host pool"):
        ferry.offload()
    monkeypatch.undo()
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # back to the first layout
    ferry.offload()
    ferry.reload()


@pytest.mark.parametrize(
    "conf", ["expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"]
)
def test_reload_arena_off_for_allocator_settings_it_cannot_rely_on(monkeypatch, conf):
    from torchferry._core._transfer import arena as _device_alloc

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    _device_alloc.arena_supported.cache_clear()
    try:
        assert not _device_alloc.arena_supported()
        assert _device_alloc.ReloadArena.seed(torch.device("cuda", 0), [1 << 30]) is None
    finally:
        _device_alloc.arena_supported.cache_clear()


MiB = 1 << 20


def test_best_fit_replays_the_allocators_large_pool():
    """Smallest block that holds each request, split when more than 1 MiB is left; requests no block
    holds are new segments (their rest free for the next requests)."""
    from torchferry._core._transfer.arena import best_fit

    assert best_fit([100 * MiB, 40 * MiB], [30 * MiB, 30 * MiB, 30 * MiB]) == (0, 0)  # 40 -> 10 left, 100 -> 70 -> 40
    assert best_fit([40 * MiB], [64 * MiB]) == (64 * MiB, 0)
    # a new 64 MiB segment for a 63 MiB request leaves 1 MiB: not split off, so the next request is new too
    assert best_fit([], [63 * MiB, MiB + 512]) == (63 * MiB + MiB + 512, 0)
    # ten 2 MiB requests: one 20 MiB segment, its rest served to the nine others: all new memory
    assert best_fit([], [2 * MiB] * 10) == (20 * MiB, 0)
    # the arena is the largest block: the cached blocks are taken first, the arena's rest is its tail
    assert best_fit([32 * MiB], [32 * MiB, 64 * MiB], arena=100 * MiB) == (0, 36 * MiB)
    # an arena smaller than a cached block takes a request that block would have held
    assert best_fit([200 * MiB], [64 * MiB], arena=64 * MiB) == (0, 0)


def test_the_arena_is_sized_for_what_the_cached_blocks_cannot_hold():
    """The verl step's log-prob reload (tests/gpu/test_memory_beside_verl_cuda.py): cached blocks that
    hold every storage leave no arena (one the size of the state was a 3.2 GB filler beside it); a cache
    that holds part leaves an arena for the rest, with no tail of a segment rounding or more."""
    from torchferry._core._transfer.arena import arena_bytes, best_fit

    sizes = [256 * MiB] + [64 * MiB] * 48 + [256 * MiB]  # 3.5 GiB of storages
    assert arena_bytes([2048 * MiB, 1600 * MiB], sizes) == 0
    assert arena_bytes([], sizes) == sum(sizes)
    free = [1024 * MiB, 300 * MiB, 10 * MiB]
    a = arena_bytes(free, sizes)
    unplaced, tail = best_fit(free, sizes, a)
    assert unplaced == 0 and tail < 2 * MiB
    assert a <= sum(sizes) - 1024 * MiB - 256 * MiB  # the cached 1 GiB and one 256 MiB storage's worth stay out
    assert arena_bytes([], [32 * MiB]) == 0  # under 64 MiB: one cudaMalloc per storage is cheap
    assert arena_bytes([], [2 * MiB] * 100) == 200 * MiB  # ten 20 MiB segments otherwise
