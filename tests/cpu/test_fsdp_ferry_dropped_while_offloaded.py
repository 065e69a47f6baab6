"""[Note: a ferry dropped while offloaded] (``_core/_ferry/guards.py``) for FSDP models: the state stays on the host,
"the module then runs on the host, or ``model.to(device)`` brings it back by ordinary copies". Two gloo ranks;
FSDP1 with and without ``use_orig_params`` and FSDP2. On the CPU the device is the host, so ``model.to("cpu")``
stands in for ``model.to(device)``."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        m = nn.Sequential(nn.Linear(16, 11), nn.Linear(11, 5), nn.Linear(5, 4))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        orig = kind == "fsdp1_orig"
        body = nn.Sequential(nn.Linear(16, 11), nn.Sequential(nn.Linear(11, 5)))
        body[0] = FSDP(body[0], device_id=torch.device("cpu"), use_orig_params=orig)
        m = FSDP(nn.Sequential(body, nn.Linear(5, 4)), device_id=torch.device("cpu"), use_orig_params=orig)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def check_dropped_while_offloaded(rank, world, kind, then):
    import torchferry
    from tests.helpers import train_step

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = _model(kind)
    m, opt = _model(kind)
    for mm, o in ((ref, ref_opt), (m, opt)):
        train_step(mm, o, x, set_to_none=True)
    ferry = torchferry.Ferry(m, opt)
    ferry.offload().wait()
    del ferry
    gc.collect()
    if then == "to":
        for mm in (ref, m):
            mm.to("cpu")  # model.to(device); on the reference too (FSDP1's _apply re-registers its views)
    if then in ("to", "forward"):
        for step in range(2):
            a, b = (train_step(mm, o, x * (step + 2), set_to_none=True) for mm, o in ((ref, ref_opt), (m, opt)))
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    sd = m.state_dict()
    want = ref.state_dict()
    assert sd.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(sd[k], want[k], atol=0, rtol=0)
    m.load_state_dict(sd)


@pytest.mark.parametrize("then", ["to", "forward", "state_dict"])
@pytest.mark.parametrize("kind", ["fsdp1_orig", "fsdp1_flat", "fsdp2"])
def test_an_fsdp_model_whose_ferry_was_dropped_while_offloaded_runs_and_moves(kind, then):
    run_spawned(functools.partial(check_dropped_while_offloaded, kind=kind, then=then), world=2, backend="gloo",
                timeout_s=120)


def check_an_fsdp1_apply_while_offloaded_is_refused(rank, world, kind):
    """FSDP1's ``apply(fn)`` unshards first: while offloaded it read the released storages (``setStorage ... out of
    bounds for storage of size 0``) and, with ``use_orig_params=False``, left FSDP1 so that every later
    ``state_dict()`` failed. Refused in one line; after ``reload()`` ``apply``, ``state_dict()`` and training work."""
    import torchferry
    from tests.helpers import train_step

    m, opt = _model(kind)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    train_step(m, opt, x, set_to_none=True)
    ferry = torchferry.Ferry(m, opt)
    ferry.offload().wait()
    with pytest.raises(RuntimeError, match=r"^torchferry: apply\(fn\) of the FSDP1 unit .*while its state is "):
        m.apply(lambda mod: None)
    ferry.reload().wait()
    assert all("apply" not in u.__dict__ for u in m.modules())
    m.apply(lambda mod: None)
    m.state_dict()
    train_step(m, opt, x, set_to_none=True)


@pytest.mark.parametrize("kind", ["fsdp1_orig", "fsdp1_flat"])
def test_an_fsdp1_apply_while_offloaded_is_refused_and_fsdp1_stays_usable(kind):
    run_spawned(functools.partial(check_an_fsdp1_apply_while_offloaded_is_refused, kind=kind), world=2,
                backend="gloo", timeout_s=120)
