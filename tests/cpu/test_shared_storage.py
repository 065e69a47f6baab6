"""An offload refuses, by name and before anything moves, a device storage that a tensor the ferry
does not know still views ([Note: a storage shared with a tensor the ferry does not know] in
``_state/holders.py``); once that tensor is dropped the round trip is bit-exact.

Reproduces the report that such a tensor crashed the interpreter on read: the offload released the
whole storage (``resize_(0)``, on the CPU too) under ``b`` in ``b = torch.randn(100);
Ferry(b[10:20]).offload(); b.sum()``, and under ``v`` in ``v = model.weight[0]``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import IDS, assert_same, identities, snapshot, trained
from torchferry import Ferry, Residency

SHARED = (r"^torchferry: cannot offload {}: its storage is shared with a tensor torchferry does not manage "
          r".*nothing was moved")


def _refused(ferry: Ferry, name: str) -> None:
    with pytest.raises(RuntimeError, match=SHARED.format(name)):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE and ferry.device == torch.device("cpu")


def _round_trip_is_exact(ferry: Ferry, m, opt) -> None:
    before, ids = snapshot(m, opt), identities(m, opt)
    storage = m.proj.weight.untyped_storage()
    ferry.offload().wait()
    assert ferry.residency is Residency.HOST and storage.nbytes() == 0  # the device storage released
    assert_same(before, snapshot(m, opt))
    ferry.reload().wait()
    assert ferry.residency is Residency.DEVICE
    assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids


@pytest.mark.parametrize("alias", ["slice", "detach", "data", "view"])
def test_offload_refuses_a_storage_shared_with_an_unknown_view(alias):
    m, opt = trained()
    w = m.proj.weight
    v = {"slice": lambda: w[1:3], "detach": w.detach, "data": lambda: w.data, "view": lambda: w.view(-1)}[alias]()
    want_v = v.clone()
    before, ids = snapshot(m, opt), identities(m, opt)
    ferry = Ferry(m, opt)
    _refused(ferry, r"targets\[0\]\.proj\.weight")
    assert_same(before, snapshot(m, opt))  # every tensor as it was, on the device
    assert identities(m, opt) == ids
    assert torch.equal(v, want_v)
    assert v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # still its alias, readable
    m(IDS).backward()  # no forward guard left behind
    opt.step()
    del v
    _round_trip_is_exact(ferry, m, opt)


def test_offload_refuses_the_base_a_tensor_target_was_sliced_from():
    """``b = torch.randn(100); Ferry(b[10:20]).offload(); b.sum()`` crashed: ``b`` is refused."""
    b = torch.randn(100)
    want = b.clone()
    target = b[10:20]
    ferry = Ferry(target)
    _refused(ferry, r"tensors\[0\]")
    assert torch.equal(b, want) and torch.equal(target, want[10:20]) and b.sum() == want.sum()
    del b  # only the target's autograd metadata holds the base now: nothing can read it
    storage = target.untyped_storage()
    ferry.offload()
    assert storage.nbytes() == 0 and target.device.type == "cpu" and torch.equal(target, want[10:20])
    ferry.reload()
    assert torch.equal(target, want[10:20]) and torch.equal(target._base, want)


@pytest.mark.parametrize("where", ["optimizer", "grad"])
def test_offload_refuses_an_unknown_view_of_optimizer_state_or_a_grad(where):
    m, opt = trained()
    m(IDS).backward()  # grads present
    p = m.proj.weight
    v = opt.state[p]["exp_avg"][0] if where == "optimizer" else p.grad.view(-1)
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    name = r"optimizer\.state\[\d+\]\['exp_avg'\]" if where == "optimizer" else r"targets\[0\]\.proj\.weight\.grad"
    _refused(ferry, name)
    assert_same(before, snapshot(m, opt))
    del v
    _round_trip_is_exact(ferry, m, opt)


def test_a_view_made_after_a_cycle_is_refused_at_the_next_offload():
    """The cached plan's fast path checks the holders too, before its copies."""
    m, opt = trained()
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload()
    v = m.emb.weight[0]
    want = v.clone()
    before = snapshot(m, opt)
    _refused(ferry, r"targets\[0\]\.emb\.weight")
    assert_same(before, snapshot(m, opt)) and torch.equal(v, want)
    del v
    _round_trip_is_exact(ferry, m, opt)


def test_a_view_passed_to_the_ferry_too_moves_with_its_storage():
    """The refusal's advice: a view the ferry knows is re-pointed with the rest, not refused."""
    m, opt = trained()
    v = m.proj.weight[1:3]
    want = v.clone()
    ferry = Ferry(m, opt, v)
    _round_trip_is_exact(ferry, m, opt)
    ferry.offload()
    assert v.device.type == "cpu" and torch.equal(v, want)
    ferry.reload()
    assert torch.equal(v, want) and v.data_ptr() == m.proj.weight[1:3].data_ptr()


def test_a_storage_object_held_elsewhere_is_not_refused():
    """An ``UntypedStorage`` object is no tensor: its reads are bounds-checked, so it does not stop
    an offload (no false refusal)."""
    m, opt = trained()
    storage = m.proj.weight.untyped_storage()
    ferry = Ferry(m, opt)
    _round_trip_is_exact(ferry, m, opt)
    assert storage.nbytes() == m.proj.weight.numel() * m.proj.weight.element_size()


def test_offload_refuses_while_a_pending_graph_saved_a_view_of_the_state():
    """Backward would read the released memory through the saved ``w.t()``: refused until the graph
    is run (or dropped)."""
    m, opt = trained()
    x = torch.randn(2, 8, requires_grad=True)  # so that w.t() is saved for its grad
    loss = (x @ m.proj.weight.t()).sum()
    ferry = Ferry(m, opt)
    _refused(ferry, r"targets\[0\]\.proj\.weight")
    loss.backward()  # the graph, and its saved view, freed
    opt.step()
    _round_trip_is_exact(ferry, m, opt)
