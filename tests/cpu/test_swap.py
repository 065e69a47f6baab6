"""torchferry.swap: one state set out, another in, both bit-exact; bad arguments are refused."""

import pytest
import torch
from torch import nn

import torchferry
from torchferry import Ferry, Residency


def _pair():
    torch.manual_seed(0)
    actor, critic = nn.Linear(64, 64), nn.Linear(64, 1)
    return actor, critic, Ferry(actor), Ferry(critic)


def test_swap_moves_both_bit_exact():
    actor, critic, fa, fc = _pair()
    want_a, want_c = actor.weight.detach().clone(), critic.weight.detach().clone()
    fc.offload()
    h_out, h_in = torchferry.swap(fa, fc)
    h_out.wait()
    h_in.wait()
    assert fa.residency is Residency.HOST and fc.residency is Residency.DEVICE
    assert torch.equal(actor.weight, want_a) and torch.equal(critic.weight, want_c)
    torchferry.swap(fc, fa, gpu_budget_bytes=1 << 30)  # and back
    assert fa.residency is Residency.DEVICE and fc.residency is Residency.HOST
    assert torch.equal(actor.weight, want_a) and torch.equal(critic.weight, want_c)


def test_swap_refuses_bad_arguments():
    actor, critic, fa, fc = _pair()
    with pytest.raises(ValueError, match="same ferry"):
        torchferry.swap(fa, fa)
    assert fa.residency is Residency.DEVICE
