"""A dtype cast (``module.half()`` / ``.double()`` / ``.float()`` / ``.bfloat16()``) during a layer-wise reload or
while offloaded, then a forward, cycles and training: exactly as the run without torchferry, ``skip_unchanged`` on
and off."""

import copy

import pytest
import torch
from torch import nn

import torchferry


def _pair():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return m, copy.deepcopy(m)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("cast", ["half", "double", "float", "bfloat16"])
@pytest.mark.parametrize("when", ["prefetch", "offloaded"])
def test_cast_then_forward_and_cycles_exact(own_ledger, cast, skip, when):
    m, ref = _pair()
    x = torch.randn(5, 4)
    ferry = torchferry.Ferry(m, skip_unchanged=skip)
    ferry.offload()
    if when == "prefetch":
        ferry.reload(prefetch=True)
        getattr(m, cast)()
    else:
        getattr(m, cast)()
        ferry.reload(prefetch=True)
    getattr(ref, cast)()
    dt = next(ref.parameters()).dtype
    y, want = m(x.to(dt)), ref(x.to(dt))
    assert torch.equal(y, want)
    for _ in range(2):
        ferry.offload()
        ferry.reload(prefetch=True)
        assert torch.equal(m(x.to(dt)), ref(x.to(dt)))
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
