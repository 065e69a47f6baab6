"""Layer-wise reload with prefetch (``_schedules/prefetch.py``, [Note: prefetch reload]): ordering,
look-ahead, step guard, writes made right after reload(prefetch=True) kept, bit-identical
training, on FSDP2 over gloo (2 CPU processes). A test whose docstring says "failed before
its fix" is a regression test.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from tests.helpers import cpu_mesh, differs, three_units
from tests.spawn import run_spawned
from torchferry import Ferry, Prefetch, Residency

needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


def _in_pool(t: torch.Tensor) -> bool:
    from torchferry._core._state.host_blocks import in_host_pool

    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() > 0 and in_host_pool(local.untyped_storage().data_ptr())


def test_prefetch_policy_validation():
    with pytest.raises(ValueError, match="lookahead_bytes must be an int >= 0"):
        Prefetch(lookahead_bytes=-1)


def test_reload_prefetch_takes_only_bool_or_policy():
    m = nn.Linear(3, 3)
    ferry = Ferry(m)
    ferry.offload()
    with pytest.raises(TypeError, match="takes True, False or a Prefetch"):
        ferry.reload(prefetch="yes")
    assert ferry.residency is Residency.HOST  # nothing moved
    ferry.reload(prefetch=True)  # no FSDP units, no optimizer: a plain reload
    assert ferry.residency is Residency.DEVICE


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

    from tests.helpers import assert_same, build_uneven, snapshot
    from tests.helpers import train_step as _train

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

    from tests.helpers import build_uneven
    from tests.helpers import train_step as _train
    from torchferry._core._state.fsdp import forward_prefetch_units

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


def _zero_grad_first_body(rank, world):
    mesh = cpu_mesh(world)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = three_units(mesh)
    m, opt = three_units(mesh)

    def step(model, o):  # the canonical loop order: zero_grad first
        o.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        o.step()

    step(ref, ref_opt)
    step(m, opt)
    ferry = Ferry(m, opt)
    for _ in range(3):
        ferry.offload()
        ferry.reload(prefetch=True)  # README: "loss = model(batch).loss" right after
        step(ref, ref_opt)
        step(m, opt)
    ferry.offload()
    ferry.reload()
    bad = differs(ref, ref_opt, m, opt)
    assert not bad, f"rank {rank}: training with reload(prefetch=True) diverged: {bad}"


@needs_dist
def test_zero_grad_right_after_a_prefetching_reload_is_kept():
    """A regression test (failed before its fix):
    zero_grad(set_to_none=False) after reload(prefetch=True) zeroes the pool views; the unit's
    pre-hook then re-points the grads at device copies made from the pool at reload() time, so
    the old grads come back and backward accumulates onto them. Same loop with reload(): exact."""
    run_spawned(_zero_grad_first_body, world=2)


def _inplace_write_body(rank, world):
    mesh = cpu_mesh(world)
    x = torch.randn(4, 16)
    out = {}
    for prefetch in (False, True):
        m, _ = three_units(mesh)
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)
        ferry = Ferry(m)
        ferry.offload()
        ferry.reload(prefetch=prefetch)
        with torch.no_grad():  # weight sync / EMA / load_state_dict right after the reload
            for p in m.parameters():
                p.mul_(2.0)
        out[prefetch] = m(x).detach()
    assert torch.equal(out[False], out[True]), f"rank {rank}: in-place write after reload(prefetch=True) was lost"


@needs_dist
def test_inplace_write_right_after_a_prefetching_reload_is_kept():
    """A regression test (failed before its fix):
    an in-place write to the parameters (weight sync, EMA,
    load_state_dict) right after reload(prefetch=True) was lost."""
    run_spawned(_inplace_write_body, world=2)


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.use_b = True

    def forward(self, x):
        h = self.a(x)
        if self.use_b:
            h = self.b(h)
        return self.c(h)


def _skipped_unit_body(rank, world):
    from torch.distributed.fsdp import fully_shard

    mesh = cpu_mesh(world)

    def build():
        torch.manual_seed(0)
        m = _Skip()
        for u in (m.a, m.b, m.c):
            fully_shard(u, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    def step(m, opt):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = build()
    m, opt = build()
    step(ref, ref_opt)
    step(m, opt)
    fm, fo = Ferry(m), Ferry(opt)  # one ferry per model and per optimizer, as the bench / verl compat do
    for it in range(3):
        ref.use_b = m.use_b = it != 1  # unit b does not run in step 1 (a conditional branch / MoE expert)
        fm.offload()
        fo.offload()
        fm.reload(prefetch=True)
        fo.reload(prefetch=True)
        step(ref, ref_opt)
        step(m, opt)
    fm.offload(), fm.reload(), fo.offload(), fo.reload()
    bad = differs(ref, ref_opt, m, opt)
    assert not bad, f"rank {rank}: optimizer update of a unit not run in forward was lost: {bad}"


@needs_dist
def test_optimizer_update_of_a_unit_not_run_in_forward_is_kept():
    """A regression test (failed before its fix):
    Model ferry never finishes (unit b's hook never fires, no optimizer in this ferry); AdamW's
    decay writes b's pool views; the next offload() re-points b at the stale device copy."""
    run_spawned(_skipped_unit_body, world=2)


def _forward_prefetch_units_body(rank, world):
    from torchferry._core._state.fsdp import forward_prefetch_units

    m, _ = three_units(cpu_mesh(world), explicit_prefetch=True)
    got = forward_prefetch_units(m[0])
    # torch 2.13's FSDPParamGroup has `.modules` (a tuple), not `.module`: always [] here.
    assert any(u is m[1] for u in got), f"forward_prefetch_units(m[0]) = {got}, expected [m[1]]"


@needs_dist
def test_forward_prefetch_units_finds_the_explicit_prefetch_targets():
    """A regression test (failed before its fix):
    forward_prefetch_units() was always empty on torch 2.13
    (FSDPParamGroup has `.modules`, not `.module`), so FSDP2 all-gathered a unit before its hook ran."""
    run_spawned(_forward_prefetch_units_body, world=2)


def _lookahead_body(mode):
    def body(rank, world):
        m, _ = three_units(cpu_mesh(world), grouped=mode == "grouped", explicit_prefetch=mode == "explicit")
        x = torch.randn(4, 16)
        want = m(x).detach()
        ferry = Ferry(m)
        ferry.offload()
        ferry.reload(prefetch=Prefetch(lookahead_bytes=0))
        if mode == "unshard":
            m[2].unshard()  # FSDPModule API: all-gather ahead of the forward
        assert torch.equal(m(x), want)

    return body


def _lookahead_case(rank, world, mode):
    _lookahead_body(mode)(rank, world)


@needs_dist
def test_lookahead_zero_with_set_modules_to_forward_prefetch_is_exact():
    """A regression test (failed before its fix):
    with lookahead_bytes=0, FSDP2's explicit forward prefetch
    all-gathered a unit before its hook made it resident."""
    run_spawned(functools.partial(_lookahead_case, mode="explicit"), world=2)


@needs_dist
def test_lookahead_zero_with_grouped_fully_shard_is_exact():
    """A regression test (failed before its fix):
    with lookahead_bytes=0, a unit of two modules grouped by
    one fully_shard call was all-gathered before its hook made it resident."""
    run_spawned(functools.partial(_lookahead_case, mode="grouped"), world=2)


def _grouped_grads_body(rank, world):
    import gc

    m, _ = three_units(cpu_mesh(world), grouped=True)
    x = torch.randn(4, 16)
    want = m(x).detach()
    m(x).sum().backward()  # grads kept (FSDP2 stores a group's grads as views of one storage)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload(prefetch=True)
    errors = []
    for what, op in (("forward", lambda: m(x)), ("reload", ferry.reload), ("offload", ferry.offload)):
        try:
            op()
        except RuntimeError as e:
            errors.append(f"{what}: {str(e)[:80]}")
        gc.collect()
    assert not errors, f"rank {rank}: {ferry.residency}; {errors}"
    ferry.reload()
    assert torch.equal(m(x), want)


@needs_dist
def test_grouped_units_with_grads_finish_prefetching():
    """A regression test (failed before its fix):
    m[2]'s grads share one storage with m[1]'s, so group_plan puts them in m[1]'s group while
    the parameters stay in m[2]'s; re-pointing a DTensor grad apart from its parameter is refused
    (use count 2), and every later forward / reload() / offload() / close() raises the same."""
    run_spawned(_grouped_grads_body, world=2)


def _reserve_host_body(rank, world):
    m, _ = three_units(cpu_mesh(world))
    x = torch.randn(4, 16)
    want = m(x).detach()
    m(x).sum().backward()  # FSDP2's lazy init
    m.zero_grad(set_to_none=True)  # state with grads would reload plainly
    ferry = Ferry(m)
    ferry.offload()
    pool_bytes = ferry._pool.nbytes
    ferry.reload(prefetch=True)
    assert ferry.residency is Residency.PREFETCHING
    seconds = ferry.reserve_host()  # completes the prefetch; the pool already fits
    assert seconds == 0.0
    assert ferry.residency is Residency.DEVICE, f"rank {rank}: {ferry.residency}"
    assert ferry._pool.nbytes == pool_bytes
    assert not any(_in_pool(p) for p in m.parameters())
    assert torch.equal(m(x), want)
    ferry.offload()  # the ferry goes on working
    ferry.reload()
    assert torch.equal(m(x), want)


@needs_dist
def test_reserve_host_while_prefetching_completes_the_prefetch():
    """A regression test (failed before its fix):
    reserve_host() during reload(prefetch=True) raised an error blaming "another
    Ferry". It now completes the prefetch first and returns 0.0 (the pool already fits), the
    state resident and the model's output unchanged."""
    run_spawned(_reserve_host_body, world=2)


def _holds_body(mode):
    def body(rank, world):
        from torch.distributed.fsdp import fully_shard

        mesh = cpu_mesh(world)

        def build():
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
            raf = mode != "no_reshard_after_forward"
            for layer in m:
                fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
            fully_shard(m, mesh=mesh, reshard_after_forward=raf)
            return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

        def step(m, opt):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        ref, ref_opt = build()
        m, opt = build()
        step(ref, ref_opt)
        step(m, opt)
        ferries = [Ferry(m), Ferry(opt)] if mode == "two_ferries" else [Ferry(m, opt)]
        policy = Prefetch(lookahead_bytes=0) if mode == "lookahead0" else True
        for it in range(4):
            for f in ferries:
                f.offload()
            for f in ferries:
                f.reload(prefetch=policy)
            if mode == "sub_unit_first" and it == 1:
                with torch.no_grad():
                    m[2](torch.randn(4, 16))
            if mode == "exception_in_forward" and it == 1:
                def boom(mod, args):
                    raise ValueError("boom")
                h = m[1].register_forward_pre_hook(boom)
                with pytest.raises(ValueError):
                    m(x)
                h.remove()
            assert torch.equal(step(ref, ref_opt), step(m, opt))
        for f in ferries:
            f.offload()
            f.reload()
        assert not differs(ref, ref_opt, m, opt)

    return body


def _holds_case(rank, world, mode):
    _holds_body(mode)(rank, world)


@needs_dist
@pytest.mark.parametrize("mode", ["two_ferries", "no_reshard_after_forward", "lookahead0", "sub_unit_first",
                                  "exception_in_forward"])
def test_prefetch_training_is_bit_identical_in_every_mode(mode):
    """Cases tried against prefetch that held: two ferries, no reshard after forward,
    lookahead 0, a sub-unit run first, an exception in forward; training stays bit-identical."""
    body = functools.partial(_holds_case, mode=mode)
    run_spawned(body, world=2)


def test_model_and_optimizer_without_fsdp_units_reload_plainly_with_prefetch():
    """Parameters of a non-FSDP model must be resident for the forward, not only at the step:
    otherwise the backward's grads were dropped and the step silently did nothing."""
    m = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload(prefetch=True)
    before = m.weight.detach().clone()
    m(torch.ones(2, 8)).sum().backward()
    assert m.weight.grad is not None
    opt.step()
    assert not torch.equal(m.weight, before)  # the step updated the parameters


def _kept_groups_body(rank, world):
    import gc
    import weakref

    from torchferry._core._schedules import groups as g

    def content(gs):
        return [(None if x.unit is None else id(x.unit), x.storages, x.tensors, x.nbytes) for x in gs]

    m, _ = three_units(cpu_mesh(world))
    x = torch.randn(4, 16)
    want = m(x).detach()
    ferry = Ferry(m, skip_unchanged=True)
    made = []
    real = g.group_plan
    g.group_plan = lambda plan: made.append(1) or real(plan)
    try:
        for _ in range(3):  # the same trees: the groups are made once and kept with the plan
            ferry.offload()
            ferry.reload(prefetch=True)
            assert torch.equal(m(x), want)
        assert len(made) == 1, made
        # The forward's unit hooks walk no module tree (FSDP2's shard buffers looked up per parameter)
        from torchferry._core._state import tree
        walks, walk = [], tree._walk
        tree._walk = lambda root: walks.append(root) or walk(root)
        try:
            ferry.offload()
            ferry.reload(prefetch=True)
            walks.clear()
            assert torch.equal(m(x), want) and walks == []
        finally:
            tree._walk = walk
        plan = ferry._set.cache.plan
        assert content(g.prefetch_groups(plan)) == content(real(plan))
        assert len(made) == 1
        # A tree changed with the same tensors (m[2]'s bias also registered in m[0]): made again, as group_plan
        m[0].register_parameter("moved", m[2].bias)
        assert content(g.prefetch_groups(plan)) == content(real(plan)) and len(made) == 2
        del m[0].moved
        # The plan keeps no module alive through its kept groups
        alive = weakref.ref(m[1])
        del m, ferry
        gc.collect()
        assert alive() is None
    finally:
        g.group_plan = real


@needs_dist
def test_groups_are_kept_with_the_plan_while_the_trees_stay():
    """[Note: groups kept with the plan]: a layer-wise reload makes its groups once per plan and module trees,
    makes them again (equal to group_plan's) when a tree changes, and holds no module strongly; its forward
    walks no module tree."""
    run_spawned(_kept_groups_body, world=2)
