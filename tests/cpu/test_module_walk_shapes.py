"""The module walk (``_core/_state/tree.py``) over the shapes users build: a module under two names, ``None``
children, ``ModuleDict`` / ``ModuleList``, shared submodules: every parameter counted once and offloaded, every module
holding state guarded, layer-wise reloads exact."""

import pytest
import torch
from torch import nn

import torchferry


def test_shared_and_twice_registered_and_none_children(own_ledger):
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    m = nn.Module()
    m.a = shared
    m.b = shared
    m.d = nn.ModuleDict({"x": shared, "y": nn.Linear(4, 4)})
    m.l = nn.ModuleList([shared, nn.Linear(4, 4)])
    m.register_module("none", None)
    ref = [p.detach().clone() for p in m.parameters()]
    want = sum(p.numel() * p.element_size() for p in m.parameters())
    x = torch.randn(2, 4)
    ferry = torchferry.Ferry(m, skip_unchanged=True)
    ferry.offload()
    assert f"state_bytes={want}," in repr(ferry), repr(ferry)
    for sub in (m.a, m.b, m.d["x"], m.d["y"], m.l[0], m.l[1]):
        with pytest.raises(RuntimeError, match="while its state is offloaded"):
            sub(x)
    ferry.reload(prefetch=True)
    m.l[1](x)
    m.d["y"](x)
    m.a(x)
    ferry.offload()
    ferry.reload()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref, strict=True))
