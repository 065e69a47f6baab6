"""Skipping unchanged storages at offload (``_schedules/unchanged.py``): the hash; every kind
of write seen; frozen, never-trained and LoRA-like state; bit-exact cycles; verify mode; swap; FSDP2."""

from __future__ import annotations

import random
import struct
import types
from functools import partial

import pytest
import torch
from torch import nn

import torchferry
import torchferry._core._schedules.hash as hash_mod
import torchferry._core._schedules.unchanged as unchanged_mod
from tests.helpers import snapshot, train_step
from tests.spawn import run_spawned
from torchferry import Ferry, Residency
from torchferry._core._host.slots import layout
from torchferry._core._schedules.release import ReleaseSchedule
from torchferry._core._schedules.hash import LANES, hash_bytes, hash_packed

pytestmark = pytest.mark.usefixtures("own_ledger")  # each test its own node ledger (tests/conftest.py)


def _reference_hash(b: bytes) -> list[int]:
    """The hash of [Note: unchanged storages] in plain Python integers (mod 2**64)."""
    _M64, nw = (1 << 64) - 1, len(b) // 8
    values = [struct.unpack("<q", b[8 * i:8 * i + 8])[0] for i in range(nw)] + list(b[8 * nw:])
    out = []
    for g, rounds in LANES:
        total = 0
        for p, v in enumerate(values):
            z = (v + (p + 1) * g) & _M64
            for shift, mult in rounds:
                if shift is not None:
                    z ^= z >> shift
                if mult is not None:
                    z = (z * mult) & _M64
            total = (total + z) & _M64
        out.append(total - (1 << 64) if total >= 1 << 63 else total)
    return out


def assert_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact: the same keys, dtypes, shapes and bytes (``-0.0``, NaN payloads included)."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        x, y = v.detach().cpu().contiguous(), b[k].detach().cpu().contiguous()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


def _u8(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------------- the hash
@pytest.mark.parametrize("piece", [hash_mod.HASH_PIECE, 16])
def test_hash_matches_a_plain_python_reference_for_odd_sizes(monkeypatch, piece):
    monkeypatch.setattr(hash_mod, "HASH_PIECE", piece)  # 16: many pieces per storage
    rng = random.Random(0)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 257, 1001):
        b = bytes(rng.getrandbits(8) for _ in range(n))
        h = hash_bytes(_u8(b))
        assert h.dtype == torch.int64 and h.tolist() == _reference_hash(b), n
        assert torch.equal(hash_bytes(_u8(b)), h)  # same bytes, same hash
        if n:  # the same bytes at an odd offset of another buffer
            assert torch.equal(hash_bytes(_u8(b"xyz" + b)[3:]), h)
    assert hash_bytes(torch.empty(0, dtype=torch.uint8)).tolist() == [0, 0]
    with pytest.raises(ValueError):
        hash_bytes(torch.zeros(4))


def test_hash_changes_on_every_random_flip_and_write():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=g)  # odd size: a tail
    base = hash_bytes(data)
    rng = random.Random(2)
    seen = set()
    for _ in range(600):
        d = data.clone()
        kind = rng.randrange(4)
        if kind == 3:  # the top bit of two words (two float64 signs): needs right shifts in the mix
            w = d[: d.numel() // 8 * 8].view(torch.int64)
            for i in rng.sample(range(w.numel()), 2):
                w[i] ^= -(1 << 63)
        elif kind == 0:  # one bit
            i = rng.randrange(d.numel())
            d[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a random run of bytes
            i = rng.randrange(d.numel() - 64)
            d[i:i + 64] = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
            if torch.equal(d, data):
                continue
        else:  # two words exchanged (position matters)
            i, j = rng.sample(range(d.numel() // 8), 2)
            w = d[: d.numel() // 8 * 8].view(torch.int64)
            if w[i] == w[j]:
                continue
            w[i], w[j] = w[j].clone(), w[i].clone()
        h = hash_bytes(d)
        assert not torch.equal(h, base)
        assert (h != base).all(), "both 64-bit lanes change"
        seen.add(tuple(h.tolist()))
    assert len(seen) > 500  # distinct changes, distinct hashes


def test_hash_packed_is_per_storage_and_sees_flips():
    sizes = [3, 17, 64, 1, 40, 1000, 8]  # odd sizes, all packed
    _, _, chunks = layout(sizes)
    (ch,) = chunks
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    members = list(range(len(ch.storages)))
    order = [srcs[si] for si in ch.storages]
    full = hash_packed(ch, members, order)
    for j in members:  # alone or beside its neighbours: the same hash
        assert torch.equal(hash_packed(ch, [j], [order[j]])[0], full[j])
    for j in members:
        for bit in range(0, 8 * order[j].numel(), max(1, order[j].numel())):
            flipped = order[j].clone()
            flipped[bit // 8] ^= 1 << (bit % 8)
            h = hash_packed(ch, members, order[:j] + [flipped] + order[j + 1:])
            assert not torch.equal(h[j], full[j])
            others = [k for k in members if k != j]
            assert torch.equal(h[others], full[others])


def test_copy_runs_copies_exactly_the_storages_not_skipped():
    from torchferry._core._transfer.copies import copy_runs
    from torchferry._core._transfer.packing import pack_to_host

    sizes = [24, 3, 40, 17, 64, 5, 8, 100]  # odd sizes: padding between them
    offsets, total, chunks = layout(sizes)
    g = torch.Generator().manual_seed(4)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    for skip in ({1}, {0, 7}, {2, 3, 5}, set(range(8)) - {4}, set(range(8)), set()):
        pool = torch.full((total,), 0xAA, dtype=torch.uint8)
        pool_chunks = [pool[ch.pool_offset:ch.pool_offset + ch.nbytes] for ch in chunks]
        sub, sub_pool = copy_runs(chunks, pool_chunks, skip)
        assert sorted(si for ch in sub for si in ch.storages) == sorted(set(range(8)) - skip)
        pack_to_host(sub, sources, sub_pool, torch.device("cpu"))
        for si, (o, n) in enumerate(zip(offsets, sizes)):
            want = torch.full((n,), 0xAA, dtype=torch.uint8) if si in skip else sources[si]
            assert torch.equal(pool[o:o + n], want), (skip, si)


# ----------------------------------------------------------------------------- the ferry
def _model() -> nn.Sequential:
    """Linear(512, 512) weights are over 1 MiB (moved alone); biases and BatchNorm are packed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 512))


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.fixture
def verify(monkeypatch):
    monkeypatch.setenv("TORCHFERRY_VERIFY_SKIPS", "1")  # read by each Ferry() the test makes


def test_never_trained_model_is_not_copied_and_cycles_are_bit_exact(verify):
    m = _model().eval()
    m.register_buffer("odd", torch.tensor([-0.0, float("nan"), 1e-45, float("-inf")]))
    m.odd.view(torch.int32)[1] |= 0x1234  # a NaN payload
    want = snapshot(m)
    ferry = Ferry(m, skip_unchanged=True)
    copied = []
    for _ in range(4):
        h = ferry.offload()
        copied.append(ferry.stats.offload_bytes_copied)
        assert h.bytes_copied == copied[-1] and h.nbytes == ferry.state_bytes
        assert_bits(want, snapshot(m))  # the host copies
        ferry.reload()
        with torch.no_grad():
            m(torch.randn(4, 512))  # eval: reads only
        assert_bits(want, snapshot(m))
    assert copied == [ferry.state_bytes, 0, 0, 0]
    assert ferry.stats.last_offload_bytes == ferry.state_bytes


def test_skip_unchanged_off_copies_everything():
    m = _model()
    ferry = Ferry(m)
    for _ in range(2):
        h = ferry.offload()
        assert ferry.stats.offload_bytes_copied == ferry.state_bytes == h.bytes_copied == h.nbytes
        ferry.reload()


def _nograd(fn):
    def run():
        with torch.no_grad():
            fn()
    return run


# name -> prepare(m): runs while resident before the offload, returns the write made after the reload
WRITES = {
    "inplace": lambda m: _nograd(lambda: m[0].weight.mul_(1.5)),
    "copy_": lambda m: _nograd(lambda: m[2].weight.copy_(torch.ones(512, 512))),
    "data_large": lambda m: lambda: m[0].weight.data[3].add_(1),  # .data: a new version counter
    "data_small": lambda m: lambda: m[2].bias.data[1:2].fill_(7.0),  # a packed storage
    "assign_data": lambda m: lambda: setattr(m[0].weight, "data", m[0].weight.data.clone() + 1),
    "view_before": lambda m: _nograd(partial(torch.Tensor.add_, m[0].weight[2], 1)),  # shares the counter
    "data_view_before": lambda m: partial(torch.Tensor.add_, m[2].weight.data[5:7], 1),  # does not
    "foreach": lambda m: _nograd(lambda: torch._foreach_add_([m[0].weight, m[2].bias], 1.0)),
    "load_state_dict": lambda m: partial(
        m.load_state_dict, {k: v + 1 if v.is_floating_point() else v for k, v in m.state_dict().items()}),
    "batchnorm": lambda m: _nograd(lambda: m.train()(torch.randn(8, 512))),  # running statistics
    "sgd": lambda m: partial(train_step, m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(4, 512),
                             set_to_none=True),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_every_kind_of_write_is_copied(verify, name):
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    write = WRITES[name](m)
    before = snapshot(m)
    ferry.offload()  # nothing written since the reload: nothing copied
    assert ferry.stats.offload_bytes_copied == 0
    ferry.reload()
    write()
    after = snapshot(m)
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed, "the write changed nothing"
    ferry.offload()
    if name in ("assign_data", "load_state_dict"):  # re-planned; or every tensor written (same values too)
        assert ferry.stats.offload_bytes_copied == ferry.state_bytes
    else:
        named = dict(m.named_parameters()) | dict(m.named_buffers())
        want = _storage_bytes(named[k.removeprefix("buf.")] for k in changed)
        assert ferry.stats.offload_bytes_copied == want, changed
    assert ferry.residency is Residency.HOST
    assert_bits(after, snapshot(m))  # the host copies hold the write
    ferry.reload()
    assert_bits(after, snapshot(m))


def test_write_to_an_inference_tensor_is_seen(verify):
    from tests.helpers import WithRotary

    torch.manual_seed(0)
    m = WithRotary()  # its buffer is an inference tensor: no version counter
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    with torch.inference_mode():
        m.cos.add_(1)
    want = snapshot(m)
    ferry.offload()
    assert ferry.stats.offload_bytes_copied == m.cos.untyped_storage().nbytes() == 32
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_lora_like_training_copies_only_adapters_and_optimizer_state(verify):
    def build():
        torch.manual_seed(0)
        m = nn.ModuleDict({"base0": nn.Linear(512, 512), "norm": nn.LayerNorm(512), "base1": nn.Linear(512, 512),
                           "a": nn.Linear(512, 8, bias=False), "b": nn.Linear(8, 512, bias=False)})
        for k in ("base0", "norm", "base1"):
            m[k].requires_grad_(False)
        nn.init.normal_(m["b"].weight)
        return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)

    def step(m, opt, x):
        h = m["norm"](m["base0"](x))
        (m["base1"](h) + m["b"](m["a"](h))).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ref, ref_opt = build()
    m, opt = build()
    ferry = Ferry(m, opt, skip_unchanged=True)
    xs = [torch.randn(4, 512, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    copied = []
    for x in xs:
        step(ref, ref_opt, x)
        step(m, opt, x)
        ferry.offload()
        copied.append(ferry.stats.offload_bytes_copied)
        ferry.reload()
        assert_bits(snapshot(ref, ref_opt), snapshot(m, opt))
    trained = [m["a"].weight, m["b"].weight] + [v for st in opt.state.values() for v in st.values()]
    want = _storage_bytes(trained)
    frozen = _storage_bytes(p for k in ("base0", "norm", "base1") for p in m[k].parameters())
    assert copied[0] == ferry.state_bytes == want + frozen  # no baseline before the first reload
    assert copied[1:] == [want] * 3


def test_prefetch_reload_without_units_takes_the_baseline(verify):
    """Tensors and an optimizer in one ferry, no module: reload(prefetch=True) is layer-wise (one tail
    group); the baseline is hashed when the group's copies are issued, versions when it is resident."""
    m = _model().eval()
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1, momentum=0.9)
    train_step(m, opt, torch.randn(4, 512), set_to_none=True)
    m.zero_grad(set_to_none=True)
    frozen = list(m[0].parameters())
    ferry = Ferry(*frozen, m[2].weight, m[2].bias, opt, skip_unchanged=True)
    moments = _storage_bytes(v for st in opt.state.values() for v in st.values())
    for write in (False, True):
        ferry.offload()
        ferry.reload(prefetch=True)
        assert ferry.residency is Residency.PREFETCHING
        ferry.reload()  # completes it
        if write:
            m[2].weight.data[0] += 1
            with torch.no_grad():
                m[0].bias.mul_(2)
        want = snapshot(m, opt)
        ferry.offload()
        changed = _storage_bytes([m[2].weight, m[0].bias]) if write else 0
        assert ferry.stats.offload_bytes_copied == moments + changed
        ferry.reload()
        assert_bits(want, snapshot(m, opt))


def test_a_new_pool_or_plan_copies_everything(verify):
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    for drop in (ferry.release_host, ferry.forget_plan, None):  # a new pool block; a new plan; neither
        if drop is not None:
            drop()
        ferry.offload()
        assert ferry.stats.offload_bytes_copied == (ferry.state_bytes if drop else 0)
        ferry.reload()


def test_verify_mode_raises_on_a_write_only_the_hash_sees(verify, monkeypatch):
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    ferry.offload()  # clean: verify passes
    ferry.reload()
    real = hash_mod.hash_storages

    def stale(kind, out, todo, *args):  # a hash blind to the write: every storage "equal"
        real(kind, out, todo, *args)
        if out.data_ptr() != baseline.data_ptr():
            out.copy_(baseline)

    baseline = ferry._set.unchanged._hashes
    monkeypatch.setattr(unchanged_mod, "hash_storages", stale)
    m[0].weight.data[0, 0] += 1  # no version bump: only the hash would see it
    want = snapshot(m)
    with pytest.raises(RuntimeError, match=r"Sequential\.0\.weight.*differs from its host copy"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE  # nothing moved
    monkeypatch.undo()
    ferry.offload()  # the baseline was consumed: everything copied
    assert ferry.stats.offload_bytes_copied == ferry.state_bytes
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_hashing_out_of_memory_falls_back_to_copying(verify, monkeypatch):
    m = _model().eval()
    want = snapshot(m)
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with monkeypatch.context() as mp:
        mp.setattr(unchanged_mod, "hash_storages", oom)
        ferry.reload()  # the baseline is dropped, the reload is complete
    assert ferry.residency is Residency.DEVICE
    ferry.offload()
    assert ferry.stats.offload_bytes_copied == ferry.state_bytes
    ferry.reload()
    with monkeypatch.context() as mp:
        mp.setattr(unchanged_mod, "hash_storages", oom)
        ferry.offload()  # memory short at the offload: copies instead
    assert ferry.stats.offload_bytes_copied == ferry.state_bytes
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_swap_releases_skipped_storages_at_once(verify):
    a, b = _model().eval(), _model().eval()
    want_a, want_b = snapshot(a), snapshot(b)
    fa, fb = Ferry(a, skip_unchanged=True), Ferry(b, skip_unchanged=True)
    fb.offload()
    for _ in range(3):
        torchferry.swap(fa, fb)
        torchferry.swap(fb, fa)
    assert fa.stats.offload_bytes_copied == 0 and fb.stats.offload_bytes_copied == 0
    assert_bits(want_a, snapshot(a))
    fb.reload()
    assert_bits(want_b, snapshot(b))


def test_release_schedule_frees_unchanged_storages_at_once_and_counts_them():
    from torchferry._core._transfer.copies import D2HIssued
    from torchferry._core._state.plan import build_plan, storage_bytes
    from torchferry._core._transfer.streams import streams_for

    ts = [torch.ones(1024), torch.ones(1024), torch.ones(1024)]  # 4 KiB each
    plan = build_plan(ts)
    sources = [storage_bytes(s, plan.device) for s in plan.storages]
    ev = types.SimpleNamespace(synchronize=lambda: None)
    issued = D2HIssued(None, None, [(4096, ev), (8192, ev)], [0, 4096, 8192])
    sched = ReleaseSchedule(budget_bytes=12288, base_bytes=12288)
    slots = [src.clone() for src in sources]  # the pool's copies
    sched.hold(plan, sources, slots, issued, streams_for(torch.device("cpu")), {0})
    assert [s.nbytes() for s in plan.storages] == [0, 4096, 4096]  # the unchanged one at once
    sched.before_alloc(4096)  # 4 KiB already gone: nothing else has to leave
    assert [s.nbytes() for s in plan.storages] == [0, 4096, 4096]
    sched.before_alloc(8192)  # 4 KiB more: the first progress event covers it
    assert [s.nbytes() for s in plan.storages] == [0, 0, 4096]
    sched.release_rest()
    assert [s.nbytes() for s in plan.storages] == [0, 0, 0]


# ---------------------------------------------------------------------- FSDP2 over gloo
def _fsdp2_checks(rank: int, world: int) -> None:
    """DTensors: a frozen model is not copied in any reload mode; AdamW(foreach=True) and _foreach_add_
    are seen; training with cycles stays bit-identical; verify mode on throughout."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["TORCHFERRY_VERIFY_SKIPS"] = "1"

    def build(mesh):  # shards of 1024 x 1024 / 2: moved alone; the biases and the last layer: packed
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 3))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))

    # 1. A frozen (reference) model: nothing copied after the first cycle, in every reload mode.
    frozen, _ = build(mesh)
    frozen.requires_grad_(False)
    with torch.no_grad():
        frozen(x)  # FSDP2's lazy init
    ferry = Ferry(frozen, skip_unchanged=True)
    w1 = frozen[1].weight._local_tensor.detach().clone()
    copied = []
    for mode in ("plain", "plain", "prefetch", "inference", "host_write", "early"):
        ferry.offload()
        copied.append(ferry.stats.offload_bytes_copied)
        ferry.reload(prefetch=mode != "plain")
        if mode == "host_write":  # to a unit's host tensor: seen, the unit copied again, then the baseline
            with torch.no_grad():
                frozen[1].weight.mul_(2)
        if mode == "early":
            ferry.offload_during_forward()
        with torch.inference_mode() if mode == "inference" else torch.no_grad():
            frozen(x)  # the units are made resident (and hashed) in its pre-hooks
        want = snapshot(frozen)
    ferry.offload()
    copied.append(ferry.stats.offload_bytes_copied)
    ferry.reload()
    assert_bits(want, snapshot(frozen))
    assert torch.equal(frozen[1].weight._local_tensor, 2 * w1)  # the host write was kept
    # Early offload leaves storages with a baseline to the offload's hash: nothing copied either.
    assert copied[0] == ferry.state_bytes and copied[1:] == [0] * 6, copied

    # 2. Training: AdamW(foreach=True) on DTensors, then _foreach_add_ on DTensors, are seen.
    ref, ref_opt = build(mesh)
    m, opt = build(mesh)
    ferry = Ferry(m, opt, skip_unchanged=True)
    for prefetch in (False, True, True):
        train_step(ref, ref_opt, x, set_to_none=True)
        train_step(m, opt, x, set_to_none=True)
        ferry.offload()
        assert ferry.stats.offload_bytes_copied == ferry.state_bytes  # every parameter stepped
        ferry.reload(prefetch=prefetch)
        with torch.no_grad():
            ref(x)
            m(x)  # completes a layer-wise reload of the units
        ferry.reload()
        assert_bits(snapshot(ref, ref_opt), snapshot(m, opt))
    ferry.offload()
    ferry.reload()
    with torch.no_grad():
        torch._foreach_add_([ref[1].weight], 1.0)
        torch._foreach_add_([m[1].weight], 1.0)
    ferry.offload()
    state = [getattr(v, "_local_tensor", v) for st in opt.state.values() for v in st.values()]
    want = _storage_bytes(state + [m[1].weight._local_tensor])
    assert ferry.stats.offload_bytes_copied == want
    ferry.reload()
    assert_bits(snapshot(ref, ref_opt), snapshot(m, opt))


def test_fsdp2_two_ranks_gloo():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(_fsdp2_checks, world=2, backend="gloo")


# ------------------------------------------------------------------ writes the counters miss
def _hashed_at_offload(monkeypatch) -> list[list[int]]:
    """Records the storages each hash call covers (baseline and offload calls alike)."""
    calls: list[list[int]] = []
    real = unchanged_mod.hash_storages

    def spy(kind, out, todo, *args):
        calls.append(list(todo))
        real(kind, out, todo, *args)

    monkeypatch.setattr(unchanged_mod, "hash_storages", spy)
    return calls


def test_an_optimizer_step_sends_trainable_storages_to_the_copy_unhashed(verify, monkeypatch):
    """The conservative rule for updates no counter sees (DTensor ``_foreach_`` steps): after any
    optimizer step, storages of tensors requiring grad are copied without hashing; frozen ones hashed."""
    m = _model().eval()
    m[:2].requires_grad_(False)  # no new .grad: the same plan
    opt = torch.optim.SGD(m[2].parameters(), lr=0.1)
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    calls = _hashed_at_offload(monkeypatch)
    train_step(m, opt, torch.randn(4, 512), set_to_none=True)
    want = snapshot(m)
    ferry.offload()
    plan = ferry._offloaded.plan
    hashed = {plan.tensors[ti].name for si in calls[-1] for ti, r in enumerate(plan.tensors) if r.storage_index == si}
    assert not any(n.startswith("Sequential.2.") for n in hashed), hashed
    assert any(n.startswith("Sequential.0.") for n in hashed), hashed
    assert ferry.stats.offload_bytes_copied == _storage_bytes(m[2].parameters())
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_an_inplace_write_to_a_host_tensor_kept_from_the_offload_is_copied_over(verify):
    """A state_dict() taken while offloaded aliases the pool; writing it after the reload writes the
    slot: the next offload must overwrite it with the device's bytes, as a full offload does."""
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    ferry.offload()
    kept = m.state_dict()  # host tensors viewing the pool
    ferry.reload()
    want = snapshot(m)
    with torch.no_grad():
        kept["0.weight"].add_(1)  # writes the pool slot, bumps the host twin's counter
    ferry.offload()
    assert ferry.stats.offload_bytes_copied == m[0].weight.untyped_storage().nbytes()
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_a_write_through_an_old_view_during_a_layer_wise_reload_is_seen(verify):
    """The baseline of a layer-wise reload is hashed right after each group's copies, so a device
    write before the group is used (through a view taken before the offload) is a change."""
    torch.manual_seed(0)
    ts = [torch.randn(512, 512), torch.randn(300)]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(8))], lr=0.1, momentum=0.9)
    opt.param_groups[0]["params"][0].grad = torch.ones(8)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ferry = Ferry(*ts, opt, skip_unchanged=True)
    old_view = ts[0].data[3]  # its own version counter, over the device storage
    ferry.offload()
    ferry.reload()
    for _ in range(2):
        ferry.offload()
        ferry.reload(prefetch=True)
        assert ferry.residency is Residency.PREFETCHING
        old_view.add_(1)  # the storage is allocated and copied into: the write lands on the device
        ferry.reload()
        want = [t.clone() for t in ts]
        ferry.offload()
        assert ferry.stats.offload_bytes_copied >= ts[0].untyped_storage().nbytes()
        ferry.reload()
        assert all(torch.equal(a, b) for a, b in zip(want, ts))


def test_a_compiled_module_writing_its_buffers_is_seen(verify):
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    compiled = torch.compile(m, backend="aot_eager")
    ferry.offload()
    ferry.reload()
    with torch.no_grad():
        compiled.train()(torch.randn(8, 512))  # BatchNorm's running statistics, in the compiled graph
    want = snapshot(m)
    ferry.offload()
    assert ferry.stats.offload_bytes_copied == _storage_bytes(m[1].buffers())
    ferry.reload()
    assert_bits(want, snapshot(m))


def test_a_baseline_is_compared_only_with_a_hash_of_its_own_kind(monkeypatch):
    kinds: list[str] = []
    real = unchanged_mod.hash_storages

    def spy(kind, out, todo, *args):
        kinds.append(kind)
        real("torch", out, todo, *args)

    monkeypatch.setattr(unchanged_mod, "hash_storages", spy)
    monkeypatch.setattr(unchanged_mod, "hash_kind", lambda device, choice: "first")
    m = _model().eval()
    ferry = Ferry(m, skip_unchanged=True)
    ferry.offload()
    ferry.reload()  # baseline taken by "first"
    monkeypatch.setattr(unchanged_mod, "hash_kind", lambda device, choice: "second")  # e.g. Triton gone
    ferry.offload()
    assert kinds == ["first", "first"] and ferry.stats.offload_bytes_copied == 0


def test_hash_kind_is_torch_on_the_cpu_and_when_forced():
    assert hash_mod.hash_kind(torch.device("cpu")) == "torch"
    assert hash_mod.hash_kind(torch.device("cpu"), "triton") == "torch"
    assert hash_mod.hash_kind(torch.device("cuda", 0), "torch") == "torch"  # TORCHFERRY_HASH=torch


@pytest.mark.parametrize("flag", ["pin_ahead", "skip_unchanged"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None, []])
def test_flags_that_are_not_bools_are_refused(flag, value):
    """``skip_unchanged="no"`` is truthy: it would turn skipping on. Refused, naming the option."""
    import torch.nn as nn

    m = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=flag):
        torchferry.Ferry(m, **{flag: value})
    assert m.weight.device.type == "cpu" and m.weight.untyped_storage().nbytes() == 64  # untouched


def test_the_fused_hash_row_table_cuts_every_range_into_pieces():
    """``_hash.row_table`` (the Triton kernel's work table, now built on the device): every range is
    covered once, in pieces of at most ``piece_words`` words, positions counted from the range's
    start, the tail bytes on its last row, one empty row for an empty range."""
    from torchferry._core._schedules.hash_rows import row_table

    g = torch.Generator().manual_seed(0)
    nbytes = [0, 3, 8, 16, 5 * 64, 5 * 64 + 7, 1000] + [int(x) for x in torch.randint(0, 4000, (40,), generator=g)]
    ptrs = [(i + 1) << 20 for i in range(len(nbytes))]
    piece = 8  # words
    both, rows = row_table(ptrs, nbytes, piece, torch.device("cpu"))
    table, seg = both[:rows * 4].view(rows, 4).tolist(), both[rows * 4:].tolist()
    assert len(seg) == rows
    for r, n in enumerate(nbytes):
        mine = [row for row, s in zip(table, seg) if s == r]
        words = n // 8
        want_rows = max(1, -(-words // piece))
        assert len(mine) == want_rows
        covered = 0
        for k, (addr, nw, first, tail) in enumerate(mine):
            assert first == covered and addr == ptrs[r] + 8 * first and 0 <= nw <= piece
            assert tail == (n % 8 if k == want_rows - 1 else 0)
            covered += nw
        assert covered == words
