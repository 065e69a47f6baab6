"""What a ferry holds after close() or when dropped; state replaced between cycles; escaping host views.

Reproduces issue 15 items 2-4 (commit df8fb81): a closed ferry kept 46.3 GB of
device memory alive (its cached plan held the storages); an
``optimizer.load_state_dict`` while offloaded was lost track of (the next
offload moved 0 of 12 new tensors and the reload re-allocated the dead ones);
``pickle.dumps`` of an offloaded 2 KiB bias wrote 8.4 MB (the whole pool) and
sharing it moved the pool to shared memory.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from tests.helpers import Mixed, assert_same, snapshot
from torchferry import Ferry, Residency
from torchferry._host_memory import in_host_pool

IDS = torch.tensor([[1, 2, 3]])


def trained(seed=0):
    torch.manual_seed(seed)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(IDS).backward()
    opt.step()
    return m, opt


def _hooks(m: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(len(x._forward_pre_hooks) + len(x._forward_hooks) + len(x._state_dict_pre_hooks) for x in m.modules())
    return n + len(opt._optimizer_step_pre_hooks) + len(getattr(opt, "_optimizer_state_dict_pre_hooks", {}))


def test_closed_or_dropped_ferry_holds_no_storage_memory_or_hooks():
    for how in ("close", "drop"):
        m, opt = trained()
        hooks = _hooks(m, opt)
        ferry = Ferry(m, opt)
        for prefetch in (False, True):
            ferry.offload()
            ferry.reload(prefetch=prefetch)
        old = [StorageWeakRef(p.untyped_storage()) for p in m.parameters()]
        pool = weakref.ref(ferry._pool)
        if how == "close":
            ferry.close()
        else:
            del ferry
        gc.collect() if how == "close" else None  # a dropped ferry must go by reference counting alone
        assert _hooks(m, opt) == hooks
        if how == "drop":
            assert pool() is None
        m.to(torch.float64)  # moving the module by other means frees its old storages
        opt.state.clear()
        assert all(r.expired() for r in old), how
        assert not any(in_host_pool(p.data_ptr()) for p in m.parameters())


def test_optimizer_load_state_dict_while_offloaded_then_offload_moves_what_is_there_now():
    m, opt = trained()
    m2, opt2 = trained(seed=1)
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
    m, opt = trained()
    ref_m, ref_opt = trained()
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
    m, opt = trained()
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


def test_offloaded_tensor_pickles_saves_and_shares_only_its_own_bytes():
    m, opt = trained()
    resident = io.BytesIO()
    torch.save(m.state_dict(), resident)
    ferry = Ferry(m, opt)
    ferry.offload()
    bias = m.proj.bias
    assert len(pickle.dumps(bias)) < bias.nbytes + 4096
    offloaded = io.BytesIO()
    torch.save(m.state_dict(), offloaded)
    assert len(offloaded.getvalue()) <= len(resident.getvalue()) + 4096
    want = bias.detach().clone()
    bias.untyped_storage().share_memory_()  # what a torch.multiprocessing queue put does
    assert bias.untyped_storage().nbytes() == bias.nbytes  # only its own bytes were moved
    assert all(in_host_pool(p.data_ptr()) for n, p in m.named_parameters() if "proj.bias" not in n and p.numel())
    ferry.reload()
    assert torch.equal(bias, want)
    with torch.no_grad():
        bias.add_(1)
    ferry.offload()  # the moved slot is noticed: the host view is made again
    assert in_host_pool(bias.data_ptr()) and torch.equal(bias, want + 1)
    ferry.reload()
    assert torch.equal(bias, want + 1)
