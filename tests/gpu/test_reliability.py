"""GPU reliability: a real out-of-memory during reload, and a 1,000-cycle soak."""

import gc
import json
import os

import pytest
import torch
from torch import nn

from tests.helpers import rss_bytes
from torchferry import Ferry, Residency

pytestmark = pytest.mark.gpu



def test_real_out_of_memory_during_reload_keeps_state_and_retry_succeeds():
    torch.cuda.empty_cache()
    x = torch.randn(256 << 20, device="cuda")  # 1 GiB
    want = x.cpu()
    ferry = Ferry(x)
    ferry.offload().wait()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # leave 256 MiB
    with pytest.raises(RuntimeError, match=r"reload needs \d+ bytes .*ran out of device memory"):
        ferry.reload()
    assert ferry.residency is Residency.HOST
    torch.testing.assert_close(x, want, atol=0, rtol=0)  # the host copy is intact
    del hog
    ferry.reload().wait()
    torch.testing.assert_close(x.cpu(), want, atol=0, rtol=0)


def test_thousand_cycles_hold_memory_flat():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    want = [p.detach().clone() for p in m.parameters()]
    ferry = Ferry(m, opt)
    for _ in range(20):
        ferry.offload()
        ferry.reload()
    torch.cuda.synchronize()
    gc.collect()
    rss0, objs0 = rss_bytes(), len(gc.get_objects())
    reserved0, host0 = torch.cuda.memory_reserved(), ferry.host_bytes
    for _ in range(1000):
        ferry.offload()
        ferry.reload()
    torch.cuda.synchronize()
    gc.collect()
    growth = {"rss": rss_bytes() - rss0, "objects": len(gc.get_objects()) - objs0,
              "reserved": torch.cuda.memory_reserved() - reserved0, "host": ferry.host_bytes - host0}
    growth["pinned"] = ferry.pinned_bytes - host0
    print("growth over 1000 cycles:", growth)
    if os.environ.get("TORCHFERRY_RESULTS_DIR"):  # the GPU batch keeps the figures seen
        with open(os.path.join(os.environ["TORCHFERRY_RESULTS_DIR"], "soak_gpu_1000_cycles.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cycles": 1000,
                       "state_bytes": ferry.state_bytes, "host_bytes": ferry.host_bytes,
                       "growth_bytes_or_objects": growth}, f, indent=1)
    # Host and pinned bytes exactly flat. Device: the packing pipeline's staging chunks are
    # freed under pending events (record_stream), so the allocator may hold a segment more or
    # less at a given moment: bounded, not per cycle (+4 MiB and -2 MiB seen over 1,000 cycles
    # on H200s, benchmarks/results/soak_gpu_*).
    assert growth["host"] == 0 and growth["pinned"] == 0
    assert abs(growth["reserved"]) <= (8 << 20), growth
    assert growth["rss"] < (16 << 20) and growth["objects"] < 200, growth
    assert all(torch.equal(a, p) for a, p in zip(want, m.parameters()))
