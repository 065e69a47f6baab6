"""[Note: a step that changes nothing] (``_core/_ferry/guards.py``) for optimizers of every kind of ``lr``: one whose
groups have no ``lr`` (DCP zeroes none) gets DCP's state-making step while offloaded as without torchferry (before:
refused, zero ``.grad``s left behind); an ``lr`` of ``None`` (Adafactor's relative step) is no zero step, refused with
the guard's own message (before: a ``TypeError`` from the guard)."""

import pytest
import torch
from torch import nn

import torchferry


class NoLr(torch.optim.Optimizer):
    """An optimizer whose groups carry no 'lr' (a scale-free sign step with step size 'alpha')."""

    def __init__(self, params, alpha=0.01):
        super().__init__(params, dict(alpha=alpha))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st["n"] = st.get("n", 0) + 1
                    p.add_(p.grad.sign(), alpha=-g["alpha"])


class LrNone(torch.optim.SGD):
    """transformers' Adafactor style: 'lr' present but None (a relative step)."""

    def __init__(self, params):
        super().__init__(params, lr=1e-2)
        for g in self.param_groups:
            g["lr"] = None

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-2)


def test_step_with_lr_none_while_offloaded_is_refused_by_the_guard(own_ledger):
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = LrNone(m.parameters())
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"step\(\) while its state is offloaded"):
        opt.step()
    ferry.reload()


def test_dcp_get_optimizer_state_dict_no_lr_optimizer_while_offloaded(own_ledger):
    """DCP's init step of an optimizer without 'lr' cannot move a parameter (zero grads) ... but the guard
    treats a missing lr as nonzero: compare with the plain run (works, grads None afterwards)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    ref_opt = NoLr(ref.parameters())
    get_optimizer_state_dict(ref, ref_opt)
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    opt = NoLr(m.parameters())
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    try:
        get_optimizer_state_dict(m, opt)
    finally:
        grads = [p.grad for p in m.parameters()]
        ferry.reload()
    assert all(g is None for g in grads), "zero grads left behind"
