"""State replaced while offloaded (``_ferry/reconcile.py``): the next offload() moves what is there now,
reload() leaves every tensor on the device, dead tensors are neither kept nor re-allocated.

Reproduces reports made against commit df8fb81: an ``optimizer.load_state_dict`` while
offloaded was lost track of (the next offload moved 0 of 12 new tensors and the reload
re-allocated the dead ones).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from tests.helpers import assert_same, identities, snapshot, trained
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool

IDS = torch.tensor([[1, 2, 3]])


def test_optimizer_load_state_dict_while_offloaded_then_offload_moves_what_is_there_now():
    m, opt = trained(ids=IDS)
    m2, opt2 = trained(seed=1, ids=IDS)
    checkpoint = opt2.state_dict()
    ferry = Ferry(m, opt)
    ferry.offload()
    old = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    old_storages = [StorageWeakRef(t.untyped_storage()) for t in old]
    opt.load_state_dict(checkpoint)  # a resume while offloaded (verl's load_checkpoint)
    new = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert not any(in_host_pool(t.data_ptr()) for t in new)
    ferry.offload()  # moves what is there now
    assert ferry.residency is Residency.HOST
    assert all(in_host_pool(t.data_ptr()) for t in new if t.numel())
    del old
    gc.collect()
    assert all(r.expired() for r in old_storages)  # the dead tensors are not kept
    ferry.reload()
    assert not any(in_host_pool(t.data_ptr()) for t in new)
    want = snapshot(m2, opt2)
    got = snapshot(m, opt)
    assert_same({k: v for k, v in want.items() if k.startswith("opt.")},
                {k: v for k, v in got.items() if k.startswith("opt.")})
    opt.step()  # usable
    ferry.close()


def test_load_while_offloaded_then_reload_leaves_state_resident_and_training_matches():
    m, opt = trained(ids=IDS)
    ref_m, ref_opt = trained(ids=IDS)
    checkpoint = copy.deepcopy(ref_opt.state_dict())
    model_sd = {k: v.clone() for k, v in ref_m.state_dict().items()}
    ferry = Ferry(m, opt)
    ferry.offload()
    opt.load_state_dict(copy.deepcopy(checkpoint))  # a resume while offloaded
    m.load_state_dict(model_sd)  # in place: into the host views
    ferry.reload()
    assert ferry.residency is Residency.DEVICE
    ref_opt.load_state_dict(checkpoint)
    for model, o in ((ref_m, ref_opt), (m, opt)):
        model(IDS).backward()
        o.step()
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))
    ferry.offload()
    ferry.reload()
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


def test_parameters_reassigned_or_grads_dropped_while_offloaded():
    m, opt = trained(ids=IDS)
    ferry = Ferry(m, opt)
    ferry.offload()
    new_w = nn.Parameter(torch.full_like(m.proj.weight, 2.0))
    m.proj.weight = new_w  # re-assigned (load_state_dict(assign=True) does this)
    m.low.weight.grad = None  # zero_grad(set_to_none=True) while offloaded
    ferry.reload()
    assert m.proj.weight is new_w and torch.equal(new_w, torch.full_like(new_w, 2.0))
    assert m.low.weight.grad is None
    ferry.offload()
    assert in_host_pool(new_w.data_ptr())
    ferry.reload()
    assert torch.equal(new_w, torch.full_like(new_w, 2.0)) and m.low.weight.grad is None


def _give_other_bytes(m, opt, how: str) -> dict[str, torch.Tensor]:
    """Gives offloaded tensors other bytes in place of their objects' storage; returns the values."""
    w, b, buf = m.proj.weight, m.proj.bias, next(m.buffers())
    avg = opt.state[w]["exp_avg"]
    with torch.no_grad():
        new = {"w": torch.full_like(w, 3.0), "b": torch.full_like(b, -1.5), "buf": torch.ones_like(buf),
               "avg": torch.full_like(avg, 0.25), "grad": torch.full_like(w.grad, 7.0)}
        if how == "data":
            w.data, b.data, buf.data, avg.data = new["w"], new["b"], new["buf"], new["avg"]
            w.grad.data = new["grad"]
        else:
            w.set_(new["w"].clone())
            b.set_(new["b"].clone())
            buf.set_(new["buf"].clone())
            avg.set_(new["avg"].clone())
            w.grad.set_(new["grad"].clone())
    return new


@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize("back", ["reload", "prefetch", "offload", "skip_unchanged"])
def test_storage_swapped_while_offloaded_is_kept(how, back):
    """``p.data = t`` / ``p.set_(t)`` while offloaded: the assigned bytes survive
    the reload, in the same objects, and the next cycle moves them."""
    m, opt = trained(ids=IDS)
    ferry = Ferry(m, opt, skip_unchanged=back == "skip_unchanged")
    for _ in range(2):  # the second cycle: host views cached, skips armed
        ferry.offload()
        ferry.reload()
    w = m.proj.weight
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    objects = identities(m, opt)
    ferry.offload()
    untouched = snapshot(m, opt)
    new = _give_other_bytes(m, opt, how)
    if back == "offload":
        ferry.offload()  # finds the change: reconciles, then offloads what is there now
        assert ferry.residency is Residency.HOST and in_host_pool(w.data_ptr())
    ferry.reload(prefetch=back == "prefetch")
    assert ferry.residency is not Residency.HOST
    assert identities(m, opt) == objects
    buf = next(m.buffers())
    got = {"w": w, "b": m.proj.bias, "buf": buf, "avg": opt.state[w]["exp_avg"], "grad": w.grad}
    for k in new:
        assert not in_host_pool(got[k].data_ptr()), k
        torch.testing.assert_close(got[k], new[k], atol=0, rtol=0, msg=k)
    now = snapshot(m, opt)
    changed = {"proj.weight", "proj.bias", "proj.weight.grad"}
    for k in untouched:  # everything else came back as it was
        if k not in changed and not k.startswith("buf.") and "exp_avg" not in k:
            torch.testing.assert_close(now[k], untouched[k], atol=0, rtol=0, msg=k)
    ferry.offload()  # the next cycle moves the assigned bytes
    ferry.reload()
    torch.testing.assert_close(w, new["w"], atol=0, rtol=0)
    torch.testing.assert_close(w.grad, new["grad"], atol=0, rtol=0)
    w.grad = None
    m(IDS).backward()
    assert fired == [1]  # the hook registered before the offload still fires


def test_narrowed_while_offloaded_keeps_the_new_shape():
    m, opt = trained(ids=IDS)
    ferry = Ferry(m, opt)
    ferry.offload()
    b = m.proj.bias
    first = b.detach()[:2].clone()
    b.data = b.data[:2]  # same address, other shape
    ferry.reload()
    assert b.shape == (2,) and not in_host_pool(b.data_ptr())
    torch.testing.assert_close(b, first, atol=0, rtol=0)


def test_views_taken_before_keep_the_old_bytes_and_ties_by_data_stay_tied():
    """Other bytes given while offloaded, as plain PyTorch does it: a view of the
    old storage taken before (an alias the ferry does not know, like FSDP2's padded shard) still
    reads the old bytes; ``head.weight.data = emb.weight.data`` ties them; one tensor given to two
    parameters is one storage after the reload; a transpose (same address, shape, dtype) is kept."""
    torch.manual_seed(0)
    m = nn.ModuleDict({"emb": nn.Linear(4, 4, bias=False), "head": nn.Linear(4, 4, bias=False),
                       "a": nn.Linear(3, 3, bias=False), "b": nn.Linear(3, 3, bias=False),
                       "sq": nn.Linear(5, 5, bias=False)})
    alias = m["emb"].weight.detach().view(-1)
    old = alias.clone()
    sq = m["sq"].weight.detach().clone()
    ferry = Ferry(m)
    ferry.offload()
    m["head"].weight.data = m["emb"].weight.data
    shared = torch.full((3, 3), 2.0)
    m["a"].weight.data = shared
    m["b"].weight.data = shared
    m["sq"].weight.data = m["sq"].weight.data.t()
    ferry.reload()
    torch.testing.assert_close(alias, old, atol=0, rtol=0)
    st = lambda p: p.untyped_storage()._cdata  # noqa: E731
    assert st(m["head"].weight) == st(m["emb"].weight)
    assert st(m["a"].weight) == st(m["b"].weight)
    assert m["sq"].weight.stride() == (1, 5)
    torch.testing.assert_close(m["sq"].weight, sq.t(), atol=0, rtol=0)
    with torch.no_grad():
        m["emb"].weight.add_(1.0)
    torch.testing.assert_close(m["head"].weight, m["emb"].weight, atol=0, rtol=0)
    for _ in range(2):  # later cycles move the new layout, still tied
        ferry.offload()
        ferry.reload()
    assert st(m["head"].weight) == st(m["emb"].weight) and st(m["a"].weight) == st(m["b"].weight)
    torch.testing.assert_close(m["a"].weight, shared, atol=0, rtol=0)


@pytest.mark.parametrize("freeze", [True, False])
def test_requires_grad_flipped_while_offloaded_is_kept(freeze):
    """``requires_grad_`` while offloaded (freezing a base, unfreezing it) survives the reload, and the
    optimizer step after it does what it would do without a ferry (was: reload undid the flip)."""
    def run(ferried: bool):
        torch.manual_seed(0)
        m = nn.Linear(4, 3)
        m.weight.requires_grad_(not freeze)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ferry = Ferry(m, opt) if ferried else None
        if ferry:
            ferry.offload()
        m.weight.requires_grad_(freeze)
        if ferry:
            ferry.reload()
        assert m.weight.requires_grad is freeze
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
        return m.weight.detach().clone(), m.bias.detach().clone()

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_grad_that_no_longer_fits_its_tensor_is_refused_by_name():
    """``p.data = smaller`` with the old ``.grad`` kept: the next offload raises naming the tensor and
    the fix, and leaves everything resident and intact (was PyTorch's bare "attempting to assign a
    gradient of size ...")."""
    m, opt = trained(ids=IDS)
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload()
    m.proj.bias.data = m.proj.bias.data[:2].clone()
    before = snapshot(m, opt)
    with pytest.raises(RuntimeError, match=r"proj\.bias: its \.grad \(\(7,\).*no longer fits.*Set its \.grad to None"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE
    assert_same(before, snapshot(m, opt))
    m.proj.bias.grad = None
    ferry.offload()
    ferry.reload()
    assert m.proj.bias.shape == (2,)
    assert_same({k: v for k, v in before.items() if k != "proj.bias.grad"}, snapshot(m, opt))
