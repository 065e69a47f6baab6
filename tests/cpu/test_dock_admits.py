"""``Dock.add`` refuses a set that shares a tensor with a set already added (a ferry over a module and another over its
submodule): each would move that tensor behind the other's back (before: after the whole model's set was evicted,
``use("head")`` reported the head resident while its weights were in the other set's host pool, and a forward failed
with the forward guard's error). ``Dock.reserve`` that cannot make room leaves the reservation as it was (before: a
failed reserve stayed registered)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchferry
from torchferry import Dock, Ferry

pytestmark = pytest.mark.usefixtures("own_ledger")  # each test its own node ledger (tests/conftest.py)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


@pytest.mark.parametrize("evicted", [False, True], ids=["resident", "evicted"])
def test_a_set_sharing_tensors_with_another_set_is_refused_and_nothing_changes(evicted):
    m = _model()
    dock = Dock(1 << 20, device="cpu")
    whole, head = Ferry(m, device="cpu"), Ferry(m[1], device="cpu")  # Ferry() alone cannot tell (both resident)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    dock.add("model", whole)
    if evicted:
        dock.evict("model")
    with pytest.raises(ValueError, match=r"^torchferry: Dock.add: 'head' shares tensors with the set 'model'"):
        dock.add("head", head)
    assert not dock.has("head") and dock.has("model")
    assert whole.residency is (torchferry.Residency.HOST if evicted else torchferry.Residency.DEVICE)
    with dock.use("model"):
        out = m(torch.ones(2, 16))
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, want[k], atol=0, rtol=0)
    assert out.shape == (2, 4)
    m2 = _model()
    dock.add("other", Ferry(m2, device="cpu"))  # a set over other tensors joins
    assert dock.has("other")


def test_a_second_ferry_over_the_same_optimizer_state_is_refused():
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 16)).sum().backward()
    opt.step()
    dock = Dock(1 << 20, device="cpu")
    dock.add("opt", Ferry(opt, device="cpu"))
    dock.add("params", Ferry(m, device="cpu"))  # parameters and grads: none of the optimizer's state
    with pytest.raises(ValueError, match=r"'opt2' shares tensors with the set 'opt'"):
        dock.add("opt2", Ferry(opt, device="cpu"))


def test_a_reserve_that_cannot_make_room_leaves_the_reservation_as_it_was(monkeypatch):
    m = _model()
    dock = Dock(1 << 20, device="cpu")
    ferry = Ferry(m, device="cpu")
    dock.add("model", ferry)
    dock.reserve("kept", 1000)

    def refused(*args, **kwargs):
        raise RuntimeError("injected: the eviction failed")

    monkeypatch.setattr(ferry, "offload", refused)
    for name, size in (("new", (1 << 20) - 100), ("kept", (1 << 20) - 100)):
        with pytest.raises(RuntimeError, match="injected"):
            dock.reserve(name, size)  # the room needs the model out: its eviction fails
    assert not dock.has("new") and dock.nbytes("kept") == 1000
    assert ferry.residency is torchferry.Residency.DEVICE and dock.resident_bytes <= (1 << 20)


def test_a_second_ferry_over_an_optimizer_without_state_is_refused():
    """An optimizer before its first step holds no tensor: the target itself is compared (before: the second ferry
    joined, and after the first step a use() of it reported resident state that lay in the other set's pool)."""
    torch.manual_seed(0)
    m = nn.Linear(16, 16)
    opt = torch.optim.AdamW(m.parameters())
    dock = Dock(1 << 20, device="cpu")
    dock.add("params", Ferry(m, device="cpu"))
    dock.add("opt", Ferry(opt, device="cpu"))
    with pytest.raises(ValueError, match=r"'opt2' shares tensors with the set 'opt'"):  # before: it joined
        dock.add("opt2", Ferry(opt, device="cpu"))
