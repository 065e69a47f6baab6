"""The bench's steps: set-ups and first cycles, timed steps, hand-overs between strategies.

The state is always in one strategy's offloaded form (``holder``) or resident
on the device; a step of strategy ``S`` starts and ends with it offloaded by
``S``. Between families the hand-over is untimed: ``prev.reload(optimizer=True);
prev.settle(); nxt.offload(optimizer=True); nxt.release()``; ``prev.leave()`` comes right
before the offload of the next other family (not before the resident baseline's steps,
which keep the state where ``prev`` put it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from .._common.latency import SmallCopyProbe, percentiles
from .._common.state import checksum
from .._common.units import fsdp_units
from .strategies import STRATEGIES, Resident, ResidentDMA, SharedFerries, Strategy, Torchferry, make_strategy
from .summary import FirstCycle
from .timer import UnitTimer
from .trace import profile_step, trace_paths, write_trace
from .workload import StepRecord, run_step

__all__ = ["Rounds", "rotated"]


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` rotated left by ``k``: over ``len(names)`` rounds each takes each position."""
    k %= len(names)
    return names[k:] + names[:k]


class Rounds:
    """One run's strategies, where the state is, and their records (see ``run`` for the order)."""

    def __init__(self, config, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                 batch: torch.Tensor, micro_batches: int, sizes: dict[str, int],
                 say: Callable[[str, float], None], *, dma_baseline: bool = False) -> None:
        self.config, self.model, self.opt, self.device = config, model, opt, device
        self.batch, self.sizes = batch, sizes
        self.micro_batches, self.say = micro_batches, say
        self.units = fsdp_units(model)
        self.timer = UnitTimer(model, self.units, device)
        self.strategies: dict[str, Strategy] = {"resident": Resident(model, opt, device, timer=self.timer)}
        self.ferries: SharedFerries | None = None
        self.holder: Strategy | None = None  # whose offloaded form the state is in; None: resident on the device
        self.placed_by: Strategy | None = None  # who put the resident state where it is (its leave() pending)
        baselines = ["resident"]
        if dma_baseline:  # see [Note: the copies' own cost] in ``overlap``
            self.strategies[ResidentDMA.name] = ResidentDMA(model, opt, device, sizes)
            baselines.append(ResidentDMA.name)
        self.baselines = tuple(baselines)
        self.records: dict[str, list[StepRecord]] = {n: [] for n in (*config.strategies, *baselines)}
        self.first: dict[str, FirstCycle] = {}
        self.done = 0
        self.total = len(config.strategies) + config.steps * (len(config.strategies) + len(baselines))

    def _progress(self, msg: str) -> None:
        self.say(msg, 0.05 + 0.93 * self.done / self.total)

    def make(self, name: str) -> Strategy:
        if name not in self.strategies:
            if STRATEGIES[name].family == "torchferry" and self.ferries is None:
                self.ferries = SharedFerries(self.model, self.opt, self.device)  # created when first needed
            self.strategies[name] = make_strategy(name, self.model, self.opt, self.device, ferries=self.ferries)
        return self.strategies[name]

    def hand_to(self, nxt: Strategy) -> None:
        """Leaves the state offloaded by ``nxt``, switching forms untimed if another family holds it."""
        if self.holder is not None and self.holder.family == nxt.family:
            self.holder = nxt
            return
        self.bring_back()
        self._offload_by(nxt)
        nxt.release()
        self.holder = nxt

    def _offload_by(self, nxt: Strategy) -> None:
        if not nxt.keeps_resident and self.placed_by is not None:
            if self.placed_by.family != nxt.family:  # the same family's offload drops it itself
                self.placed_by.leave()
            self.placed_by = None
        nxt.offload(optimizer=True)

    def bring_back(self) -> None:
        """Leaves the state resident on the device, in no strategy's form."""
        if self.holder is not None:
            self.holder.reload(optimizer=True)
            self.holder.settle()
            if not self.holder.keeps_resident:
                self.placed_by = self.holder
            self.holder = None

    def first_cycle(self, name: str) -> None:
        """Set-up and first round trip; the state is resident before and after."""
        import torch.distributed as dist

        self.bring_back()
        self._progress(f"{name}: setting up")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        strategy = self.make(name)
        dist.barrier()
        pin_s = strategy.setup()
        before = checksum(self.model)
        dist.barrier()
        t = time.perf_counter()
        self._offload_by(strategy)
        first_offload = time.perf_counter() - t
        strategy.release()
        time.sleep(self.config.phase_gap_s)
        dist.barrier()
        t = time.perf_counter()
        strategy.reload(optimizer=True)
        first_reload = time.perf_counter() - t
        bit_exact = checksum(self.model) == before  # the first round trip changed no bit
        strategy.settle()
        self.placed_by = strategy
        self.first[name] = FirstCycle(first_offload, first_reload, pin_s, bit_exact)
        self.done += 1

    def _step(self, strategy: Strategy) -> StepRecord:
        c = self.config
        return run_step(strategy, self.batch, param_bytes=self.sizes["params"], state_bytes=sum(self.sizes.values()),
                        rollout_s=c.rollout_s, phase_gap_s=c.phase_gap_s, micro_batches=self.micro_batches)

    def timed_step(self, name: str) -> None:
        import torch.distributed as dist

        strategy = self.strategies[name]
        self.hand_to(strategy)
        self._progress(f"{name}: step {len(self.records[name]) + 1}/{self.config.steps}")
        dist.barrier()
        self.records[name].append(self._step(strategy))
        self.done += 1

    def traced_step(self, name: str, rank: int, traces: dict, trace_files: list, notes: list) -> None:
        """One extra step of ``name`` under the profiler on rank 0 (not in the figures)."""
        import torch.distributed as dist

        strategy = self.strategies[name]
        self.hand_to(strategy)
        self._progress(f"{name}: one profiled step")
        dist.barrier()
        step = functools.partial(self._step, strategy)
        if rank != 0:
            step()
            return
        _, prof = profile_step(step)
        prefix = f"{self.config.trace}.{name.replace('+', '-')}"
        try:
            traces[name] = write_trace(prof, prefix)["totals"]
            trace_files.extend(trace_paths(prefix))
        except OSError as e:  # checked before the run; a disk that filled up since must not lose it
            notes.append(f"--trace: could not write {prefix}.* ({e.strerror or e})")

    def small_copy_latency(self, name: str) -> dict[str, dict[str, float | None]]:
        """One extra update_actor (not in the figures) of a torchferry strategy, for the latency of
        a small copy beside its transfers (``_common/latency``; [Note: switch points]): a 34 KiB H2D
        copy on the compute stream at each FSDP unit's forward while the reload streams in, as FSDP2's
        own copy-out metadata, and 34 KiB D2H copies on the compute stream while the offload runs.
        Milliseconds, ``{"h2d": {"p50", "p90", "n", "alone_p50"}, "d2h": {...}}``; the state is left
        offloaded by ``name``, as after a timed step."""
        strategy = self.strategies[name]
        self.hand_to(strategy)
        self._progress(f"{name}: small copies beside its transfers")
        h2d, d2h = SmallCopyProbe(self.device, "h2d"), SmallCopyProbe(self.device, "d2h")
        alone = {"h2d": percentiles(h2d.alone())["p50"], "d2h": percentiles(d2h.alone())["p50"]}
        hooks = [u.register_forward_pre_hook(lambda *_: h2d.issue(torch.cuda.current_stream(self.device)))
                 for u in self.units]
        try:
            strategy.reload(optimizer=True)
            for _ in range(self.micro_batches):
                self.model(input_ids=self.batch, labels=self.batch).loss.backward()
        finally:
            for h in hooks:
                h.remove()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        during_h2d = h2d.collect()
        ferries = strategy.ferries_moved(True) if isinstance(strategy, Torchferry) else []
        handles: list = []
        during_d2h = d2h.during(lambda: handles.extend(f.offload() for f in ferries),
                                sum(self.sizes.values()) / 50e9, stream=torch.cuda.current_stream(self.device))
        for h in handles:
            h.wait()
        strategy.release()
        return {k: {**percentiles(v), "alone_p50": alone[k]} for k, v in (("h2d", during_h2d), ("d2h", during_d2h))}

    def close(self) -> None:
        self.bring_back()
        for s in self.strategies.values():
            s.close()
        self.timer.remove()
