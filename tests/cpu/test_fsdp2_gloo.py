"""FSDP2 (fully_shard) over gloo with 2 spawned CPU processes.

Covers uneven shards (dim 0 not divisible by 2) and a zero-size local shard
(dim 0 == 1: rank 1 holds nothing), FSDP2's padded ``_sharded_param_data``
alias, identity of DTensor parameters, grads and optimizer state, release of
every storage while offloaded, and training after reload bit-identical to
training without offload.
"""

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned


def build_uneven(mesh, device="cpu"):
    """Linear(16, 11): uneven over 2 ranks; Linear(11, 1): rank 1's shard is empty."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 11), nn.ReLU(), nn.Linear(11, 1), nn.Linear(1, 5)).to(device)
    for layer in (m[0], m[2], m[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def fsdp_params(m):
    from torchferry._fsdp import fsdp_modules

    out = []
    for unit in fsdp_modules(m):
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
        if groups is None:  # torch 2.11: one group per state
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            out += group.fsdp_params
    return out


def train_step(m, opt, x, set_to_none=False):
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss.detach()


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
