"""Planning (``_plan.py``): collection, deduplication, the ferry's device, and the cached plan
that follows state replaced between cycles.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers import IDS, Mixed, assert_same, snapshot, trained
from torchferry import Ferry, Residency
from torchferry._host_memory import in_host_pool
from torchferry._plan import build_plan
from torchferry._plan import resolve_device as _resolve_device


def test_tied_weights_and_views_move_once():
    m = Mixed()
    base = torch.arange(12.0)
    view = base[2:8].view(2, 3)
    plan = build_plan([m, base, view])
    # emb.weight and head.weight are one Parameter; base and view share a storage.
    names = [r.name for r in plan.tensors]
    assert sum("emb.weight" in n or "head.weight" in n for n in names) == 1
    storages = {r.storage_index for r in plan.tensors if r.name.startswith("tensors")}
    assert len(storages) == 1
    assert plan.state_bytes == sum(s.nbytes() for s in plan.storages)
    assert len({s._cdata for s in plan.storages}) == len(plan.storages)


def test_zero_size_storages_are_not_merged():
    a, b = torch.empty(0), torch.empty(0, 3)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    plan = build_plan([a, b])
    assert len(plan.storages) == 2 and plan.nbytes == [0, 0]


def test_grads_and_optimizer_state_are_collected():
    m = nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = [r.name for r in build_plan([m, opt]).tensors]
    assert "Linear.weight.grad" not in names  # two targets: prefixed by index
    assert "targets[0].weight.grad" in names
    assert {"optimizer.state[0]['exp_avg']", "optimizer.state[0]['exp_avg_sq']", "optimizer.state[0]['step']"} <= set(names)


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        build_plan([nn.Linear(2, 2)], "cuda")


def test_several_devices_are_refused():
    found = [
        ("a", None, SimpleNamespace(device=torch.device("cuda", 0))),
        ("b", None, SimpleNamespace(device=torch.device("cuda", 1))),
    ]
    with pytest.raises(ValueError, match=r"several devices \(a on cuda:0, b on cuda:1\)"):
        _resolve_device(found, None)
    with pytest.raises(ValueError, match="a is on cuda:0, but the ferry's device is cpu"):
        _resolve_device(found[:1], torch.device("cpu"))


def test_the_ferrys_device_is_the_accelerator_when_cpu_tensors_are_mixed_in():
    """A GPU model's optimizer holds CPU tensors (AdamW's ``step`` counters): the ferry's device is
    still the GPU. (That those CPU tensors stay where they are is checked on a GPU:
    tests/gpu/test_cuda.py::test_cpu_tensors_stay_put_when_the_ferry_is_on_a_gpu.)"""
    from types import SimpleNamespace

    found = [("w", None, SimpleNamespace(device=torch.device("cuda", 0))),
             ("step", None, SimpleNamespace(device=torch.device("cpu")))]
    assert _resolve_device(found, None) == torch.device("cuda", 0)


def test_a_cpu_ferry_plans_every_cpu_tensor_including_the_step_counters():
    """With the CPU as the ferry's device every CPU tensor is on it, so AdamW's ``step`` counters
    are planned (and moved) like the rest; only a GPU ferry leaves CPU tensors alone."""
    m, opt = trained()
    plan = build_plan([m, opt])
    assert plan.device == torch.device("cpu")
    planned = {id(r.tensor) for r in plan.tensors}
    steps = [st["step"] for st in opt.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps)
    assert all(id(s) in planned for s in steps)
    planned_storages = {s._cdata for s in plan.storages}
    assert all(s.untyped_storage()._cdata in planned_storages for s in steps)
    plan = build_plan([m, opt], device="cpu")
    assert {id(r.tensor) for r in plan.tensors} == planned


def test_state_that_appears_later_is_planned_again():
    torch.manual_seed(0)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters())
    ferry = Ferry(m, opt)  # no grads, no optimizer state yet
    ferry.offload()
    small = ferry.host_bytes
    ferry.reload()
    m(IDS).backward()
    opt.step()
    before = snapshot(m, opt)
    ferry.offload()
    assert ferry.host_bytes > small  # grew for grads + exp_avg/exp_avg_sq/step
    assert all(p.grad.untyped_storage().data_ptr() != 0 for p in m.parameters())
    ferry.reload()
    assert_same(before, snapshot(m, opt))
    opt.zero_grad(set_to_none=True)  # grads gone: the pool is kept, not shrunk
    grown = ferry.host_bytes
    ferry.offload()
    ferry.reload()
    assert ferry.host_bytes == grown


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
def test_cached_plan_follows_replaced_parameters_and_new_grads():
    m = nn.Linear(4, 4)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    first = ferry._set.cache.plan
    ferry.offload()
    ferry.reload()
    assert ferry._set.cache.plan is first  # steady cycles reuse the plan
    m.weight = nn.Parameter(torch.full((4, 4), 3.0))  # a new tensor object
    ferry.offload()
    assert in_host_pool(m.weight.data_ptr()) and torch.equal(m.weight, torch.full((4, 4), 3.0))
    ferry.reload()
    assert torch.equal(m.weight, torch.full((4, 4), 3.0)) and ferry._set.cache.plan is not first
    m(torch.ones(1, 4)).sum().backward()  # grads appear: the plan grows
    ferry.offload()
    assert in_host_pool(m.weight.grad.data_ptr()) and ferry.state_bytes == 2 * (64 + 16)
    ferry.reload()
    with torch.no_grad():
        m.weight.data = m.weight.data.t()  # same storage, other strides: the host views follow
    want = m.weight.detach().clone()
    ferry.offload()
    assert m.weight.stride() == (1, 4)
    ferry.reload()
    assert torch.equal(m.weight, want) and m.weight.stride() == (1, 4)


@pytest.mark.usefixtures("own_ledger")  # its own node ledger, as in test_host_budget.py
def test_share_memory_after_a_cached_plan_is_refused():
    m = nn.Linear(4, 4)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    m.share_memory()
    with pytest.raises(NotImplementedError, match="shared memory"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE and m.weight.untyped_storage().nbytes() == 64
