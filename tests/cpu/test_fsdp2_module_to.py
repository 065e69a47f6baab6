"""[Note: FSDP2's shard buffer after a move]: ``module.to(...)`` (``nn.Module._apply``) on a
``fully_shard``-ed module while its state is offloaded, or reloading layer-wise, re-points FSDP2's
``_sharded_param_data`` at host views (and, for an uneven shard, replaces the local shard with a
padded host copy). Training after the reload must still be bit-identical to training without
offload: every reload re-points the buffers at the device storages.

FSDP2 over gloo with 2 spawned CPU processes (uneven shards, a zero-size shard); the checks take a
device, so the GPU tier runs them over NCCL. Found through verl 0.9.1's LoRA actor, whose weight
sync calls ``model.to("cpu")`` right after ``load_fsdp_model_to_gpu`` (``collect_lora_params``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build_uneven, fsdp_params
from tests.spawn import run_spawned

def _write(m) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)


def _unit_load(m) -> None:
    m[0].load_state_dict({k: v.detach() * 0.5 for k, v in m[0].state_dict().items()})


# What is done to the model while its state is off the device, and to the reference (where the
# model's tensors are now: the host for the ferried one, the device for the reference; a move to
# where they are moves nothing, as verl's LoRA weight sync does).
ACTIONS = {
    "root.to(here)": lambda m, here: m.to(here),
    "unit.to(here)": lambda m, here: m[0].to(here),
    "unit.to(float32)": lambda m, here: m[0].to(torch.float32),
    "root.to(here), then in-place writes": lambda m, here: (m.to(here), _write(m)),  # FSDP2 re-pads uneven shards
    "half().float()": lambda m, here: m.half().float(),  # new tensors over rounded bytes
    "root.to(here), then the unit's load_state_dict": lambda m, here: (m.to(here), _unit_load(m)),
}
CASES = [(where, action) for where in ("offloaded", "prefetching") for action in ACTIONS]


def check_module_to_while_off_device(rank: int, world: int, device: str = "cpu") -> None:
    """Per case: 3 cycles of (reload, 2 optimizer steps, offload, reload, ``.to()``, offload)
    against the same training without a ferry, exactly; FSDP2's buffers view the local shards'
    storages after every reload."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchferry
    from tests.helpers import assert_same, snapshot

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    for where, action in CASES:
        ref_m, ref_opt = build_uneven(mesh, device)
        m, opt = build_uneven(mesh, device)
        ferry = torchferry.Ferry(m, skip_unchanged=True)
        act = ACTIONS[action]
        for cycle in range(3):
            for mb in range(2):  # two optimizer steps per reload: the second forward reads the stepped weights
                losses = []
                for model, o in ((ref_m, ref_opt), (m, opt)):
                    loss = model(x * (mb + 1)).square().mean()
                    loss.backward()
                    o.step()
                    o.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
                assert torch.equal(*losses), (where, action, cycle, mb, losses)
            ferry.offload().wait()
            act(ref_m, device)
            if where == "offloaded":
                act(m, "cpu")
                ferry.reload().wait()
            else:
                ferry.reload(prefetch=True)
                assert ferry.residency is torchferry.Residency.PREFETCHING, (where, ferry.residency)
                act(m, "cpu")
                ferry.offload().wait()  # verl's weight sync offloads again without a forward
                ferry.reload(prefetch=True)
            if where == "offloaded" or cycle == 2:
                ferry.reload().wait()
            if where == "prefetching" and cycle < 2:
                continue  # the next forward makes the units resident (checked by the losses)
            for fp in fsdp_params(m):
                local = fp.sharded_param._local_tensor
                assert fp._sharded_param_data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(), (
                    where, action, cycle, tuple(local.shape), tuple(fp._sharded_param_data.shape))
                assert local.device.type == torch.device(device).type
        assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))
        del ferry


def check_write_after_module_to_while_prefetching(rank: int, world: int, device: str = "cpu") -> None:
    """FSDP2's ``module.to()`` gives each unit a new local shard object over the same pool bytes
    (its version counter back at 0): a write after it must still be seen as one, the forward must
    use it ([Note: storage swapped while prefetching])."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchferry

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    outs = []
    for ferried in (False, True):
        m, opt = build_uneven(mesh, device)
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ferry = torchferry.Ferry(m) if ferried else None
        if ferry is not None:
            ferry.offload().wait()
            ferry.reload(prefetch=True)
        m.to("cpu" if ferried else device)
        _write(m)
        out = m(x).detach()
        outs.append((out, [p.full_tensor() for p in m.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=0, rtol=0)
    for a, b in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def check_load_state_dict_of_a_root_unit_while_prefetching(rank: int, world: int, device: str = "cpu") -> None:
    """A root that holds parameters of its own is a unit and the ferry's target: its
    ``load_state_dict`` during a layer-wise reload completes the reload once (one hook per
    module: the first removed the others while torch iterated them, "OrderedDict mutated during
    iteration") and loads what a run without a ferry loads."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchferry

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    outs = []
    for ferried in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 11), nn.ReLU(), nn.Linear(11, 3)).to(device)
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)  # the root keeps m[2]'s parameters
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)
        sd = {k: v.detach() * 0.5 for k, v in m.state_dict().items()}
        ferry = torchferry.Ferry(m) if ferried else None
        if ferry is not None:
            ferry.offload().wait()
            ferry.reload(prefetch=True)
            assert ferry.residency is torchferry.Residency.PREFETCHING
        m.load_state_dict(sd)
        if ferry is not None:
            assert ferry.residency in (torchferry.Residency.DEVICE, torchferry.Residency.H2D_IN_FLIGHT)
        outs.append(m(x).detach())
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


def check_a_submodules_move_while_resident_leaves_nothing_behind(rank: int, world: int, device: str = "cpu") -> None:
    """[Note: FSDP2's shard buffer left by a submodule's move]: ``.to()`` of a submodule that is not a unit of
    its own (verl's LoRA weight sync moves ``peft_model.base_model.model`` to the host and back, below the
    root unit) replaces the root unit's parameters but leaves FSDP2's buffers over the old storages. The
    offload releases every storage all the same (the old ones are FSDP2's no more) and training goes on
    from the parameters, as after verl's own offload (``model.cpu()`` on the root, FSDP2's repair)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchferry
    from tests.helpers import fsdp_params

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    runs = []
    for ferried in (False, True):
        torch.manual_seed(0)
        # m[1] holds the root unit's parameters (5 rows: uneven over 2 ranks); m[0] is a unit of its own
        m = nn.Sequential(nn.Linear(16, 11), nn.Sequential(nn.Linear(11, 5)), nn.Linear(5, 4)).to(device)
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        ferry = torchferry.Ferry(m, skip_unchanged=True) if ferried else None
        losses = []
        for cycle in range(3):
            loss = m(x * (cycle + 1)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            m[1].to(torch.float64)  # new tensors: the root unit's buffers stay over the old storages
            m[1].to(torch.float32)
            if ferry is None:
                m.to(device)  # verl's offload: model.cpu() on the root unit (FSDP2 re-points its buffers)
                continue
            ferry.offload().wait()
            for fp in fsdp_params(m):  # nothing left on the device: no buffer over an old storage
                data = fp._sharded_param_data
                assert data.untyped_storage().nbytes() == 0, (cycle, tuple(data.shape))
            ferry.reload().wait()
            for fp in fsdp_params(m):
                local = fp.sharded_param._local_tensor
                assert fp._sharded_param_data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        runs.append((torch.stack(losses), [p.full_tensor() for p in m.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], atol=0, rtol=0)
    for a, b in zip(runs[1][1], runs[0][1], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("check", [check_module_to_while_off_device, check_write_after_module_to_while_prefetching,
                                   check_load_state_dict_of_a_root_unit_while_prefetching,
                                   check_a_submodules_move_while_resident_leaves_nothing_behind],
                         ids=["module_to_keeps_training_exact", "write_after_module_to_is_not_lost",
                              "root_unit_load_state_dict", "submodule_move_leaves_nothing_behind"])
def test_fsdp2_off_the_device_two_ranks_gloo(check):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(check, world=2, backend="gloo")
