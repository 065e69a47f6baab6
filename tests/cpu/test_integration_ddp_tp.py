"""DDP, tensor parallelism and ZeroRedundancyOptimizer over gloo (2 spawned CPU processes).

Reproduces reports made against commit df8fb81 (2 x H200 and CPU): DDP
stopped synchronising after the first cycle (its reducer hooks live on the AccumulateGrad node
that ``.data =`` dropped), TP parameters lost their tensor and post-accumulate-grad hooks (12 of
24 calls on the CPU), a DTensor over a tensor subclass gave a raw storage error and a
``ZeroRedundancyOptimizer``'s Adam moments stayed where they were. The checks take a device,
so the GPU tier runs them over NCCL (``tests/gpu/test_inputs_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import assert_same, snapshot, train_steps
from tests.spawn import run_spawned
from torchferry import Ferry
from torchferry._core._state.host_blocks import in_host_pool


def check_ddp_trains_as_without_offload(rank: int, world: int, device: str = "cpu") -> None:
    """DDP with different data per rank, one cycle per step: identical to the run without."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(device)

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
        ddp = DDP(m, device_ids=[dev.index] if dev.type == "cuda" else None)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    ref, ref_opt = build()
    ddp, opt = build()
    ferry = Ferry(ddp.module, opt)
    node_calls = []
    w = ddp.module[0].weight
    w.view_as(w).grad_fn.next_functions[0][0].register_hook(lambda *a: node_calls.append(1))

    def data(step):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step)).to(dev)

    train_steps([(ref, ref_opt), (ddp, opt)], data, steps=4, ferry=ferry)
    assert_same(snapshot(ref.module, ref_opt), snapshot(ddp.module, opt))
    assert len(node_calls) == 4  # the AccumulateGrad node (and DDP's hooks on it) ran every step
    # The ranks trained one model: DDP synchronised every step.
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered[1:])
    ferry.close()


def check_tp_hooks_and_optimizer_in_backward(rank: int, world: int, device: str = "cpu") -> None:
    """Tensor-parallel DTensor parameters keep their hooks; optimizer-in-backward trains as without."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dev = torch.device(device)
    mesh = init_device_mesh(dev.type, (world,))

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).to(dev)
        parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        calls = {"tensor": 0, "post": 0}
        opts = []
        for p in m.parameters():
            o = torch.optim.AdamW([p], lr=1e-2)
            opts.append(o)
            p.register_hook(lambda g: calls.__setitem__("tensor", calls["tensor"] + 1))

            def post(param, o=o):
                calls["post"] += 1
                o.step()
                o.zero_grad()

            p.register_post_accumulate_grad_hook(post)
        return m, opts, calls

    ref, ref_opts, ref_calls = build()
    m, opts, calls = build()
    ferry = Ferry(m, *opts)

    def data(step):
        return torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(dev)

    steps, n = 3, len(list(m.parameters()))
    train_steps([(ref, None), (m, None)], data, steps=steps, ferry=ferry)
    assert calls == ref_calls == {"tensor": n * steps, "post": n * steps}
    for a, b in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(a._local_tensor, b._local_tensor, atol=0, rtol=0)
    for ro, o in zip(ref_opts, opts):
        for (ka, sa), (kb, sb) in zip(ro.state.items(), o.state.items()):
            for key in sa:
                va, vb = sa[key], sb[key]
                va = va._local_tensor if hasattr(va, "_local_tensor") else va
                vb = vb._local_tensor if hasattr(vb, "_local_tensor") else vb
                torch.testing.assert_close(va, vb, atol=0, rtol=0)
    ferry.close()


def test_ddp_trains_as_without_offload_gloo():
    run_spawned(check_ddp_trains_as_without_offload, world=2)


def test_tp_hooks_and_optimizer_in_backward_survive_cycles_gloo():
    run_spawned(check_tp_hooks_and_optimizer_in_backward, world=2)


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
