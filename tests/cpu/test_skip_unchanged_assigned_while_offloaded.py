"""A tensor given other bytes while offloaded (``p.data = t``, a submodule's ``.to()``) is reconciled at the
reload; with ``skip_unchanged=True`` the plan's host twin then held the assigned bytes and was retired with
the plan ([Note: host tensors of earlier plans]), a holder the ferry does not know: every later offload kept
that storage allocated ("offload keeps N bytes ... shared with a tensor torchferry does not manage")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchferry


@pytest.mark.parametrize("skip_unchanged", [False, True])
def test_a_storage_assigned_while_offloaded_is_released_by_every_later_offload(skip_unchanged):
    torch.manual_seed(0)
    m = nn.Linear(64, 64)
    ferry = torchferry.Ferry(m, skip_unchanged=skip_unchanged)
    ferry.offload().wait()
    with torch.no_grad():
        m.weight.data = m.weight.data.clone()  # [Note: storage swapped while offloaded]
    ferry.reload().wait()
    for cycle in range(3):
        st = m.weight.untyped_storage()
        ferry.offload().wait()
        assert st.nbytes() == 0, (cycle, st.nbytes())
        ferry.reload().wait()


def check_a_submodules_move_while_offloaded_leaves_nothing_behind(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import fsdp_params

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 11), nn.Sequential(nn.Linear(11, 5)), nn.Linear(5, 4))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(8, 16)).sum().backward()
    opt.step()
    ferry = torchferry.Ferry(m, opt, skip_unchanged=True)
    ferry.offload().wait()
    m[1].double()  # below the root unit, while offloaded
    m[1].float()
    ferry.reload().wait()
    for cycle in range(3):
        ferry.offload().wait()
        left = [(fp._param_fqn, fp._sharded_param_data.untyped_storage().nbytes()) for fp in fsdp_params(m)
                if fp._sharded_param_data.untyped_storage().nbytes()]
        assert not left, (rank, cycle, left)
        ferry.reload().wait()


def test_a_submodules_move_while_offloaded_leaves_nothing_behind_with_skip_unchanged():
    from tests.spawn import run_spawned

    run_spawned(check_a_submodules_move_while_offloaded_leaves_nothing_behind, world=2, backend="gloo")
