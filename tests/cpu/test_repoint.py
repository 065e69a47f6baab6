"""Parked TensorImpls (``_state/parking.py``): everything autograd attaches to a parameter survives an
offload/reload cycle, and a failed re-point is rolled back.

Reproduces reports made against commit df8fb81 (2 x H200 and CPU) for
plain parameters; DDP, TP and FSDP2 are in test_integration_ddp_tp.py and
test_integration_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_same, snapshot, trained
from torchferry import Ferry, Residency


def test_plain_parameter_hooks_grad_and_accumulate_grad_node_survive():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    calls = []
    m.weight.register_hook(lambda g: calls.append("tensor"))
    m.weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    node = m.weight.view_as(m.weight).grad_fn.next_functions[0][0]
    node.register_hook(lambda *a: calls.append("node"))
    m.bias.requires_grad_(False)
    m.bias.grad = torch.ones(3)  # a frozen parameter holding a grad
    ferry = Ferry(m)
    for _ in range(3):
        ferry.offload()
        assert m.bias.grad is not None and m.bias.grad.device.type == "cpu"
        ferry.reload()
        m(torch.ones(2, 4)).sum().backward()
    assert calls.count("tensor") == calls.count("post") == calls.count("node") == 3
    assert m.weight.view_as(m.weight).grad_fn.next_functions[0][0] is node
    assert torch.equal(m.bias.grad, torch.ones(3))


def test_live_graph_survives_a_cycle_before_backward():
    """A graph built before offload() runs backward after reload() into the same .grad."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    m = nn.Linear(4, 3)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4)
    ref(x).square().sum().backward()
    loss = m(x).square().sum()
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    loss.backward()
    assert torch.equal(ref.weight.grad, m.weight.grad) and torch.equal(ref.bias.grad, m.bias.grad)


def test_failure_while_repointing_is_rolled_back(monkeypatch):
    m, opt = trained()
    before = snapshot(m, opt)
    storages = [p.untyped_storage() for p in m.parameters()]
    import torchferry._core._state.parking as repoint

    calls = {"n": 0}
    real = repoint._exchange

    def flaky(a, b, dtensor):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(a, b, dtensor)

    monkeypatch.setattr(repoint, "_exchange", flaky)
    ferry = Ferry(m, opt)
    with pytest.raises(KeyboardInterrupt):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE
    assert all(s.nbytes() > 0 for s in storages)
    assert all(p.untyped_storage().data_ptr() == s.data_ptr() for p, s in zip(m.parameters(), storages))
    assert_same(before, snapshot(m, opt))
    monkeypatch.undo()
    ferry.offload()
    ferry.reload()
    assert_same(before, snapshot(m, opt))
