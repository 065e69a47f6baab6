"""Planning (``_state/plan.py``): collection, deduplication, the ferry's device, and the cached plan
that follows state replaced between cycles.
"""

from __future__ import annotations

import gc
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import IDS, Mixed, assert_same, snapshot, trained
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool
from torchferry._core._state.plan import build_plan
from torchferry._core._state.plan import resolve_device as _resolve_device


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


def _numpy_target(m: nn.Module, opt: torch.optim.Optimizer, which: str) -> tuple[torch.Tensor, str]:
    """One tensor of each kind a ferry moves, and the tail of the name the ferry gives it."""
    if which == "parameter":
        return m.proj.weight, "proj.weight"
    if which == "grad":
        return m.proj.weight.grad, "proj.weight.grad"
    if which == "buffer":
        return m.steps, "steps"
    return opt.state[m.proj.weight]["exp_avg"], "['exp_avg']"


def _assert_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(v, got[k]), k


KINDS = ["parameter", "grad", "buffer", "optimizer state"]


def _cycles_exact_then_steps(ferry: Ferry, m: nn.Module, opt: torch.optim.Optimizer, want: dict) -> None:
    """Two offload/reload cycles bring back ``want`` exactly, and the model still trains."""
    for _ in range(2):
        ferry.offload()
        ferry.reload()
        _assert_equal(want, snapshot(m, opt))
    m(IDS).backward()
    opt.step()



@pytest.mark.parametrize("which", KINDS)
def test_a_numpy_view_of_offloaded_state_does_not_block_reload_or_later_cycles(which):
    """A regression test (failed before its fix): ``np.asarray`` of an offloaded tensor (it views the
    pool) with ``device="cpu"``; the reload, with the array alive, must bring the state back, and
    every cycle after it, with the array alive and once it is gone, must be bit-exact."""
    m, opt = trained()
    ferry = Ferry(m, opt, device="cpu")
    ferry.offload()
    ferry.reload()  # the plan is cached, as when it failed
    want = snapshot(m, opt)
    ferry.offload()
    t, _ = _numpy_target(m, opt, which)
    view = np.asarray(t.detach())
    assert in_host_pool(view.ctypes.data)
    ferry.reload()  # the array alive: pool views are never resized, the device storages are others
    assert ferry.residency is Residency.DEVICE and t.device.type == "cpu" and not in_host_pool(t.data_ptr())
    _assert_equal(want, snapshot(m, opt))
    ferry.offload()  # the pool is reused: the array sees this offload's bytes
    ferry.reload()
    _assert_equal(want, snapshot(m, opt))
    del view
    gc.collect()
    _cycles_exact_then_steps(ferry, m, opt, want)


@pytest.mark.parametrize("which", KINDS)
def test_a_numpy_view_of_resident_state_is_refused_before_anything_moves(which):
    """Failed before its fix (a failure ``docs/reliability.md`` listed): with ``device="cpu"``,
    ``t.numpy()`` of a resident tensor after the first cycle made the next ``offload()`` fail
    half-way, at the release, in PyTorch's words ("Trying to resize storage that is not
    resizable"), the state left offloaded, and every ``reload()`` then failed the same way.
    PyTorch marks the storage not resizable for good, so dropping the array does not lift the
    refusal; torch-owned memory (``t.data = t.data.clone()``) does."""
    m, opt = trained()
    ferry = Ferry(m, opt, device="cpu")
    ferry.offload()
    ferry.reload()
    want = snapshot(m, opt)
    t, name = _numpy_target(m, opt, which)
    before = t.detach().clone()
    view = t.detach().numpy()
    msg = (rf"^torchferry: the storage of \S*{re.escape(name)} cannot be resized, so its memory cannot be released; "
           r"nothing was moved\. PyTorch marks a storage so for .*a NumPy array made of it \(t\.numpy\(\)")
    with pytest.raises(NotImplementedError, match=msg) as info:
        ferry.offload()
    assert "\n" not in str(info.value)
    assert ferry.residency is Residency.DEVICE
    assert all(not in_host_pool(x.data_ptr()) for x in snapshot(m, opt).values() if x.numel())
    _assert_equal(want, snapshot(m, opt))
    assert torch.equal(torch.from_numpy(view.copy()), before) and torch.equal(t, before)
    del view
    gc.collect()
    with pytest.raises(NotImplementedError, match=msg):  # the flag outlives the array
        ferry.offload()
    t.data = t.data.clone()  # the way out the message names
    for _ in range(2):
        ferry.offload()
        assert in_host_pool(t.data_ptr())
        ferry.reload()
        _assert_equal(want, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_optimizer_state_loaded_from_torch_load_is_refused_naming_the_load(tmp_path):
    """Reproduces: on a CPU ferry, ``optimizer.load_state_dict(torch.load(...))`` keeps
    torch.load's storages, which are not resizable, and the next offload's refusal blamed "a NumPy
    array". It names the load first now, and the fix it gives works."""
    m, opt = trained()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    ferry = Ferry(m, opt, device="cpu")
    ferry.offload()
    ferry.reload()
    opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    want = snapshot(m, opt)
    msg = (r"^torchferry: the storage of optimizer\.state\[0\]\['\w+'\] cannot be resized, so its memory cannot "
           r"be released; nothing was moved\. PyTorch marks a storage so for optimizer state loaded with "
           r"optimizer\.load_state_dict\(torch\.load\(\.\.\.\)\): torch\.load's storages are not resizable.*"
           r"Fix: load a copy that owns its memory: optimizer\.load_state_dict\(copy\.deepcopy\(torch\.load")
    for _ in range(2):  # refused every time, the state intact and resident
        with pytest.raises(NotImplementedError, match=msg):
            ferry.offload()
        assert ferry.residency is Residency.DEVICE
        _assert_equal(want, snapshot(m, opt))
    import copy

    opt.load_state_dict(copy.deepcopy(torch.load(tmp_path / "opt.pt")))  # the way out the message names
    _cycles_exact_then_steps(ferry, m, opt, want)


def test_parameters_assigned_from_torch_load_are_refused_naming_the_load(tmp_path):
    m = nn.Linear(4, 4)
    torch.save(m.state_dict(), tmp_path / "m.pt")
    m.load_state_dict(torch.load(tmp_path / "m.pt"), assign=True)
    with pytest.raises(NotImplementedError, match=r"storage of Linear\.(weight|bias) cannot be resized.* for a "
                                                  r"parameter or buffer loaded with module\.load_state_dict\("
                                                  r"torch\.load\(\.\.\.\), assign=True\)"):
        Ferry(m, device="cpu")


def test_a_numpy_view_made_while_offloaded_is_refused_before_the_reload_allocates():
    """A NumPy array made, while offloaded, of a view of a released device storage (a tensor made
    over a storage object kept from before: a tensor held across the offload would keep the storage
    allocated) leaves a device storage PyTorch will not resize again: the reload is refused by name
    before it allocates anything, the state stays readable on the host."""
    m = nn.Linear(8, 8)
    want = m.weight.detach().clone()
    ferry = Ferry(m, device="cpu")
    storage = m.weight.untyped_storage()  # a storage object: not a holder that keeps it allocated
    ferry.offload()
    torch.empty(0).set_(storage).numpy()  # an empty view of the released storage: reads nothing
    del storage
    with pytest.raises(RuntimeError, match=r"^torchferry: cannot reload: the device storage of Linear\.weight "
                                           r"was made not resizable while offloaded") as info:
        ferry.reload()
    assert "\n" not in str(info.value)
    assert ferry.residency is Residency.HOST and in_host_pool(m.weight.data_ptr())
    assert torch.equal(m.weight, want)
