"""No growth over many cycles; close() and garbage collection return the host pool."""

import gc
import os

import torch
from torch import nn

from tests.helpers import rss_bytes
from torchferry import Ferry
from torchferry._core._state import host_blocks

CYCLES = int(os.environ.get("TORCHFERRY_SOAK_CYCLES", "1000"))
# Stated tolerances for CYCLES cycles after a warm-up of 50: resident set size
# may move by the allocator's noise, not by a copy of the state per cycle.
RSS_TOLERANCE = 8 << 20  # bytes
OBJECT_TOLERANCE = 200  # Python objects tracked by the gc



def test_cycles_hold_memory_and_objects_flat():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))  # 0.5 MB of state
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    want = [p.detach().clone() for p in m.parameters()]
    ferry = Ferry(m, opt)
    for _ in range(50):
        ferry.offload()
        ferry.reload()
    gc.collect()
    rss0, objs0, host0 = rss_bytes(), len(gc.get_objects()), ferry.host_bytes
    for _ in range(CYCLES):
        ferry.offload()
        ferry.reload()
    gc.collect()
    growth = rss_bytes() - rss0
    assert ferry.host_bytes == host0
    assert growth < RSS_TOLERANCE, f"RSS grew {growth} bytes over {CYCLES} cycles"
    assert len(gc.get_objects()) - objs0 < OBJECT_TOLERANCE
    assert all(torch.equal(a, p) for a, p in zip(want, m.parameters()))


def test_close_and_gc_return_the_pool():
    def live() -> int:
        gc.collect()
        return len(host_blocks.live_blocks)

    before = live()
    m = nn.Linear(512, 512)
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    assert live() == before + 1
    ferry.close()
    assert live() == before  # unmapped: no tensor views it any more
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    assert live() == before + 1
    del ferry
    assert live() == before
