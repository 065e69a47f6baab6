"""GPU tier of [Note: a handle orders the whole transfer] (``torchferry._core._api.handle``) and
[Note: the step waits on its own stream] (``torchferry._core._schedules.prefetch``): writers on a
side stream, ordered the documented way, are never lost and never read state still in flight.

Reproduce the report against 0e8596e (one H200): a ``.data`` write on a side stream after
``h = ferry.reload(); h.wait_stream(side)`` with ``skip_unchanged=True`` was lost in 19 of 20
trials (the baseline hash, queued after the copies, read the new bytes); ``optimizer.step()`` on a
side stream while the state was still loading gave 12 wrong state tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same_training, mlp_and_reference, train_step
from torchferry import Ferry

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_a_data_write_ordered_after_the_reload_handle_is_never_lost():
    # 16 storages of 64 MiB: the baseline hash reads the last one well after the copies are done,
    # while the side stream's write of it takes microseconds.
    ts = [torch.randn(16 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) for i in range(16)]
    ferry = Ferry(*ts, skip_unchanged=True)
    side = torch.cuda.Stream()
    for trial in range(10):
        ferry.offload()
        h = ferry.reload()
        h.wait_stream(side)  # the documented ordering for a writer on another stream
        with torch.cuda.stream(side):
            ts[-1].data.fill_(float(trial))  # through .data: no version counter sees it, only the hash
        torch.cuda.current_stream().wait_stream(side)
        want = [t.clone() for t in ts]
        ferry.offload()  # must find the last storage changed and copy it
        ferry.reload()
        torch.cuda.synchronize()
        for t, w in zip(ts, want, strict=True):
            torch.testing.assert_close(t, w, atol=0, rtol=0)
        assert bool((ts[-1] == trial).all()), f"trial {trial}: the write was lost"
    ferry.close()


@pytest.mark.parametrize("completed_by", ["the step itself", "another optimizer's step"])
def test_a_step_on_a_side_stream_waits_for_optimizer_state_loading_behind_it(completed_by):
    m, opt, ref_m, ref_opt, xs = mlp_and_reference("cuda")
    other = torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1)  # no grads: no update
    torch.cuda.synchronize()
    ferry = Ferry(opt)  # the optimizer state alone: a layer-wise reload leaves it to the step
    side = torch.cuda.Stream()
    for x in xs:
        ferry.offload()
        side.wait_stream(torch.cuda.current_stream())  # side after everything before the reload, not its copies
        torch.cuda._sleep(100_000_000)  # the H2D copies start only after this (the reload waits for this stream)
        ferry.reload(prefetch=True)
        if completed_by == "another optimizer's step":
            other.step()  # completes every layer-wise reload, with this stream waiting for it
        with torch.cuda.stream(side):  # forward, backward and step on the side stream
            train_step(m, opt, x, set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        train_step(ref_m, ref_opt, x, set_to_none=True)
        torch.cuda.synchronize()
    assert_same_training(m, opt, ref_m, ref_opt)
    ferry.close()
