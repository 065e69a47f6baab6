"""Prefetch reload on GPUs: training bit-identical to training without overlap, with slow
compute and fast copies and with fast compute and slow copies (NCCL, 1 and 2 GPUs)."""

import functools

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned

pytestmark = pytest.mark.gpu


def _build(mesh, width: int, layers: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width + (i % 3)) if i % 2 == 0 else nn.Linear(width + ((i - 1) % 3), width)
                        for i in range(layers)]).cuda()
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _overlap_case(rank: int, world: int, slow_compute: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import assert_same, snapshot, train_step
    from torchferry import Ferry, Prefetch, Residency

    mesh = init_device_mesh("cuda", (world,))
    width, layers = (1024, 8) if slow_compute else (4096, 8)  # small state, or 8 x 64 MB
    x = torch.randn(16, width, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    ref_m, ref_opt = _build(mesh, width, layers)
    m, opt = _build(mesh, width, layers)
    if slow_compute:
        for layer in m:  # slow compute: later units' copies finish while this one computes
            layer.register_forward_pre_hook(lambda mod, args: torch.cuda._sleep(20_000_000))
    ferry = Ferry(m, opt)
    for step in range(4):
        want = train_step(ref_m, ref_opt, x, set_to_none=True)
        if step:
            ferry.offload()
            torch.cuda.empty_cache()
            ferry.reload(prefetch=Prefetch(lookahead_bytes=None if step % 2 else 1 << 20))
            assert ferry.residency is Residency.PREFETCHING
        got = train_step(m, opt, x, set_to_none=True)
        assert torch.equal(want, got), (step, want, got)
    torch.cuda.synchronize()
    assert_same(snapshot(ref_m, ref_opt), snapshot(m, opt))


@pytest.mark.parametrize("slow_compute", [True, False])
def test_prefetch_bit_identical_one_gpu(slow_compute):
    run_spawned(functools.partial(_overlap_case, slow_compute=slow_compute), world=1, backend="nccl")


@pytest.mark.multigpu
@pytest.mark.parametrize("slow_compute", [True, False])
def test_prefetch_bit_identical_two_gpus(slow_compute):
    run_spawned(functools.partial(_overlap_case, slow_compute=slow_compute), world=2, backend="nccl")
