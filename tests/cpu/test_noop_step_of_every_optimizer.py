"""[Note: a step that changes nothing] (``_core/_ferry/guards.py``) across optimizers: a step at ``lr`` 0 with zero
gradients while offloaded (SGD, momentum, Adam with weight decay, fused AdamW, a tensor ``lr``, RMSprop, NAdam, Rprop,
ASGD; Adagrad, whose state exists at construction, is refused as any step), then training with cycles, exactly as
the run without torchferry, ``skip_unchanged`` on and off."""

import copy

import pytest
import torch
from torch import nn

import torchferry


def _pair(make_opt, seed=0):
    torch.manual_seed(seed)
    m = nn.Linear(4, 3)
    ref = copy.deepcopy(m)
    return m, make_opt(m.parameters()), ref, make_opt(ref.parameters())


def _train(ferry, runs, x, cycles=2, lr=1e-2):
    for _ in range(cycles):
        for mm, oo in runs:
            for g in oo.param_groups:
                if "lr" in g:
                    g["lr"] = torch.tensor(lr) if isinstance(g["lr"], torch.Tensor) else lr
            mm(x).square().mean().backward()
            oo.step()
            oo.zero_grad()
        if ferry is not None:
            ferry.offload()
            ferry.reload()


OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.0),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.0, weight_decay=0.1),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.0, fused=True),
    "adam_tensor_lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.0), foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.0),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.0, momentum=0.5),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.0),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.0),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.0),
}


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", list(OPTS))
def test_user_lr0_zero_grad_step_while_offloaded_then_train_exact(own_ledger, name, skip):
    """A warm-up at lr 0 with zero grads, stepped while offloaded: afterwards training equals the plain run."""
    m, opt, ref, ref_opt = _pair(OPTS[name])
    x = torch.randn(5, 4)
    ferry = torchferry.Ferry(m, opt, skip_unchanged=skip)
    ferry.offload()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        p.grad = torch.zeros_like(p)
        q.grad = torch.zeros_like(q)
    try:
        opt.step()
    except RuntimeError as e:  # refused (e.g. state at construction): must be the guard's message, nothing changed
        assert "while its state is offloaded" in str(e)
        ferry.reload()
        ref_opt.zero_grad()
        opt.zero_grad()
    else:
        ref_opt.step()
        ferry.reload()
    opt.zero_grad()
    ref_opt.zero_grad()
    _train(ferry, [(m, opt)], x)
    _train(None, [(ref, ref_opt)], x)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(v)), k


def test_closure_step_while_offloaded(own_ledger):
    """A closure given to step() runs the forward: refused by the guard's clear message, lr/grads unchanged."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    x = torch.randn(2, 4)

    def closure():
        loss = m(x).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="while its state is offloaded"):
        opt.step(closure)
    ferry.reload()
