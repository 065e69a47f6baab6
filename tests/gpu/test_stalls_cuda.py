"""[Note: stalls recorded] on a GPU: a forward right behind a layer-wise reload waits for its units' copies
and the wait is timed; one after a reload that completed waits for nothing."""

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned

pytestmark = pytest.mark.gpu


def _case(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchferry import Ferry, Prefetch
    from torchferry._core._transfer.streams import record_stalls

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda()  # 512 MiB of fp32 weights
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    x = torch.randn(64, 4096, device="cuda")
    with torch.no_grad():
        want = m(x)
        ferry = Ferry(m)
        ferry.offload()
        ferry.reload(prefetch=Prefetch())
        with record_stalls() as behind:
            got = m(x)
        assert torch.equal(got, want)
        assert behind.count >= 1 and behind.seconds() > 0.001, (behind.count, behind.seconds())  # ~10 ms of copies
        ferry.offload()
        ferry.reload().wait()
        torch.cuda.synchronize()
        with record_stalls() as after:
            m(x)
        assert after.seconds() < 0.001, after.seconds()
    ferry.close()


def test_a_forward_behind_a_layerwise_reload_records_its_wait():
    run_spawned(_case, world=1, backend="nccl")
