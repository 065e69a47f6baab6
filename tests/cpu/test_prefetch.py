"""Layer-wise reload with prefetch ([Note: prefetch reload]): ordering, look-ahead, step guard,
bit-identical training, on FSDP2 over gloo (2 CPU processes)."""

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned
from torchferry import Ferry, Prefetch, Residency


def _in_pool(t: torch.Tensor) -> bool:
    from torchferry._host_memory import in_host_pool

    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() > 0 and in_host_pool(local.untyped_storage().data_ptr())


def test_prefetch_policy_validation():
    with pytest.raises(ValueError, match="lookahead_bytes must be an int >= 0"):
        Prefetch(lookahead_bytes=-1)


def test_without_fsdp_units_prefetch_is_a_plain_reload():
    m = nn.Linear(4, 4)
    want = m.weight.detach().clone()
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload(prefetch=True)
    assert ferry.residency is Residency.DEVICE and not _in_pool(m.weight)
    assert torch.equal(m.weight, want)


def _prefetch_checks(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.cpu.test_fsdp2_gloo import build_uneven
    from tests.cpu.test_fsdp2_gloo import train_step as _train
    from tests.helpers import assert_same, snapshot

    def train_step(model, o, x):  # grads dropped after the step, as verl does
        return _train(model, o, x, set_to_none=True)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref_m, ref_opt = build_uneven(mesh)
    m, opt = build_uneven(mesh)
    layers = [m[0], m[2], m[3]]

    # 1. Ordering: each unit's parameters come back when its forward starts, not before.
    seen = []

    def probe(i):
        def hook(mod, args):
            seen.append((i, [_in_pool(p) for p in mod.parameters()], [_in_pool(p) for p in layers[-1].parameters()]))
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(probe(i))  # appended: runs after torchferry's
    ferry = Ferry(m, opt)
    for step in range(3):
        ref_loss = train_step(ref_m, ref_opt, x)
        if step == 0:
            loss = train_step(m, opt, x)  # FSDP2 lazy init happens in the first forward
        else:
            ferry.offload().wait()
            seen.clear()
            ferry.reload(prefetch=True)
            assert ferry.residency is Residency.PREFETCHING
            assert any(_in_pool(p) for p in layers[-1].parameters() if p._local_tensor.numel())
            loss = train_step(m, opt, x)
            assert ferry.residency is Residency.DEVICE
            assert [s[0] for s in seen] == [0, 1, 2]
            assert all(not any(own) for _, own, _ in seen)  # own unit resident at its forward
            assert any(seen[0][2])  # the last unit still on the host during the first one
        assert torch.equal(ref_loss, loss), (step, ref_loss, loss)
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))

    # 2. The optimizer step completes the reload by itself (no forward in between).
    ferry.offload()
    before = snapshot(m, opt)
    ferry.reload(prefetch=True)
    opt.step()  # grads were zeroed: AdamW still decays, on device state
    ref_opt.step()
    assert ferry.residency is Residency.DEVICE
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))

    # 3. Look-ahead: with a tiny budget, later units are allocated only when reached.
    storages = {i: [p._local_tensor.untyped_storage() for p in layer.parameters()] for i, layer in enumerate(layers)}
    ferry.offload()
    ferry.reload(prefetch=Prefetch(lookahead_bytes=1))
    assert all(s.nbytes() == 0 for s in storages[2])  # not allocated yet
    assert any(s.nbytes() > 0 for s in storages[0])
    loss = train_step(m, opt, x)
    assert torch.equal(loss, train_step(ref_m, ref_opt, x))
    assert ferry.residency is Residency.DEVICE

    # 4. State holding grads is reloaded plainly (see [Note: prefetch reload]).
    m(x).sum().backward()
    ref_m(x).sum().backward()
    ferry.offload()
    ferry.reload(prefetch=True)
    assert ferry.residency is Residency.DEVICE
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)

    # 5. reload() while prefetching completes at once; offload while prefetching is fine too.
    ferry.offload()
    ferry.reload(prefetch=True)
    ferry.reload()
    assert ferry.residency is Residency.DEVICE and not any(_in_pool(p) for p in m.parameters())
    ferry.offload()
    ferry.reload(prefetch=True)
    ferry.offload()
    ferry.reload()
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))
    del before


def test_prefetch_fsdp2_two_ranks_gloo():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(_prefetch_checks, world=2, backend="gloo")


def _explicit_prefetch_checks(rank: int, world: int) -> None:
    """FSDP2's explicit forward prefetch all-gathers the next unit from this unit's pre-forward:
    that unit must be made resident too, before FSDP2 reads it."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.cpu.test_fsdp2_gloo import build_uneven
    from tests.cpu.test_fsdp2_gloo import train_step as _train
    from torchferry._fsdp import forward_prefetch_units

    def train_step(model, o, x):
        return _train(model, o, x, set_to_none=True)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref_m, ref_opt = build_uneven(mesh)
    m, opt = build_uneven(mesh)
    m[0].set_modules_to_forward_prefetch([m[2]])
    assert any(u is m[2] for u in forward_prefetch_units(m[0]))
    ferry = Ferry(m, opt)
    train_step(ref_m, ref_opt, x)
    train_step(m, opt, x)
    for _ in range(2):
        ferry.offload()
        ferry.reload(prefetch=Prefetch(lookahead_bytes=1))
        seen = []
        m[0].register_forward_pre_hook(lambda mod, args: seen.append(not any(_in_pool(p) for p in m[2].parameters())))
        assert torch.equal(train_step(ref_m, ref_opt, x), train_step(m, opt, x))
        assert seen and seen[0]  # m[2] resident already at m[0]'s forward


def test_explicit_forward_prefetch_units_are_made_resident_early():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(_explicit_prefetch_checks, world=2, backend="gloo")


def _offload_during_forward_checks(rank: int, world: int) -> None:
    """Offload in pieces: each unit's D2H is issued once its forward is done; offload() copies
    only the rest, and recopies what was written since (in-place writes, an optimizer step)."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchferry._early as early_mod
    from torch.distributed.fsdp import fully_shard

    from tests.cpu.test_fsdp2_gloo import train_step as _train
    from tests.helpers import assert_same, snapshot

    def train_step(model, o, x):
        return _train(model, o, x, set_to_none=True)

    def build(mesh):  # two units with shards over 1 MiB (moved one by one), one packed
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 601), nn.ReLU(), nn.Linear(601, 1024), nn.Linear(1024, 3))
        for layer in (model[0], model[2], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    ref_m, ref_opt = build(mesh)
    m, opt = build(mesh)
    layers = [m[0], m[2], m[3]]
    ferry = Ferry(m)  # the model alone, as in a log-prob phase
    train_step(ref_m, ref_opt, x)
    train_step(m, opt, x)

    copies = []  # storage indices copied by offload() itself
    from torchferry._early import EarlyOffload

    real_take = EarlyOffload.take

    def spy(self, plan, views):
        early = real_take(self, plan, views)
        copies.append({si for si, n in enumerate(plan.nbytes) if n} - early)
        return early

    EarlyOffload.take = spy
    try:
        # 1. Forward-only phase after a prefetch reload: every unit copied during the forward.
        ferry.offload()
        ferry.reload(prefetch=True)
        ferry.offload_during_forward()
        assert ferry._early is not None and len(ferry._early.groups) == 3  # the 3 layers (the root holds none)
        with torch.no_grad():
            want = ref_m(x)
            got = m(x)
        assert torch.equal(want, got)
        assert set(ferry._early._versions) == {0, 1, 2}  # every unit's copy issued in its forward
        before = snapshot(m, None)
        ferry.offload()
        packed = ferry._set.host.cached.packed
        large = {si for si, n in enumerate(ferry._set.cache.plan.nbytes) if n and si not in packed}
        assert len(large) >= 2 and not copies[-1] & large  # the large shards were all copied early
        assert copies[-1] <= packed
        ferry.reload()
        assert_same(before, snapshot(m, None))
        assert ferry._early is None and not len(early_mod._ARMED)

        # 2. A unit written after its copy is copied again; an optimizer step invalidates all.
        ferry.offload_during_forward()
        with torch.no_grad():
            m(x)
            layers[1].weight.mul_(2)  # an in-place write after m[2]'s forward
        ferry.offload()
        w_idx = {ferry._set.cache.plan.tensors[i].storage_index for i, r in enumerate(ferry._set.cache.plan.tensors)
                 if r.tensor is layers[1].weight}
        assert w_idx <= copies[-1]
        ferry.reload()
        with torch.no_grad():
            layers[1].weight.div_(2)
        ferry.offload_during_forward()
        with torch.no_grad():
            m(x)
        train_step(m, opt, x)
        train_step(ref_m, ref_opt, x)  # the step updated every unit after its early copy
        ferry.offload()
        assert copies[-1] == {si for si, n in enumerate(ferry._set.cache.plan.nbytes) if n}
        ferry.reload()
        assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))

        # 3. Armed, then no forward: offload() copies everything; close() disarms.
        ferry.offload_during_forward()
        ferry.offload()
        ferry.reload()
        ferry.offload_during_forward()
        ferry.close()
        assert not len(early_mod._ARMED) and early_mod._ARMED._handle is None
    finally:
        EarlyOffload.take = real_take


def test_offload_during_forward_fsdp2_two_ranks_gloo():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(_offload_during_forward_checks, world=2, backend="gloo")
