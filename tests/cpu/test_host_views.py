"""The pool's layout and its host views (``_host/layout.py``, ``_transfer/packing.py``): slots aligned or
packed, pin boundaries, one storage per slot (an offloaded tensor pickles only its own bytes,
reported against commit df8fb81), views that outlive the pool or the ferry.
"""

from __future__ import annotations

import gc
import io
import pickle

import pytest
import torch
from torch import nn

from tests.helpers import trained
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool
from torchferry._core._host.layout import pin_boundary as _pin_boundary
from torchferry._core._host.slots import PACK_BELOW, layout


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


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
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


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
def test_partly_pinned_pool_round_trip_on_cpu():
    ts = [torch.randn(1 << 18) for _ in range(3)] + [torch.randn(7) for _ in range(5)]
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts, max_pinned_bytes=(1 << 20) + 100)
    for _ in range(2):
        ferry.offload()
        ferry.reload()
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
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


def test_host_views_outlive_the_pool():
    m = nn.Linear(32, 32)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    ferry = Ferry(m)
    ferry.offload()
    sd = m.state_dict()  # host views of the pool
    ferry.reload()
    ferry.close()
    gc.collect()
    for k in want:  # still mapped: the block goes with its last view
        torch.testing.assert_close(sd[k], want[k], atol=0, rtol=0)


def test_ferry_dropped_while_offloaded_leaves_the_host_copy_readable():
    t = torch.randn(4096)
    want = t.clone()
    f = Ferry(t)
    f.offload()
    del f
    gc.collect()
    torch.testing.assert_close(t, want, atol=0, rtol=0)


def test_offloaded_tensor_pickles_saves_and_shares_only_its_own_bytes():
    m, opt = trained(ids=torch.tensor([[1, 2, 3]]))
    resident = io.BytesIO()
    torch.save(m.state_dict(), resident)
    ferry = Ferry(m, opt)
    ferry.offload()
    bias = m.proj.bias
    assert len(pickle.dumps(bias)) < bias.nbytes + 4096
    offloaded = io.BytesIO()
    torch.save(m.state_dict(), offloaded)
    assert len(offloaded.getvalue()) <= len(resident.getvalue()) + 4096
    want = bias.detach().clone()
    bias.untyped_storage().share_memory_()  # what a torch.multiprocessing queue put does
    assert bias.untyped_storage().nbytes() == bias.nbytes  # only its own bytes were moved
    assert all(in_host_pool(p.data_ptr()) for n, p in m.named_parameters() if "proj.bias" not in n and p.numel())
    ferry.reload()
    assert torch.equal(bias, want)
    with torch.no_grad():
        bias.add_(1)
    ferry.offload()  # the moved slot is noticed: the host view is made again
    assert in_host_pool(bias.data_ptr()) and torch.equal(bias, want + 1)
    ferry.reload()
    assert torch.equal(bias, want + 1)


def test_thousands_of_small_tensors_round_trip_through_packing():
    from torchferry._core._host import slots

    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(int(n), generator=g) for n in torch.randint(1, 70_000, (3000,), generator=g)]
    ts += [torch.randint(0, 2, (5,), generator=g).bool(), torch.randn(2 << 18, generator=g)]  # + one large
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    ferry.offload()
    chunks = ferry._set.host.layout(ferry._offloaded.plan).chunks
    assert len(chunks) >= 3 and sum(len(c.storages) for c in chunks) == 3001  # packed, chunked
    assert all(c.nbytes <= slots.PACK_CHUNK for c in chunks)
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
    ferry.reload()
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
    assert ferry.host_bytes < 1.01 * ferry.state_bytes


def test_packed_copy_failure_rolls_back_and_retry_works(monkeypatch):
    from torchferry._core._host.slots import PACK_BELOW

    torch.manual_seed(0)
    dts = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float64,
           torch.float8_e4m3fn, torch.complex128, torch.int64]
    ts = [torch.randn((i * 37) % 301).to(dts[i % len(dts)]) for i in range(120)]
    base = torch.randn(1000)
    ts += [base, base[3:500:7], base[10:20].view(2, 5), torch.empty(0, 3), torch.tensor(3.5), torch.randn(300_000)]
    ts += [torch.full(((PACK_BELOW - 4) // 4,), float(i)) for i in range(70)]  # > 64 MiB small: 2 chunks
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    orig, calls = torch._foreach_copy_, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return orig(*a, **k)

    for phase in ("offload", "reload"):
        if phase == "reload":
            ferry.offload()
        calls["n"] = 0
        monkeypatch.setattr(torch, "_foreach_copy_", flaky)
        with pytest.raises(RuntimeError, match="injected"):
            getattr(ferry, phase)()
        monkeypatch.setattr(torch, "_foreach_copy_", orig)
        assert ferry.residency is (Residency.DEVICE if phase == "offload" else Residency.HOST)
        assert all(torch.equal(a, b) for a, b in zip(ts, want))
    ferry.reload()
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, want))


@pytest.mark.parametrize("op", ["cat", "split_with_sizes_copy"])
def test_dense_chunks_one_op_each_way_bit_exact_and_rolled_back_on_failure(monkeypatch, op):
    """Chunks without padding (sizes multiples of 16 B) gather with one torch.cat(out=) and scatter
    with one torch.split_with_sizes_copy(out=) ([Note: packing pipeline]); a failure there leaves
    the state where it was, and the next call works."""
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(4 * int(n), generator=g) for n in torch.randint(1, 3000, (600,), generator=g)]  # 16-B multiples
    ts += [torch.randn(3, generator=g).to(torch.bfloat16)]  # 6 B: one chunk with padding too
    want = [t.clone() for t in ts]
    ferry = Ferry(*ts)
    ferry.offload()
    chunks = ferry._set.host.layout(ferry._offloaded.plan).chunks
    assert chunks[0].dense and sum(c.dense for c in chunks) >= 1
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
    ferry.reload()
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
    orig = getattr(torch, op)

    def broken(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(torch, op, broken)
    phase = "offload" if op == "cat" else "reload"
    if phase == "reload":
        monkeypatch.setattr(torch, op, orig)
        ferry.offload()
        monkeypatch.setattr(torch, op, broken)
    with pytest.raises(RuntimeError, match="injected"):
        getattr(ferry, phase)()
    monkeypatch.setattr(torch, op, orig)
    assert all(t.device.type == "cpu" for t in ts)
    getattr(ferry, phase)()
    if phase == "offload":
        ferry.reload()
    assert all(torch.equal(a, b) for a, b in zip(ts, want))
