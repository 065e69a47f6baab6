"""An offload keeps a device storage that a tensor the ferry does not know still views: it is copied
to the pool and its known tensors re-pointed as usual, but not released, so that tensor stays
readable; the reload copies the pool's bytes back into it, and the two views share it again
([Note: a storage shared with a tensor the ferry does not know] in ``_state/holders.py``).

Reproduces the report that such a tensor crashed the interpreter on read: the offload released the
whole storage (``resize_(0)``, on the CPU too) under ``b`` in ``b = torch.randn(100);
Ferry(b[10:20]).offload(); b.sum()``, and under ``v`` in ``v = model.weight[0]``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import torchferry
from tests.helpers import IDS, assert_same, identities, snapshot, trained
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool

KEPT = "torchferry: offload keeps {} bytes on cpu: the storage of {}"


def _kept_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "offload keeps" in r.getMessage()]


def _in_pool(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and (not t.numel() or in_host_pool(t.data_ptr()))


def _known(m, opt) -> list[torch.Tensor]:
    return [*m.parameters(), *m.buffers(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]


def _aliases(w: torch.Tensor, m) -> dict[str, torch.Tensor]:
    return {"slice": w[1:3], "detach": w.detach(), "data": w.data, "view": w.view(-1),
            "state_dict": m.state_dict()["proj.weight"]}


@pytest.mark.parametrize("alias", ["slice", "detach", "data", "view", "state_dict"])
def test_an_unknown_alias_keeps_its_storage_and_is_shared_again_after_the_reload(alias, caplog):
    m, opt = trained()
    w = m.proj.weight
    v = _aliases(w, m)[alias]
    want_v = v.clone()
    before, ids = snapshot(m, opt), identities(m, opt)
    storage = w.untyped_storage()
    others = [t.untyped_storage() for t in _known(m, opt) if t.untyped_storage().data_ptr() != storage.data_ptr()]
    ferry = Ferry(m, opt)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        ferry.offload().wait()
    assert ferry.residency is Residency.HOST
    assert torch.equal(v, want_v) and v.untyped_storage().nbytes() == storage.nbytes() > 0  # kept, readable
    assert all(s.nbytes() == 0 for s in others)  # the rest released
    assert all(_in_pool(t) for t in _known(m, opt))  # the known tensors view the pool, w included
    assert_same(before, snapshot(m, opt))
    (message,) = _kept_warnings(caplog)
    assert message.startswith(KEPT.format(storage.nbytes(), "targets[0].proj.weight"))
    ferry.reload().wait()
    assert ferry.residency is Residency.DEVICE
    assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    assert torch.equal(v, want_v) and v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    with torch.no_grad():
        v.view(-1)[0] = 42.0  # a write through the alias is seen by the parameter: one storage again
    assert w.view(-1)[v.storage_offset() - w.storage_offset()].item() == 42.0


def test_the_base_a_tensor_target_was_sliced_from_stays_readable():
    """``b = torch.randn(100); Ferry(b[10:20]).offload(); b.sum()`` crashed: ``b`` keeps the storage."""
    b = torch.randn(100)
    want = b.clone()
    target = b[10:20]
    ferry = Ferry(target)
    ferry.offload()
    assert ferry.residency is Residency.HOST and _in_pool(target) and torch.equal(target, want[10:20])
    assert torch.equal(b, want) and b.sum() == want.sum()
    ferry.reload()
    assert torch.equal(target, want[10:20]) and torch.equal(b, want)
    assert target.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    b[10] = 7.0
    assert target[0].item() == 7.0


def test_a_base_only_its_views_hold_is_released():
    base = torch.randn(100)
    want = base.clone()
    target = base[10:20]
    del base  # only the target's autograd metadata holds it now: nothing can read it
    storage = target.untyped_storage()
    ferry = Ferry(target)
    ferry.offload()
    assert storage.nbytes() == 0 and _in_pool(target) and torch.equal(target, want[10:20])
    ferry.reload()
    assert torch.equal(target, want[10:20]) and torch.equal(target._base, want)


def test_without_an_alias_every_storage_is_released_and_nothing_logged(caplog):
    m, opt = trained()
    before, ids = snapshot(m, opt), identities(m, opt)
    storages = [t.untyped_storage() for t in _known(m, opt)]
    ferry = Ferry(m, opt)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        for _ in range(2):
            ferry.offload().wait()
            assert all(s.nbytes() == 0 for s in storages)
            assert_same(before, snapshot(m, opt))
            ferry.reload().wait()
            assert_same(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    assert not _kept_warnings(caplog)


def test_a_storage_object_held_elsewhere_does_not_keep_it():
    """An ``UntypedStorage`` object is no tensor: its reads are bounds-checked."""
    m, opt = trained()
    storage = m.proj.weight.untyped_storage()
    nbytes = storage.nbytes()
    ferry = Ferry(m, opt)
    ferry.offload()
    assert storage.nbytes() == 0
    ferry.reload()
    assert storage.nbytes() == nbytes


@pytest.mark.parametrize("where", ["optimizer", "grad"])
def test_an_unknown_view_of_optimizer_state_or_a_grad_keeps_its_storage(where, caplog):
    m, opt = trained()
    m(IDS).backward()  # grads present
    p = m.proj.weight
    owner = opt.state[p]["exp_avg"] if where == "optimizer" else p.grad
    v = owner[0] if where == "optimizer" else p.grad.view(-1)
    want = v.clone()
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        ferry.offload()
    name = "optimizer.state[" if where == "optimizer" else "targets[0].proj.weight.grad"
    (message,) = _kept_warnings(caplog)
    assert name in message
    assert torch.equal(v, want) and _in_pool(owner)
    ferry.reload()
    assert_same(before, snapshot(m, opt))
    assert torch.equal(v, want) and v.data_ptr() == owner.data_ptr()


def test_a_view_made_after_a_cycle_keeps_its_storage_and_is_logged_once(caplog):
    """The cached plan's fast path finds the holders too; the warning is logged once per ferry."""
    m, opt = trained()
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload()
    v = m.emb.weight[0]
    want = v.clone()
    before = snapshot(m, opt)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        for _ in range(3):
            ferry.offload()
            assert torch.equal(v, want) and v.untyped_storage().nbytes() > 0
            ferry.reload()
            assert_same(before, snapshot(m, opt)) and torch.equal(v, want)
            assert v.data_ptr() == m.emb.weight.data_ptr()
    (message,) = _kept_warnings(caplog)
    assert "targets[0].emb.weight" in message
    storage = m.emb.weight.untyped_storage()
    del v  # dropped: the next offload releases it
    ferry.offload()
    assert storage.nbytes() == 0
    ferry.reload()
    assert_same(before, snapshot(m, opt))


def test_a_view_passed_to_the_ferry_too_moves_with_its_storage():
    """The warning's advice: a view the ferry knows is re-pointed with the rest and released."""
    m, opt = trained()
    v = m.proj.weight[1:3]
    want = v.clone()
    storage = m.proj.weight.untyped_storage()
    ferry = Ferry(m, opt, v)
    ferry.offload()
    assert storage.nbytes() == 0 and _in_pool(v) and torch.equal(v, want)
    ferry.reload()
    assert torch.equal(v, want) and v.data_ptr() == m.proj.weight[1:3].data_ptr()


def test_a_pending_graph_reads_the_kept_bytes_in_backward():
    """Backward reads the state through the ``w.t()`` its graph saved: the storage is kept."""
    m, opt = trained()
    x = torch.randn(2, 8, requires_grad=True)  # so that w.t() is saved for x's grad
    want = torch.ones(2, 7) @ m.proj.weight.detach()
    loss = (x @ m.proj.weight.t()).sum()
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    ferry.offload()
    m.proj.weight.grad = None  # so that backward does not accumulate into a pool view
    loss.backward(inputs=[x])
    assert torch.equal(x.grad, want)
    ferry.reload()
    assert_same({k: v for k, v in before.items() if k != "proj.weight.grad"},
                {k: v for k, v in snapshot(m, opt).items() if k != "proj.weight.grad"})


def test_an_unchanged_storage_with_an_alias_is_kept():
    """With ``skip_unchanged``, a storage not copied again (released at once otherwise) is kept too."""
    m, opt = trained()
    ferry = Ferry(m, opt, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    v = m.proj.weight.detach()
    want, before = v.clone(), snapshot(m, opt)
    for _ in range(2):
        ferry.offload()
        assert ferry.stats.offload_bytes_copied < ferry.stats.last_offload_bytes  # some storages skipped
        assert torch.equal(v, want) and v.untyped_storage().nbytes() > 0
        ferry.reload()
        assert_same(before, snapshot(m, opt)) and v.data_ptr() == m.proj.weight.data_ptr()
    with torch.no_grad():
        v.add_(1.0)  # a write through the alias is a change: copied at the next offload
    ferry.offload()
    ferry.reload()
    assert torch.equal(m.proj.weight.detach(), want + 1.0) and torch.equal(v, want + 1.0)


def test_a_layer_wise_reload_copies_into_the_kept_storage():
    m, opt = trained()
    v = m.state_dict()["emb.weight"]
    want, before = v.clone(), snapshot(m, opt)
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload(prefetch=True)
    m(IDS)
    ferry.reload()
    assert ferry.residency is Residency.DEVICE
    assert_same(before, snapshot(m, opt))
    assert torch.equal(v, want) and v.data_ptr() == m.emb.weight.data_ptr()


def test_a_swap_keeps_the_outgoing_alias_storage():
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    fa, fc = Ferry(actor), Ferry(critic)
    v = actor.weight[0]
    want_v, want_c = v.clone(), critic.weight.detach().clone()
    fc.offload()
    torchferry.swap(fa, fc)
    assert fa.residency is Residency.HOST and torch.equal(v, want_v) and torch.equal(critic.weight, want_c)
    torchferry.swap(fc, fa)
    assert torch.equal(v, want_v) and v.data_ptr() == actor.weight.data_ptr()


def test_state_replaced_while_offloaded_leaves_the_kept_storage_to_its_alias():
    """A reconcile brings back what the targets still hold; a storage only the alias holds now
    stays as the offload left it, readable."""
    m, opt = trained()
    v = m.proj.weight.detach()
    want = v.clone()
    ferry = Ferry(m)
    ferry.offload()
    m.proj.weight = torch.nn.Parameter(torch.zeros_like(m.proj.weight))  # the old one dropped
    ferry.reload()
    assert torch.equal(v, want) and v.untyped_storage().nbytes() > 0
    assert torch.equal(m.proj.weight.detach(), torch.zeros_like(want))


def test_a_numpy_view_of_a_kept_storage_does_not_stop_the_reload():
    """A NumPy array marks its storage not resizable; a kept storage is not resized by the reload."""
    m = torch.nn.Linear(8, 8)
    want = m.weight.detach().clone()
    ferry = Ferry(m, device="cpu")
    alias = m.weight.detach()
    ferry.offload()
    arr = alias.numpy()
    ferry.reload()
    assert torch.equal(m.weight.detach(), want) and torch.equal(torch.from_numpy(arr), want)
