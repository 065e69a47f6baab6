"""FSDP2 (fully_shard) over gloo with 2 spawned CPU processes.

Covers uneven shards (dim 0 not divisible by 2) and a zero-size local shard
(dim 0 == 1: rank 1 holds nothing), FSDP2's padded ``_sharded_param_data``
alias, identity of DTensor parameters, grads and optimizer state, release of
every storage while offloaded, and training after reload bit-identical to
training without offload; a frozen parameter keeps its ``.grad``;
inference-mode buffers and ``state_dict()`` right after ``reload(prefetch=True)``
(reported against commit df8fb81). The checks take a device, so the GPU tier runs
them over NCCL.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import (
    WithRotary,
    assert_same,
    build_uneven,
    fsdp_params,
    snapshot,
    train_step,
)
from tests.spawn import run_spawned
from torchferry import Ferry, Residency
from torchferry._core._state.host_blocks import in_host_pool


def check_fsdp2_cycles(rank: int, world: int, device: str = "cpu", expect_pinned: bool = False) -> None:
    """3 training steps with an offload/reload cycle after each, against a run without."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchferry
    from tests.helpers import assert_same, identities, snapshot

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    ref_m, ref_opt = build_uneven(mesh, device)
    m, opt = build_uneven(mesh, device)
    ferry = torchferry.Ferry(m, opt)
    shapes = [tuple(p._local_tensor.shape) for p in m.parameters()]
    if rank == 1:
        assert (0, 11) in shapes, shapes  # a zero-size local shard
    assert (6 if rank == 0 else 5, 16) in shapes, shapes  # uneven
    for step in range(3):
        ref_loss = train_step(ref_m, ref_opt, x)
        loss = train_step(m, opt, x)
        assert torch.equal(ref_loss, loss), (step, ref_loss, loss)
        before, ids = snapshot(m, opt), identities(m, opt)
        padded = [fp._sharded_param_data.untyped_storage() for fp in fsdp_params(m)]
        ferry.offload().wait()
        for p in m.parameters():
            assert p.device.type == "cpu" and type(p).__name__ == "DTensor" and isinstance(p, nn.Parameter)
            if expect_pinned and p._local_tensor.numel():
                assert p._local_tensor.is_pinned(), tuple(p._local_tensor.shape)
        assert all(s.nbytes() == 0 for s in padded), "FSDP2 padded shard not released"
        assert_same(before, snapshot(m, opt))
        ferry.reload().wait()
        assert identities(m, opt) == ids
        assert_same(before, snapshot(m, opt))
        for fp in fsdp_params(m):  # FSDP2's own alias is consistent again
            assert (
                fp._sharded_param_data.untyped_storage()._cdata
                == fp.sharded_param._local_tensor.untyped_storage()._cdata
            )
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


def test_fsdp2_two_ranks_gloo():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(check_fsdp2_cycles, world=2, backend="gloo")


def check_frozen_parameter_keeps_its_grad(rank: int, world: int, device: str = "cpu") -> None:
    """FSDP2: a parameter frozen mid-training that still holds a .grad keeps it across a cycle."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import build_uneven

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


def test_frozen_fsdp2_parameter_keeps_its_grad_gloo():
    run_spawned(check_frozen_parameter_keeps_its_grad, world=2)


def check_fsdp2_inference_buffers_and_state_dict_after_prefetch(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import build_uneven, train_step

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


def check_local_shard_given_other_bytes_while_offloaded(rank, world):
    """``p._local_tensor.data = t`` while offloaded (before, a segfault: FSDP2's all-gather
    read its padded shard, whose storage the reload had left empty). Afterwards FSDP2 gathers what
    the parameter holds, as after a framework's own load (``model.to(device)`` on the root unit, which
    re-points FSDP2's buffers: [Note: FSDP2's shard buffer left by a submodule's move]): the forward
    matches a run without a ferry whose root was moved so."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def run(ferried: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 11), nn.Linear(11, 4))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        x = torch.randn(8, 16)
        m(x).sum().backward()
        ferry = Ferry(m) if ferried else None
        if ferry:
            ferry.offload()
        local = m[0].weight._local_tensor
        local.data = torch.full_like(local, 0.5)
        if ferry:
            ferry.reload()
        else:
            m.to("cpu")  # a framework's load: FSDP2 re-points its buffers
            torch.testing.assert_close(local, torch.full_like(local, 0.5), atol=0, rtol=0)
        out = m(x).detach()
        if ferry:
            ferry.offload()
            ferry.reload()
        return out

    torch.testing.assert_close(run(True), run(False), atol=0, rtol=0)


def test_local_shard_given_other_bytes_while_offloaded_gloo():
    run_spawned(check_local_shard_given_other_bytes_while_offloaded, world=2)


def _parameter_replaced_while_offloaded(rank: int, world: int, prefetch: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        for unit in (m[0], m[1], m):
            fully_shard(unit)
        m(torch.ones(2, 8))  # FSDP2's lazy init
        return m

    twin, m = model(), model()
    ferry = Ferry(m, device="cpu")
    ferry.offload()
    for mod in (twin, m):  # a new Parameter where FSDP2's own stays registered
        old = mod[0].weight
        mod[0].weight = nn.Parameter(distribute_tensor(torch.ones(8, 8), old.device_mesh, old.placements))
    ferry.reload(prefetch=prefetch)
    x = torch.arange(16.0).reshape(2, 8)
    torch.testing.assert_close(m(x), twin(x), atol=0, rtol=0)  # FSDP2 gathers its own parameter, as in the twin
    assert ferry.residency is Residency.DEVICE
    ferry.offload()
    ferry.reload()
    torch.testing.assert_close(m(x), twin(x), atol=0, rtol=0)


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_fsdp2_parameter_replaced_while_offloaded_leaves_fsdp2s_own_whole(prefetch):
    """``module.weight = nn.Parameter(...)`` while offloaded: FSDP2 keeps all-gathering the parameter its
    ``FSDPParam`` holds, which the reload had left released (no longer held by the module): the next forward
    crashed the process. Every parameter an FSDP2 unit holds comes back now, as in a run without the ferry."""
    import functools

    run_spawned(functools.partial(_parameter_replaced_while_offloaded, prefetch=prefetch), world=1)
