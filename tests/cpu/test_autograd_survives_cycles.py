"""Everything autograd attaches to a parameter survives an offload/reload cycle.

Reproduces the reports of issue 15 items 1, 6 and 7 (2 x H200 and CPU, commit
df8fb81): DDP stopped synchronising after the first cycle (its reducer hooks
live on the AccumulateGrad node that ``.data =`` dropped), TP parameters lost
their tensor and post-accumulate-grad hooks (12 of 24 calls on the CPU), and a
frozen parameter holding a ``.grad`` lost it. The checks take a device, so the
GPU tier runs them over NCCL (``tests/gpu/test_autograd_cuda.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import assert_same, snapshot
from tests.spawn import run_spawned
from torchferry import Ferry


def _steps(models, x_for_step, steps=4, ferry=None, zero=True):
    for step in range(steps):
        x = x_for_step(step)
        for model, opt in models:
            loss = model(x).square().mean()
            loss.backward()
            if opt is not None:
                opt.step()
                if zero:
                    opt.zero_grad()
        if ferry is not None:
            ferry.offload()
            ferry.reload()


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

    _steps([(ref, ref_opt), (ddp, opt)], data, steps=4, ferry=ferry)
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
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    _steps([(ref, None), (m, None)], data, steps=steps, ferry=ferry)
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


def check_frozen_parameter_keeps_its_grad(rank: int, world: int, device: str = "cpu") -> None:
    """FSDP2: a parameter frozen mid-training that still holds a .grad keeps it across a cycle."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.cpu.test_fsdp2_gloo import build_uneven

    dev = torch.device(device)
    mesh = init_device_mesh(dev.type, (world,))
    ref, ref_opt = build_uneven(mesh, device)
    m, opt = build_uneven(mesh, device)
    ferry = Ferry(m, opt)

    def data(step):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step)).to(dev)

    for model, o in ((ref, ref_opt), (m, opt)):
        model(data(0)).square().mean().backward()
        o.step()
        o.zero_grad(set_to_none=False)  # grads kept (zeros)
        model[0].weight.requires_grad_(False)
    frozen = m[0].weight
    ferry.offload()
    assert frozen.grad is not None and frozen.grad.device.type == "cpu"
    ferry.reload()
    assert frozen.grad is not None and frozen.grad.device == frozen.device
    for step in (1, 2):
        for model, o in ((ref, ref_opt), (m, opt)):
            model(data(step)).square().mean().backward()
            o.step()  # AdamW still steps the frozen weight: its grad is there
        ferry.offload()
        ferry.reload()
    assert_same(snapshot(ref, ref_opt), snapshot(m, opt))
    ferry.close()


def test_ddp_trains_as_without_offload_gloo():
    run_spawned(check_ddp_trains_as_without_offload, world=2)


def test_tp_hooks_and_optimizer_in_backward_survive_cycles_gloo():
    run_spawned(check_tp_hooks_and_optimizer_in_backward, world=2)


def test_frozen_fsdp2_parameter_keeps_its_grad_gloo():
    run_spawned(check_frozen_parameter_keeps_its_grad, world=2)


def test_plain_parameter_hooks_grad_and_accumulate_grad_node_survive():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    calls = []
    m.weight.register_hook(lambda g: calls.append("tensor"))
    m.weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    node = m.weight.view_as(m.weight).grad_fn.next_functions[0][0]
    node.register_hook(lambda *a: calls.append("node"))
    m.bias.requires_grad_(False)
    m.bias.grad = torch.ones(3)  # a frozen parameter holding a grad
    ferry = Ferry(m)
    for _ in range(3):
        ferry.offload()
        assert m.bias.grad is not None and m.bias.grad.device.type == "cpu"
        ferry.reload()
        m(torch.ones(2, 4)).sum().backward()
    assert calls.count("tensor") == calls.count("post") == calls.count("node") == 3
    assert m.weight.view_as(m.weight).grad_fn.next_functions[0][0] is node
    assert torch.equal(m.bias.grad, torch.ones(3))


def test_live_graph_survives_a_cycle_before_backward():
    """A graph built before offload() runs backward after reload() into the same .grad."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    m = nn.Linear(4, 3)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4)
    ref(x).square().sum().backward()
    loss = m(x).square().sum()
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    loss.backward()
    assert torch.equal(ref.weight.grad, m.weight.grad) and torch.equal(ref.bias.grad, m.bias.grad)
