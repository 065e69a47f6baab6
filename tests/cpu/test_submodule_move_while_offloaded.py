"""[Note: FSDP2's shard buffer left by a submodule's move], when the move happens while OFFLOADED (or the
reload is layer-wise after it): the reload reconciles (the parameters were given other bytes) and brings back the
old storages FSDP2's buffers view; it then re-points those buffers, as verl's own load (``model.to(device)`` on the
root unit) would. Before, they stayed until the next plan: training between that reload and the next offload
all-gathered the bytes of the offload, and the second mini-batch after the reload differed from verl's run."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def _model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 11), nn.Sequential(nn.Linear(11, 5)), nn.Linear(5, 4))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def check_training_after_a_submodules_move_while_offloaded_is_exact(rank: int, world: int) -> None:
    import os

    from torch.distributed.device_mesh import init_device_mesh

    import torchferry
    from tests.helpers import assert_same, fsdp_params, snapshot, train_step

    prefetch = os.environ["TF_ADV_PREFETCH"] == "1"
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref_m, ref_opt = _model(mesh)
    m, opt = _model(mesh)
    ferry = torchferry.Ferry(m, opt)
    for cycle in range(3):
        for mb in range(2):  # the second mini-batch reads the weights the first one stepped
            a, b = (train_step(mm, o, x * (mb + 1), set_to_none=True) for mm, o in ((ref_m, ref_opt), (m, opt)))
            assert torch.equal(a, b), (rank, cycle, mb, a, b)
        for model in (ref_m, m):
            if model is m:
                ferry.offload().wait()
            model[1].double()  # below the root unit
            model[1].float()
        ref_m.to("cpu")  # verl's load: model.to(device) on the root unit re-points FSDP2's buffers
        ferry.reload(prefetch=prefetch)
        if not prefetch:
            for fp in fsdp_params(m):
                local = fp.sharded_param._local_tensor
                assert fp._sharded_param_data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(), (
                    rank, cycle, fp._param_fqn)
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


@pytest.mark.parametrize("prefetch", ["0", "1"], ids=["reload", "reload_prefetch"])
def test_training_after_a_submodules_move_while_offloaded_is_exact(prefetch, monkeypatch):
    from tests.spawn import run_spawned

    monkeypatch.setenv("TF_ADV_PREFETCH", prefetch)
    run_spawned(check_training_after_a_submodules_move_while_offloaded_is_exact, world=2, backend="gloo")
