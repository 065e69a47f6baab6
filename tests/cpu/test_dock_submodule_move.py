"""A set a ``Dock`` keeps resident while a submodule below an FSDP2 unit is moved (verl's LoRA weight sync
moves ``peft_model.base_model.model`` to the host and back: ``collect_lora_params``): the unit's shard
buffers are left over the old storages, and the framework's own offload, which the dock stands in for,
is what re-pointed them ([Note: FSDP2's shard buffer left by a submodule's move] in
``src/torchferry/_core/_state/fsdp.py``). The dock re-points them and plans the set again at its next
decision (``replan_if_moved`` in ``_core/_dock/measure.py``): training stays bit-identical to the
framework's run, and the old storages are neither held nor counted.

FSDP2 over gloo with 2 spawned CPU processes (uneven shards); the GPU tier runs the check on one GPU over NCCL
(``tests/gpu/test_dock_submodule_move_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_spawned


def _storages_bytes(m) -> int:
    from tests.helpers import fsdp_params

    seen = {}
    for fp in fsdp_params(m):
        for t in (fp.sharded_param._local_tensor, fp._sharded_param_data):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def check_a_docked_sets_submodule_move(rank: int, world: int, device: str = "cpu") -> None:
    """Per place of the move (inside the set's ``use()``, or while it is idle and resident): 4 steps against
    the framework's run (its offload after each step: ``model.cpu()`` on the root unit), exactly; after
    each decision no buffer views an old storage and the dock counts the state once."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchferry
    from tests.helpers import fsdp_params

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)

    def move(m) -> None:  # new tensors for the root unit's parameters (m[1] is no unit of its own)
        m[1].to(torch.float64)
        m[1].to(torch.float32)

    for where in ("in use", "idle"):
        runs = []
        for docked in (False, True):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(16, 11), nn.Sequential(nn.Linear(11, 5)), nn.Linear(5, 4)).to(device)
            fully_shard(m[0], mesh=mesh)
            fully_shard(m, mesh=mesh)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            dock = torchferry.Dock(1 << 30, device=device) if docked else None
            if dock is not None:
                dock.add("actor", torchferry.Ferry(m, skip_unchanged=True))  # roomy: never evicted
            losses = []
            for step in range(4):
                if dock is not None:
                    dock.acquire("actor")
                loss = m(x * (step + 1)).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                if where == "in use":
                    move(m)
                if dock is None:  # the framework's offload and load: the root unit's _apply (FSDP2's repair)
                    m.cpu()
                    m.to(device)
                else:
                    dock.release("actor")
                if where == "idle":
                    move(m)
                    if dock is not None:
                        dock.acquire("actor")  # the next phase's decision
                        dock.release("actor")
                if dock is not None:
                    stale = [tuple(fp._sharded_param_data.shape) for fp in fsdp_params(m)
                             if fp._sharded_param_data.untyped_storage().data_ptr()
                             != fp.sharded_param._local_tensor.untyped_storage().data_ptr()]
                    assert not stale, (where, step, stale)
                    assert dock.nbytes("actor") == _storages_bytes(m), (where, step, dock.nbytes("actor"))
                    assert dock.ferry("actor").residency is torchferry.Residency.DEVICE
            runs.append((torch.stack(losses), [p.full_tensor() for p in m.parameters()]))
        torch.testing.assert_close(runs[1][0], runs[0][0], atol=0, rtol=0)
        for a, b in zip(runs[1][1], runs[0][1], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_docked_sets_submodule_move_keeps_training_exact_two_ranks_gloo():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(check_a_docked_sets_submodule_move, world=2, backend="gloo")
