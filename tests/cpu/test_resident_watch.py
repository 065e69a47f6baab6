"""What the caller drops while the state is resident is freed then, not at the next offload
([Note: state dropped while resident] in ``_core/_ferry/watch.py``)."""

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

from torchferry import Ferry


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def test_gradients_set_to_none_after_a_reload_are_freed_before_the_next_forward():
    model, opt = _trained()
    ferry = Ferry(model)
    ferry.offload()
    ferry.reload()
    old = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is not None for r in old)  # held by the ferry's plan until the caller's code reads the model
    model(torch.randn(4, 32)).sum().backward()
    gc.collect()
    assert all(r() is None for r in old)  # the forward's check let them go, before backward made new ones
    want = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    ferry.offload()
    ferry.reload()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=0, rtol=0)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=0, rtol=0)
    ferry.close()


def test_a_forward_only_phase_keeps_the_plan_and_the_skip_of_unchanged_storages():
    model, _ = _trained()
    ferry = Ferry(model, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    plan = ferry._set.cache.plan
    with torch.no_grad():
        model(torch.randn(4, 32))
    assert ferry._set.cache.plan is plan  # nothing dropped: the plan stays for the next offload
    ferry.offload()
    assert ferry.stats.offload_bytes_copied < ferry.state_bytes  # the unchanged storages skipped
    ferry.reload()
    ferry.close()


def test_the_watch_never_breaks_the_callers_step_hooks_sparse_grads_or_a_collected_target():
    """No hook on the optimizer: a user's step hook registered after the reload, sparse gradients and
    an optimizer target collected while resident leave ``step()`` and the forward working."""
    model, opt = _trained()
    ferry = Ferry(model, opt)
    ferry.offload()
    ferry.reload()
    opt.register_step_pre_hook(lambda o, a, k: None)
    for p in model.parameters():
        p.grad = p.grad.clone()
    opt.step()
    del opt
    gc.collect()
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 32))
    emb = nn.Embedding(100, 8, sparse=True)
    sgd = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    sgd.step()
    sgd.zero_grad()
    f = Ferry(emb, sgd)
    f.offload()
    f.reload()
    emb(torch.tensor([3, 4])).sum().backward()
    sgd.step()
    f.close()


def test_the_check_at_a_forward_is_per_module_target():
    """One hook per module target, each checking its own parameters' gradients."""
    layers = [nn.Linear(4, 4) for _ in range(50)]
    for m in layers:
        m(torch.randn(2, 4)).sum().backward()
    ferry = Ferry(*layers)
    ferry.offload()
    ferry.reload()
    assert all(len(m._forward_pre_hooks) == 1 for m in layers)
    old = weakref.ref(layers[7].weight.grad)
    layers[7].zero_grad(set_to_none=True)
    layers[3](torch.randn(2, 4))  # another target's hook: its own gradients are all there
    gc.collect()
    assert old() is not None
    layers[7](torch.randn(2, 4))
    gc.collect()
    assert old() is None and not any(m._forward_pre_hooks for m in layers)
    ferry.offload()
    ferry.reload()
    ferry.close()


def test_a_resident_model_copies_and_saves_whole_and_its_copy_runs():
    model, _ = _trained()
    ferry = Ferry(model)
    ferry.offload()
    ferry.reload()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 32)
    torch.testing.assert_close(twin(x), model(x), atol=0, rtol=0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
    ferry.close()


def test_the_watch_keeps_neither_the_ferry_nor_its_hooks_alive():
    model, opt = _trained()
    ferry = Ferry(model, opt)
    ferry.offload()
    ferry.reload()
    assert model._forward_pre_hooks  # the plan holds gradients: watched
    r = weakref.ref(ferry)
    del ferry
    gc.collect()
    assert r() is None
    model(torch.randn(4, 32))  # a hook of a collected ferry does nothing
    ferry = Ferry(model, opt)
    ferry.offload()
    ferry.reload()
    ferry.offload()
    assert not any("ResidentWatch" in repr(h) for h in model._forward_pre_hooks.values())
    ferry.reload()
    ferry.close()
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks


def _zero_grad_first(seed=0):
    """A frozen base and a trained head, their optimizer, one ferry skipping unchanged storages."""
    torch.manual_seed(seed)
    base, head = nn.Linear(16, 16).requires_grad_(False), nn.Linear(16, 4)
    opt = torch.optim.AdamW(head.parameters())
    return base, head, opt, Ferry(base, head, opt, skip_unchanged=True)


def _step(base, head, opt):
    """The loop order that drops the last step's gradients while resident: zero_grad first."""
    opt.zero_grad(set_to_none=True)
    head(base(torch.randn(4, 16))).sum().backward()
    opt.step()


def test_zero_grad_before_backward_keeps_the_skip_of_the_frozen_base(caplog, monkeypatch):
    """[Note: a baseline carried across a re-plan]: with zero_grad(set_to_none=True) before the backward the
    watch forgets the plan at each forward, and the baseline goes with the slots to the next plan: from the
    second offload on the frozen base is not copied, every skip checked against its slot
    (TORCHFERRY_VERIFY_SKIPS), and a DEBUG line says what happened."""
    import logging

    monkeypatch.setenv("TORCHFERRY_VERIFY_SKIPS", "1")
    base, head, opt, ferry = _zero_grad_first()
    frozen = base.weight.nbytes + base.bias.nbytes
    skipped = []
    with caplog.at_level(logging.DEBUG, logger="torchferry"):
        for _ in range(4):
            _step(base, head, opt)
            want = [t.detach().clone() for t in (base.weight, base.bias, head.weight, head.bias)]
            ferry.offload().wait()
            skipped.append(ferry.stats.last_offload_bytes - ferry.stats.offload_bytes_copied)
            ferry.reload()
            got = [base.weight, base.bias, head.weight, head.bias]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert skipped == [0, frozen, frozen, frozen]
    assert sum("a .grad of its plan was dropped while resident" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("write", ["data", "kept_host_view", "release_host", "pool_grows"])
def test_a_carried_baseline_never_skips_bytes_that_changed(write, monkeypatch):
    """What a carried baseline must still see: a write to the frozen base that bumps no version counter
    (through .data), a write to the pool through a host tensor kept from an earlier offload, and a pool
    given back (release_host) in between: each copies what changed, and the round trip is exact."""
    monkeypatch.setenv("TORCHFERRY_VERIFY_SKIPS", "1")
    base, head, opt, ferry = _zero_grad_first(1)
    _step(base, head, opt)
    ferry.offload().wait()
    kept = base.state_dict()["weight"]  # a host view of the pool, kept past the reload
    ferry.reload()
    _step(base, head, opt)  # the watch forgets the plan here: the baseline is carried
    if write == "data":
        base.weight.data.add_(1.0)  # no version counter moves
    elif write == "kept_host_view":
        kept.add_(1.0)  # writes the slot of the base's weight in the pool
    elif write == "release_host":
        ferry.release_host()  # resident: the pool goes back to the OS, the next offload makes a new one
    else:  # a new parameter: the next plan needs a larger pool, a new block, and the carry is dropped
        head.register_parameter("extra", nn.Parameter(torch.randn(4096)))
        base.weight.data.add_(1.0)
    want = base.weight.detach().clone()
    ferry.offload().wait()
    skipped = ferry.stats.last_offload_bytes - ferry.stats.offload_bytes_copied
    # The weight is copied; the bias, unchanged, is skipped through the carried baseline (not with a new pool)
    assert skipped == (base.bias.nbytes if write in ("data", "kept_host_view") else 0)
    ferry.reload()
    assert torch.equal(base.weight, want)


def test_a_tensor_kept_under_an_older_plan_never_lets_a_skip_keep_its_write(monkeypatch):
    """[Note: host tensors of earlier plans]: a host tensor kept from an offload two plans back (the zero_grad-first
    loop makes a plan per step) and written after the reload writes the weight's slot; the next offload copies
    the weight, and the round trip gives the device's bytes back."""
    base, head, opt, ferry = _zero_grad_first(2)
    _step(base, head, opt)
    ferry.offload().wait()
    kept = base.state_dict()["weight"]  # a host view of the pool under this plan
    ferry.reload()
    _step(base, head, opt)
    ferry.offload().wait()  # a new plan (the grads were dropped and made again)
    ferry.reload()
    _step(base, head, opt)  # and another: the baseline is carried
    kept.add_(1.0)
    want = base.weight.detach().clone()
    ferry.offload().wait()
    assert ferry.stats.last_offload_bytes - ferry.stats.offload_bytes_copied == base.bias.nbytes  # the bias only
    ferry.reload()
    assert torch.equal(base.weight, want)
    del kept  # nothing views the old twin now: it is let go at the next offload
    _step(base, head, opt)
    ferry.offload().wait()
    assert ferry._set.unchanged._retired == []  # the watch list does not grow with the plans
    ferry.reload()


def _early_after_zero_grad_body(rank, world):
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import cpu_mesh

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(64, 128), requires_grad=False)
            self.w2 = nn.Parameter(torch.randn(64, 128), requires_grad=False)

        def forward(self, x):
            return x @ self.w1.t() + x @ self.w2.t()

    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    head, base = nn.Linear(128, 64, bias=False), Frozen()
    model = nn.Sequential(base, nn.Linear(64, 128, bias=False), head)
    model[1].requires_grad_(False)
    for m in (base, model[1], head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    ferry = Ferry(head, base, model[1], opt, skip_unchanged=True)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    ferry.offload().wait()
    ferry.reload()  # a baseline, with head's grad in the plan
    opt.zero_grad(set_to_none=True)
    ferry.offload_during_forward()  # a plan without the grad: its early copies write other slots
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    tensors = [base.w1, base.w2, model[1].weight, head.weight]
    want = [t.detach().clone() for t in tensors]
    ferry.offload().wait()
    ferry.reload()
    assert all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True))


def test_an_offload_during_forward_after_a_re_plan_drops_the_carried_baseline():
    """Early copies land in the slots of the plan they were armed on; a baseline carried from an older plan would
    trust those slots, so arming them drops it: every tensor comes back as it was."""
    from tests.spawn import run_spawned

    run_spawned(_early_after_zero_grad_body, world=1)
