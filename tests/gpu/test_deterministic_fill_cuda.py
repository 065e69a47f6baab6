"""Reloads stay exact under ``torch.use_deterministic_algorithms(True)`` (verl's ``full_determinism``), where a
``torch.empty`` queues a fill of its memory on the current stream: with the current stream held up, anything
queued there while a reload allocates must run before the reload's copies, never after them
([Note: no arena under a layer-wise reload] in ``src/torchferry/_core/_transfer/arena.py``)."""

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned

pytestmark = pytest.mark.gpu


def _case(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchferry import Ferry, Prefetch

    torch.use_deterministic_algorithms(True, warn_only=True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]).cuda()
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(32, 2048, device="cuda")
    m(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    want = {k: v.detach().clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
    want_w = m[0].weight.full_tensor().clone()
    for prefetch in (False, Prefetch()):
        for _ in range(3):
            ferry = Ferry(m, opt)
            ferry.offload()
            torch.cuda.empty_cache()  # the reload's blocks come from new segments, as after verl's helpers
            torch.cuda._sleep(200_000_000)  # the current stream held up (~0.1 s) while the reload allocates
            ferry.reload(prefetch=prefetch)
            if prefetch is not False:
                assert ferry._prefetch is not None  # the layer-wise path is the one under test
                with torch.no_grad():
                    m(x)  # the units come back in the forward; state_dict() below completes the rest
            torch.cuda.synchronize()
            got = {k: v for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
            assert all(torch.equal(got[k], want[k]) for k in want), prefetch
            assert torch.equal(m[0].weight.full_tensor(), want_w), prefetch
            ferry.close()


def test_reloads_exact_under_deterministic_fill():
    run_spawned(_case, world=1, backend="nccl")
