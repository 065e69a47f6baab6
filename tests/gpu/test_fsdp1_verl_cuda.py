"""FSDP1 models through verl's patched helpers on a GPU ([Note: FSDP1 models through torchferry] in
``docs/integrations.md``): bit-exact against the same training without offload,
pinned, identities kept; skipped where verl does not import (the GPU image has no verl: bring its
wheels as ``benchmarks/verl_actor.sh`` says)."""

import functools

import pytest
import torch
from torch import nn

from tests.spawn import run_spawned

pytestmark = pytest.mark.gpu
pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")


def _case(rank, world, orig):
    import verl.utils.fsdp_utils as fsdp_utils
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import torchferry.integrations.verl as tf_verl
    from tests.helpers import identities, snapshot, train_step

    def build():
        torch.manual_seed(0)
        m = FSDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda(), use_orig_params=orig)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    tf_verl.patch(fsdp1=True, import_engines=False)
    m, opt = build()
    ref, ref_opt = build()
    x = torch.randn(8, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    for _ in range(3):
        train_step(m, opt, x, set_to_none=True)
        train_step(ref, ref_opt, x, set_to_none=True)
        ids = identities(m, opt)
        fsdp_utils.offload_fsdp_model_to_cpu(m)
        fsdp_utils.offload_fsdp_optimizer(opt)
        ferry = tf_verl.ferry_for(m)
        assert ferry is not None and ferry.pinned and all(p.device.type == "cpu" for p in m.parameters())
        fsdp_utils.load_fsdp_model_to_gpu(m)
        fsdp_utils.load_fsdp_optimizer(opt, torch.cuda.current_device())
        assert identities(m, opt) == ids
    # One more step: under patch()'s defaults the optimizer state comes back at optimizer.step()
    # ([Note: verl's defaults]), which must then read exactly what was offloaded.
    train_step(m, opt, x, set_to_none=True)
    train_step(ref, ref_opt, x, set_to_none=True)
    torch.cuda.synchronize()
    a, b = snapshot(ref, ref_opt), snapshot(m, opt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tf_verl.unpatch()


@pytest.mark.parametrize("orig", [False, True], ids=["flat_params", "use_orig_params"])
def test_fsdp1_through_verls_helpers_bit_exact_one_gpu(orig):
    run_spawned(functools.partial(_case, orig=orig), world=1, backend="nccl")
