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
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ._strategies import STRATEGIES, Resident, SharedFerries, Strategy, make_strategy
from ._summary import FirstCycle
from ._trace import profile_step, trace_paths, write_trace
from ._units import UnitTimer, fsdp_units
from ._workload import StepRecord, run_step

__all__ = ["Rounds", "bit_sums", "checksum", "rotated", "state_bytes", "unique_storage_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def unique_storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` under ``tensors`` (a DTensor counts its local shard)."""
    seen = {}
    for t in tensors:
        local = _local(t)
        if local.device == device:
            st = local.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    unique = functools.partial(unique_storage_bytes, device=device)
    return {
        "params": unique(model.parameters()),
        "grads": unique(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": unique(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(model: nn.Module, device: torch.device | None = None) -> list[int]:
    """Per parameter, the sum of its local shard's bits as integers (int64, wrapping).

    Exact and independent of summation order, so a shard read on the host
    (still offloaded, during a layer-wise reload) and on the device give the
    same value; a float sum would differ by rounding. See :func:`bit_sums` for ``device``.
    """
    return bit_sums([_local(p) for p in model.parameters()], device)


def bit_sums(tensors: list[torch.Tensor], device: torch.device | None = None) -> list[int]:
    """Per tensor, the sum of its bits as integers (int64, wrapping); 0 for an empty one.

    With a CUDA ``device``, host tensors are copied there (H2D, non-blocking from pinned
    memory) and summed on the GPU, with one host sync for all: the host copies are still
    what is read, at the link's rate instead of the host's (a 7B state took minutes summed
    on the host). Otherwise each tensor is summed where it is.
    """
    on_gpu = device is not None and device.type == "cuda"
    with torch.no_grad():
        sums: list[torch.Tensor | int] = []
        for t in tensors:
            if not t.numel():
                sums.append(0)
                continue
            if on_gpu and t.device.type == "cpu":
                t = t.to(device, non_blocking=t.is_pinned())
            t = t.contiguous()
            s = t.view(_INT_VIEW[t.element_size()]).sum(dtype=torch.int64)
            sums.append(s if on_gpu and s.device == device else int(s))
        lazy = [s for s in sums if torch.is_tensor(s)]
        values = iter(torch.stack(lazy).tolist() if lazy else [])
        return [next(values) if torch.is_tensor(s) else s for s in sums]


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` rotated left by ``k``: over ``len(names)`` rounds each takes each position."""
    k %= len(names)
    return names[k:] + names[:k]


class Rounds:
    """One run's strategies, where the state is, and their records (see ``_run`` for the order)."""

    def __init__(self, config, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                 batch: torch.Tensor, micro_batches: int, sizes: dict[str, int],
                 say: Callable[[str, float], None]) -> None:
        self.config, self.model, self.opt, self.device = config, model, opt, device
        self.batch, self.sizes = batch, sizes
        self.micro_batches, self.say = micro_batches, say
        self.units = fsdp_units(model)
        self.timer = UnitTimer(model, self.units, device)
        self.strategies: dict[str, Strategy] = {"resident": Resident(model, opt, device, timer=self.timer)}
        self.ferries: SharedFerries | None = None
        self.holder: Strategy | None = None  # whose offloaded form the state is in; None: resident on the device
        self.placed_by: Strategy | None = None  # who put the resident state where it is (its leave() pending)
        self.records: dict[str, list[StepRecord]] = {n: [] for n in (*config.strategies, "resident")}
        self.first: dict[str, FirstCycle] = {}
        self.done, self.total = 0, len(config.strategies) + config.steps * (len(config.strategies) + 1)

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

    def close(self) -> None:
        self.bring_back()
        for s in self.strategies.values():
            s.close()
        self.timer.remove()
