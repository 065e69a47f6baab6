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

# (where the state is when module.to() runs, which module, what .to() is given)
CASES = [
    ("offloaded", "root", "cpu"),
    ("offloaded", "unit", "cpu"),
    ("prefetching", "root", "cpu"),
    ("prefetching", "unit", "cpu"),
    ("prefetching", "unit", "float32"),
]


def check_module_to_while_off_device(rank: int, world: int, device: str = "cpu") -> None:
    """Per case: 3 cycles of (reload, 2 optimizer steps, offload, reload, ``.to()``, offload)
    against the same training without a ferry, exactly; FSDP2's buffers view the local shards'
    storages after every reload."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchferry
    from tests.helpers import assert_same, snapshot

    mesh = init_device_mesh(device.split(":")[0], (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to(device)
    for where, which, arg in CASES:
        ref_m, ref_opt = build_uneven(mesh, device)
        m, opt = build_uneven(mesh, device)
        ferry = torchferry.Ferry(m, skip_unchanged=True)
        target = m if which == "root" else m[0]
        to_arg = torch.float32 if arg == "float32" else arg
        for cycle in range(3):
            for mb in range(2):  # two optimizer steps per reload: the second forward reads the stepped weights
                losses = []
                for model, o in ((ref_m, ref_opt), (m, opt)):
                    loss = model(x * (mb + 1)).square().mean()
                    loss.backward()
                    o.step()
                    o.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
                assert torch.equal(*losses), (where, which, arg, cycle, mb, losses)
            ferry.offload().wait()
            if where == "offloaded":
                target.to(to_arg)
                ferry.reload().wait()
            else:
                ferry.reload(prefetch=True)
                assert ferry.residency is torchferry.Residency.PREFETCHING, (where, ferry.residency)
                target.to(to_arg)
                ferry.offload().wait()  # verl's weight sync offloads again without a forward
                ferry.reload(prefetch=True)
            if where == "offloaded" or cycle == 2:
                ferry.reload().wait()
            if where == "prefetching" and cycle < 2:
                continue  # the next forward makes the units resident (checked by the losses)
            for fp in fsdp_params(m):
                local = fp.sharded_param._local_tensor
                assert fp._sharded_param_data.untyped_storage().data_ptr() == local.untyped_storage().data_ptr(), (
                    where, which, arg, cycle, tuple(local.shape), tuple(fp._sharded_param_data.shape), local.device,
                    fp._sharded_param_data.device)
                assert local.device.type == torch.device(device).type
        assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))
        del ferry


def test_module_to_while_offloaded_or_prefetching_keeps_training_exact():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    run_spawned(check_module_to_while_off_device, world=2, backend="gloo")
