"""What the caller drops while the state is resident is freed then, not at the next offload
([Note: state dropped while resident] in ``_core/_ferry/watch.py``)."""

import copy
import gc
import io
import weakref

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


def test_zero_grad_before_backward_copies_everything_and_says_why(caplog):
    """The loop order zero_grad(set_to_none=True) / backward / step / offload drops the last step's grads while
    resident: the plan is forgotten ([Note: state dropped while resident]) and the next offload copies every
    storage, the frozen base included; a DEBUG line names the cause (docs/ferry.md, "Skipping what did not
    change")."""
    import logging

    torch.manual_seed(0)
    base, head = nn.Linear(16, 16).requires_grad_(False), nn.Linear(16, 4)
    opt = torch.optim.AdamW(head.parameters())
    ferry = Ferry(base, head, opt, skip_unchanged=True)
    total = sum(t.nbytes for t in (base.weight, base.bias))
    copied = []
    with caplog.at_level(logging.DEBUG, logger="torchferry"):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            head(base(torch.randn(4, 16))).sum().backward()
            opt.step()
            ferry.offload().wait()
            copied.append(ferry.stats.offload_bytes_copied == ferry.stats.last_offload_bytes)
            ferry.reload()
    assert copied == [True, True, True]  # nothing skipped, the base included
    assert sum("a .grad of its plan was dropped while resident" in r.getMessage() for r in caplog.records) == 2
    # Grads dropped after the step instead: the base is skipped from the second offload on (the first plans
    # again without the grads)
    skipped = []
    for _ in range(3):
        head(base(torch.randn(4, 16))).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ferry.offload().wait()
        skipped.append(ferry.stats.last_offload_bytes - ferry.stats.offload_bytes_copied)
        ferry.reload()
    assert skipped[0] == 0 and skipped[1] >= total and skipped[2] >= total
