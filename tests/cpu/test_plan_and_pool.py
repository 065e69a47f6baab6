"""Planning (collection, deduplication, validation) and the pool's slot layout."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from torchferry._plan import build_plan, resolve_device as _resolve_device
from torchferry._packing import PACK_BELOW, layout
from torchferry._pool import HostPool
from tests.helpers import Mixed


def test_tied_weights_and_views_move_once():
    m = Mixed()
    base = torch.arange(12.0)
    view = base[2:8].view(2, 3)
    plan = build_plan([m, base, view])
    # emb.weight and head.weight are one Parameter; base and view share a storage.
    names = [r.name for r in plan.tensors]
    assert sum("emb.weight" in n or "head.weight" in n for n in names) == 1
    storages = {r.storage_index for r in plan.tensors if r.name.startswith("tensors")}
    assert len(storages) == 1
    assert plan.state_bytes == sum(s.nbytes() for s in plan.storages)
    assert len({s._cdata for s in plan.storages}) == len(plan.storages)


def test_zero_size_storages_are_not_merged():
    a, b = torch.empty(0), torch.empty(0, 3)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    plan = build_plan([a, b])
    assert len(plan.storages) == 2 and plan.nbytes == [0, 0]


def test_grads_and_optimizer_state_are_collected():
    m = nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = [r.name for r in build_plan([m, opt]).tensors]
    assert "Linear.weight.grad" not in names  # two targets: prefixed by index
    assert "targets[0].weight.grad" in names
    assert {"optimizer.state[0]['exp_avg']", "optimizer.state[0]['exp_avg_sq']", "optimizer.state[0]['step']"} <= set(names)


@pytest.mark.parametrize(
    "targets, exc, match",
    [
        ((), ValueError, "at least one target"),
        ((nn.Linear(2, 2), "weights"), TypeError, r"targets\[1\] is str"),
        ((torch.empty(3, device="meta"),), NotImplementedError, r"meta tensor .*t.shape=torch.Size\(\[3\]\)"),
        ((torch.from_numpy(np.zeros(4)),), NotImplementedError, "cannot be resized"),
        ((torch.eye(3).to_sparse(),), NotImplementedError, "layout"),
        ((list(nn.Linear(2, 2).parameters()),), TypeError, r"targets\[0\] is list \(pass tensors as separate arguments"),
    ],
)
def test_bad_targets_raise_clear_errors(targets, exc, match):
    with pytest.raises(exc, match=match):
        build_plan(list(targets))


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        build_plan([nn.Linear(2, 2)], "cuda")


def test_several_devices_are_refused():
    found = [
        ("a", None, SimpleNamespace(device=torch.device("cuda", 0))),
        ("b", None, SimpleNamespace(device=torch.device("cuda", 1))),
    ]
    with pytest.raises(ValueError, match=r"several devices \(a on cuda:0, b on cuda:1\)"):
        _resolve_device(found, None)
    with pytest.raises(ValueError, match="a is on cuda:0, but the ferry's device is cpu"):
        _resolve_device(found[:1], torch.device("cpu"))


def test_layout_large_slots_aligned_small_ones_packed_in_chunks():
    sizes = [3, 0, 512, 1000, 3 << 20, 7, 16, 600, 2 << 20]
    offsets, total, chunks = layout(sizes, chunk=1024)
    large = [i for i, n in enumerate(sizes) if n >= PACK_BELOW]
    small = [i for i, n in enumerate(sizes) if 0 < n < PACK_BELOW]
    assert all(offsets[i] % 512 == 0 for i in large)
    assert all(offsets[i] % 16 == 0 for i in small)
    assert max(offsets[i] for i in large) < min(offsets[i] for i in small)  # large first
    spans = sorted((offsets[i], offsets[i] + sizes[i]) for i in large + small)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    assert total == spans[-1][1]
    # chunks: consecutive, within the bound (but for a single larger storage), covering all small ones
    assert [si for ch in chunks for si in ch.storages] == small
    for ch in chunks:
        assert ch.nbytes <= 1024 or len(ch.storages) == 1
        for si, o in zip(ch.storages, ch.offsets):
            assert offsets[si] == ch.pool_offset + o
    # many scalars pack at 16 B each
    _, total, chunks = layout([4] * 10_000)
    assert total == 16 * 9_999 + 4 and len(chunks) == 1
    # a Qwen2.5-7B-like shard layout stays within 1.0001x
    shard_sizes = [545_128_448] * 2 + [25_690_112, 3_670_016, 3_670_016, 25_690_112, 135_790_592 * 3, 7168] * 28
    _, total, _ = layout(shard_sizes)
    assert total <= 1.0001 * sum(shard_sizes)


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


@pytest.mark.parametrize(
    "conf", ["expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"]
)
def test_reload_arena_off_for_allocator_settings_it_cannot_rely_on(monkeypatch, conf):
    from torchferry import _device_alloc

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    _device_alloc.arena_supported.cache_clear()
    try:
        assert not _device_alloc.arena_supported()
        assert _device_alloc.ReloadArena.seed(torch.device("cuda", 0), [1 << 30]) is None
    finally:
        _device_alloc.arena_supported.cache_clear()
