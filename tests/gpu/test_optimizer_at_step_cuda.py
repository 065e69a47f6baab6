"""GPU tier of [Note: optimizer state waited for at step()] (``docs/integrations.md``):
the verl/SkyRL helpers with ``optimizer_at_step`` on, on CUDA: the state stays in flight through
the forward and backward, comes back at ``optimizer.step()``, and three offload/reload steps are
bit-identical to the same steps never offloaded."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same_training, mlp_and_reference, train_step
from torchferry import Residency
from torchferry.integrations import _base as _helpers

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_the_optimizer_state_comes_back_at_step_bit_identical(monkeypatch):
    m, opt, ref_m, ref_opt, xs = mlp_and_reference("cuda")
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1")
    try:
        for x in xs:
            _helpers.offload_fsdp2_model_to_cpu(m)
            _helpers.offload_fsdp_optimizer(opt)
            _helpers.load_fsdp2_model_to_gpu(m)
            _helpers.load_fsdp_optimizer(opt, torch.cuda.current_device())
            ferry = _helpers.ferry_for(opt)
            assert ferry is not None and ferry.residency is Residency.PREFETCHING
            m(x).square().mean().backward()
            assert ferry.residency is Residency.PREFETCHING  # the forward and backward did not wait for it
            opt.step()
            opt.zero_grad(set_to_none=True)
            # the step waited for the copies on the GPU, not on the host: they may still be in flight
            assert ferry.residency in (Residency.DEVICE, Residency.H2D_IN_FLIGHT), ferry.residency
            torch.cuda.synchronize()
            assert ferry.residency is Residency.DEVICE
            assert all(t.is_cuda for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim())
            train_step(ref_m, ref_opt, x, set_to_none=True)
        torch.cuda.synchronize()
        assert_same_training(m, opt, ref_m, ref_opt)
    finally:
        for f in (_helpers.ferry_for(m), _helpers.ferry_for(opt)):
            if f is not None:
                f.close()
