"""Probe (issue 17): what takes update_actor's compute slowdown under a layer-wise reload away?

The traced compute-rich run (``gpu_batch.sh diag``, ``phases_compute-rich_*.json``) showed, for
update_actor under ``torchferry+prefetch`` against the resident baseline: the same kernel seconds,
but the compute stream idle 0.55 s instead of 0.09 s, NCCL kernels 1.06 s instead of 0.58 s
(waiting for the other rank), and the host slower throughout (the phase's 346 ``cudaMalloc`` calls
0.275 s instead of 0.067 s; ``aten::mul`` 0.96 s instead of 0.65 s) while the optimizer state's
30.5 GB streamed in at line rate. (A first version of this probe topped the caching allocator up
at reload: it ran out of memory, the cached block was on the wrong stream for FSDP2's all-gathers.)
Variants, interleaved with the resident baseline in one bench:

* ``torchferry+prefetch+paced``: the optimizer state's copies spaced on the H2D stream (1 GiB,
  then a ``torch.cuda._sleep`` of ~60 ms, GPU-side: no host work), ~13 GB/s instead of ~54,
  still done ~2.4 s after the reload, before ``optimizer.step()``.
* ``torchferry+prefetch+noearly``: no ``offload_during_forward()`` in old_log_prob (no D2H
  copies beside the H2D ones and the forward).

Usage (2 GPUs): ``torchrun --nproc_per_node 2 benchmarks/probe_prefetch_variants.py [bench options]``.
"""
import sys

import torch

from torchferry import _prefetch
from torchferry.bench._strategies import STRATEGIES, TorchferryPrefetch
from torchferry.cli import main

CHUNK = 1 << 30
SLEEP_CYCLES = 120_000_000  # ~60 ms at the H200's ~1.98 GHz
_copy_group = _prefetch.PrefetchRun._copy_group
PACE = {"on": False}


def _paced_copy_group(self, gi: int) -> None:
    g = self.groups[gi]
    if not (PACE["on"] and g.unit is None and self.streams.is_cuda and g.nbytes > 4 * CHUNK):
        return _copy_group(self, gi)
    plan, slots = self.plan, self.views.slots
    done = 0
    with torch.cuda.stream(self.streams.h2d):
        for si in g.storages:
            if not plan.nbytes[si]:
                continue
            dst = (self.device_views[si] if self.device_views is not None
                   else torch.empty(0, dtype=torch.uint8, device=plan.device).set_(plan.storages[si]))
            dst.copy_(slots[si], non_blocking=True)
            done += plan.nbytes[si]
            if done >= CHUNK:
                torch.cuda._sleep(SLEEP_CYCLES)
                done = 0


_prefetch.PrefetchRun._copy_group = _paced_copy_group


class _Paced(TorchferryPrefetch):
    name = "torchferry+prefetch+paced"

    def reload(self, optimizer: bool) -> None:
        PACE["on"] = True
        try:
            super().reload(optimizer)
        finally:
            PACE["on"] = False


class _NoEarly(TorchferryPrefetch):
    name = "torchferry+prefetch+noearly"

    def before_forward_only(self) -> None:
        pass


for cls in (_Paced, _NoEarly):
    STRATEGIES[cls.name] = cls

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", "--strategies",
                "torchferry,torchferry+prefetch," + ",".join(c.name for c in (_Paced, _NoEarly)), *sys.argv[1:]]
    main()
