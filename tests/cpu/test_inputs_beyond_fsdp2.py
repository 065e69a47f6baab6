"""Inputs users bring besides the FSDP2 happy path: moved correctly or refused up front, by name.

Reproduces issue 15 items 5, 8, 9 and 10 and issue 13's CLI/engine items
(commit df8fb81): a DTensor over a tensor subclass gave a raw storage error,
inference-mode buffers broke prefetch and offload-during-forward, a
``ZeroRedundancyOptimizer``'s Adam moments stayed where they were, and
``state_dict()`` right after ``reload(prefetch=True)`` failed inside c10d.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned
from torchferry import Ferry, Residency
from torchferry._host_memory import in_host_pool


def test_nested_tensor_is_refused_as_nested():
    with pytest.raises(NotImplementedError, match="is a nested tensor"):
        Ferry(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))


def test_reload_prefetch_takes_only_bool_or_policy():
    m = nn.Linear(3, 3)
    ferry = Ferry(m)
    ferry.offload()
    with pytest.raises(TypeError, match="takes True, False or a Prefetch"):
        ferry.reload(prefetch="yes")
    assert ferry.residency is Residency.HOST  # nothing moved
    ferry.reload(prefetch=True)  # no FSDP units, no optimizer: a plain reload
    assert ferry.residency is Residency.DEVICE


class WithRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        with torch.inference_mode():
            cache = torch.arange(8.0)
        self.register_buffer("cos", cache)

    def forward(self, x):
        return self.lin(x) * self.cos


def test_inference_mode_buffers_move_and_come_back():
    m = WithRotary()
    want = m.cos.clone()
    ferry = Ferry(m)
    for prefetch in (False, True):
        ferry.offload()
        assert m.cos.device.type == "cpu" and torch.equal(m.cos, want)
        ferry.reload(prefetch=prefetch)
        assert m.cos.is_inference() and torch.equal(m.cos, want)
        with torch.no_grad():
            m(torch.ones(2, 8))


def check_fsdp2_inference_buffers_and_state_dict_after_prefetch(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.cpu.test_fsdp2_gloo import build_uneven, train_step

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = nn.Sequential(WithRotary(), WithRotary())  # forward-only, as a log-prob model
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    x = torch.ones(2, 8)
    with torch.no_grad():
        want = m(x)
    ferry = Ferry(m)
    # Layer-wise reload and offload during forward over units holding inference buffers.
    for _ in range(2):
        ferry.offload()
        ferry.reload(prefetch=True)
        ferry.offload_during_forward()
        with torch.no_grad():
            assert torch.equal(m(x), want)
        ferry.offload()
        ferry.reload()
    ferry.close()
    # state_dict() (and the optimizer's) right after a prefetch completes it first.
    m, opt = build_uneven(mesh)
    train_step(m, opt, torch.randn(8, 16), set_to_none=True)
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload(prefetch=True)
    assert ferry.residency is Residency.PREFETCHING
    sd = m.state_dict()
    assert ferry.residency is Residency.DEVICE
    assert not any(in_host_pool(v._local_tensor.data_ptr()) for v in sd.values() if v._local_tensor.numel())
    ferry.offload()
    ferry.reload(prefetch=True)
    assert ferry.residency is Residency.PREFETCHING
    opt.state_dict()
    assert ferry.residency is Residency.DEVICE
    ferry.close()


def test_fsdp2_inference_buffers_and_state_dict_after_prefetch_gloo():
    run_spawned(check_fsdp2_inference_buffers_and_state_dict_after_prefetch, world=2)


def check_dtensor_over_subclass_is_refused_and_zero_is_moved(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.two_tensor import TwoTensor

    mesh = init_device_mesh("cpu", (world,))
    local = TwoTensor(torch.ones(2, 3), torch.ones(2, 3))
    dt = DTensor.from_local(local, mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match="local shard is a TwoTensor"):
        Ferry(dt)
    # ZeroRedundancyOptimizer keeps Adam's state in its inner optimizer (zero.optim.state).
    torch.manual_seed(0)
    m = nn.Linear(16, 16)
    zero = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    m(torch.ones(2, 16)).sum().backward()
    zero.step()
    moments = [v for st in zero.optim.state.values() for k, v in st.items() if k != "step"]
    assert moments
    want = [t.clone() for t in moments]
    ferry = Ferry(m, zero)
    ferry.offload()
    assert all(in_host_pool(t.data_ptr()) for t in moments)
    with pytest.raises(RuntimeError, match="offloaded"):
        zero.step()
    ferry.reload()
    assert all(torch.equal(a, b) for a, b in zip(moments, want))
    from torchferry.compat.verl import load_fsdp_optimizer, offload_fsdp_optimizer

    offload_fsdp_optimizer(zero)
    assert all(in_host_pool(t.data_ptr()) for t in moments)
    load_fsdp_optimizer(zero, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(moments, want))


def test_dtensor_over_subclass_is_refused_and_zero_is_moved_gloo():
    run_spawned(check_dtensor_over_subclass_is_refused_and_zero_is_moved, world=2)
