"""Probe (issue 17): which change takes update_actor's compute slowdown under a layer-wise reload away?

The traced compute-rich run (``gpu_batch.sh diag``) showed, for update_actor under
``torchferry+prefetch`` against the resident baseline: the same kernel seconds, but the compute
stream idle 0.55 s instead of 0.09 s, NCCL kernels 1.06 s instead of 0.58 s (waiting for the
other rank), and the phase's 346 ``cudaMalloc`` calls taking 0.275 s of host time instead of
0.067 s while the optimizer state's 30.5 GB streamed in. Variants, run interleaved in one bench:

* ``torchferry+prefetch+warm``: after the reload is issued, one allocation tops the caching
  allocator up to what it held when this phase last ended (then freed into the cache), so the
  phase's activations are carved from cached blocks instead of ~100 ``cudaMalloc`` calls.
* ``torchferry+prefetch+lateopt``: the optimizer state's reload is issued when the first
  micro-batch's forward returns (the parameters' copies alone run during that forward).
* ``torchferry+prefetch+warm+lateopt``: both.

Usage (2 GPUs): ``torchrun --nproc_per_node 2 benchmarks/probe_prefetch_variants.py [bench options]``;
the options are ``torchferry bench``'s (``--workload compute-rich --steps 3 --json OUT``).
"""
import sys

import torch

from torchferry import Prefetch
from torchferry.bench._strategies import STRATEGIES, TorchferryPrefetch
from torchferry.cli import main


class _Warm(TorchferryPrefetch):
    name = "torchferry+prefetch+warm"
    warm, late_opt = True, False

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self._phase, self._held = "", {}
        self._late = None

    def begin_phase(self, phase: str) -> None:
        self._phase = phase

    def offload(self, optimizer: bool) -> None:
        if self.device.type == "cuda":
            self._held[self._phase] = torch.cuda.memory_reserved(self.device)
        super().offload(optimizer)

    def reload(self, optimizer: bool) -> None:
        self.model_ferry.reload(prefetch=self.lookahead)
        if optimizer and self.late_opt:
            def hook(module, args, output):
                self._late.remove()
                self._late = None
                self.opt_ferry.reload(prefetch=Prefetch())
            self._late = self.model.register_forward_hook(hook)
        elif optimizer:
            self.opt_ferry.reload(prefetch=self.lookahead)
        if self.warm and self.device.type == "cuda":
            top_up = self._held.get(self._phase, 0) - torch.cuda.memory_reserved(self.device)
            if top_up > 64 << 20:
                torch.empty(top_up, dtype=torch.uint8, device=self.device)  # one cudaMalloc, freed into the cache

    def settle(self) -> None:
        if self._late is not None:
            self._late.remove()
            self._late = None
        super().settle()


class _LateOpt(_Warm):
    name = "torchferry+prefetch+lateopt"
    warm, late_opt = False, True


class _Both(_Warm):
    name = "torchferry+prefetch+warm+lateopt"
    warm, late_opt = True, True


for cls in (_Warm, _LateOpt, _Both):
    STRATEGIES[cls.name] = cls

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", "--strategies",
                "torchferry,torchferry+prefetch," + ",".join(c.name for c in (_Warm, _LateOpt, _Both)),
                *sys.argv[1:]]
    main()
