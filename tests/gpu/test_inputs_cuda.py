"""GPU tier of the inputs' kinds (``tests/cpu/test_targets.py``): what only shows when the device changes (CUDA <-> CPU).

DDP, TP hooks, a frozen FSDP2 parameter and module.to() while off the device over NCCL on 2 GPUs (the CPU tier
runs the same checks over gloo, where no device changes); device memory back
at its baseline after close() or a drop; a checkpoint resume while offloaded;
optimizer state hidden outside ``optimizer.state`` refused; per-slot host
storages still pinned; ``state_dict()`` after a prefetch under NCCL.
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

from tests.cpu.test_integration_ddp_tp import (
    check_ddp_trains_as_without_offload,
    check_tp_hooks_and_optimizer_in_backward,
)
from tests.cpu.test_fsdp2_module_to import (
    check_load_state_dict_of_a_root_unit_while_prefetching,
    check_module_to_while_off_device,
    check_write_after_module_to_while_prefetching,
)
from tests.cpu.test_integration_fsdp2 import check_frozen_parameter_keeps_its_grad
from tests.helpers import assert_same, snapshot
from tests.spawn import run_spawned
from torchferry import Ferry, Residency

pytestmark = pytest.mark.gpu


def _ddp(rank, world):
    check_ddp_trains_as_without_offload(rank, world, device=f"cuda:{rank}")


def _tp(rank, world):
    check_tp_hooks_and_optimizer_in_backward(rank, world, device=f"cuda:{rank}")


def _frozen(rank, world):
    check_frozen_parameter_keeps_its_grad(rank, world, device=f"cuda:{rank}")


def _module_to(rank, world):
    check_module_to_while_off_device(rank, world, device=f"cuda:{rank}")


def _write_after_to(rank, world):
    check_write_after_module_to_while_prefetching(rank, world, device=f"cuda:{rank}")


def _root_unit_load(rank, world):
    check_load_state_dict_of_a_root_unit_while_prefetching(rank, world, device=f"cuda:{rank}")


def _prefetch_state_dict_nccl(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import build_uneven, train_step

    mesh = init_device_mesh("cuda", (world,))
    m, opt = build_uneven(mesh, f"cuda:{rank}")
    train_step(m, opt, torch.randn(8, 16, device=f"cuda:{rank}"), set_to_none=True)
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload(prefetch=True)
    sd = m.state_dict()  # completes the prefetch (was: c10d "No backend type ... cpu")
    assert ferry.residency is not Residency.PREFETCHING
    full = {k: v.full_tensor() for k, v in sd.items()}
    assert all(v.device.type == "cuda" for v in full.values())
    ferry.close()


@pytest.mark.multigpu
@pytest.mark.parametrize("check", [_ddp, _tp, _frozen, _prefetch_state_dict_nccl, _module_to, _write_after_to],
                         ids=["ddp", "tp_hooks", "frozen_grad", "state_dict_after_prefetch", "module_to_uneven",
                              "write_after_to_uneven"])
def test_two_rank_nccl(check):
    run_spawned(check, world=2, backend="nccl")


@pytest.mark.parametrize("check", [_module_to, _write_after_to, _root_unit_load],
                         ids=["module_to", "write_after_to", "root_unit_load_state_dict"])
def test_module_to_while_offloaded_or_prefetching_one_gpu(check):
    """[Note: FSDP2's shard buffer after a move] and [Note: storage swapped while prefetching] over
    NCCL on one GPU: the pool views are host memory and the shards device memory."""
    run_spawned(check, world=1, backend="nccl")


def _trained(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("how", ["close", "drop"])
def test_device_memory_back_at_baseline_after_close_or_drop(how):
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    m, opt = _trained()
    ferry = Ferry(m, opt)
    for prefetch in (False, True, False):
        ferry.offload()
        ferry.reload(prefetch=prefetch)
    if how == "close":
        ferry.close()
    else:
        del ferry
    m.to("cpu")  # moving the module by other means frees its memory
    opt.state.clear()
    m.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


def test_checkpoint_resume_while_offloaded_leaves_everything_on_the_device():
    m, opt = _trained()
    ref_m, ref_opt = _trained()
    ckpt = copy.deepcopy(ref_opt.state_dict())
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    opt.load_state_dict(copy.deepcopy(ckpt))  # new state tensors on the CPU (params are there)
    ferry.offload()  # verl's offload_fsdp_optimizer after load_checkpoint
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    ferry.reload()
    grown = torch.cuda.memory_allocated() - held
    state = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert all(t.device.type == "cuda" for t in state)
    assert grown <= ferry.state_bytes + (4 << 20)  # the dead state was not re-allocated
    ref_opt.load_state_dict(ckpt)
    x = torch.randn(8, 1024, device="cuda")
    for model, o in ((ref_m, ref_opt), (m, opt)):
        o.zero_grad()
        model(x).square().mean().backward()
        o.step()  # was: "Expected all tensors to be on the same device"
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


@pytest.mark.parametrize("source", ["cuda", "cpu"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_storage_swapped_while_offloaded_survives_reload(source, prefetch):
    """``p.data = t`` while offloaded (a CUDA or a CPU tensor): reload keeps it, the same object,
    its autograd hook, and the next cycle moves it (was: reload brought the old bytes back)."""
    m, opt = _trained()
    ferry = Ferry(m, opt, skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    w = m[0].weight
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    ferry.offload().wait()
    new = torch.randn(w.shape, device=source, generator=torch.Generator(source).manual_seed(5))
    w.data = new
    ferry.reload(prefetch=prefetch).wait()
    assert w.device.type == "cuda" and m[0].weight is w
    torch.testing.assert_close(w, new.cuda(), atol=0, rtol=0)
    ferry.offload().wait()
    ferry.reload().wait()
    torch.testing.assert_close(w, new.cuda(), atol=0, rtol=0)
    opt.zero_grad()
    m(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    assert fired == [1] and w.grad.device.type == "cuda"


def test_ties_and_old_views_survive_bytes_given_while_offloaded():
    """On the device: ``b.data = a.data`` while offloaded ties them after the reload, one CPU tensor
    given to two parameters becomes one device storage, a view taken before keeps the old bytes."""
    m, opt = _trained()
    first, last = m[0], m[2]
    alias = first.bias.detach().view(-1)
    old = alias.clone()
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    last.bias.data = first.bias.data
    shared = torch.full_like(first.weight, 0.25, device="cpu")
    first.weight.data = shared
    last.weight.data = shared
    first.bias.data = torch.zeros_like(first.bias)
    ferry.reload().wait()
    st = lambda p: p.untyped_storage()._cdata  # noqa: E731
    assert all(p.device.type == "cuda" for p in m.parameters())
    assert st(first.weight) == st(last.weight)
    torch.testing.assert_close(first.weight, shared.cuda(), atol=0, rtol=0)
    torch.testing.assert_close(alias, old, atol=0, rtol=0)
    assert not torch.equal(last.bias, first.bias)  # last.bias was tied to the *old* first.bias bytes
    torch.testing.assert_close(last.bias, old, atol=0, rtol=0)
    ferry.offload().wait()
    ferry.reload().wait()
    assert st(first.weight) == st(last.weight)
    torch.testing.assert_close(last.weight, shared.cuda(), atol=0, rtol=0)


def test_offloaded_views_are_pinned_and_pickle_only_their_own_bytes():
    m, opt = _trained()
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    assert all(p.is_pinned() for p in m.parameters())
    assert all(v.is_pinned() for st in opt.state.values() for k, v in st.items() if k != "step")
    bias = m[0].bias
    assert len(pickle.dumps(bias)) < bias.nbytes + 4096
    ferry.reload()


class _Hidden(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.scratch = torch.zeros(1024, device="cuda")  # state outside optimizer.state


def test_optimizer_state_outside_optimizer_state_is_refused_by_name():
    m = nn.Linear(4, 4).cuda()
    with pytest.raises(NotImplementedError, match=r"_Hidden holds state on cuda:0 outside optimizer.state \(scratch"):
        Ferry(m, _Hidden(m.parameters()))
