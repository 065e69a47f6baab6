"""The module walk (``_core/_state/tree.py``) follows ``named_children()``; a class that overrides it (to hide or
rename children) is walked as PyTorch's ``named_modules()`` walks it: every parameter ``named_parameters()`` yields is
offloaded and every module holding state is guarded (before: a hidden child's parameters stayed on the device, its
forward unguarded)."""

import pytest
import torch
from torch import nn

import torchferry


class Hiding(nn.Module):
    """Overrides named_children (e.g. for a custom display); its parameters are still registered."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def named_children(self):
        return iter(())

    def forward(self, x):
        return self.inner(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Hiding())


def test_every_parameter_is_offloaded_with_named_children_overridden(own_ledger):
    m = _model()
    want = sum(p.numel() * p.element_size() for p in m.parameters())
    ferry = torchferry.Ferry(m)
    ferry.offload()
    try:
        assert f"state_bytes={want}," in repr(ferry), repr(ferry)
    finally:
        ferry.reload()


def test_forward_of_a_hidden_child_is_guarded_while_offloaded(own_ledger):
    m = _model()
    ferry = torchferry.Ferry(m)
    ferry.offload()
    try:
        with pytest.raises(RuntimeError, match="while its state is offloaded"):
            m[1].inner(torch.randn(2, 4))
    finally:
        ferry.reload()
