"""One colocated RL step as verl runs it, timed phase by phase.

rollout (actor offloaded; a KV-cache-sized allocation proves the memory was
released) -> old_log_prob (reload parameters, forward, offload parameters) ->
update_actor (reload parameters and optimizer state, forward, backward, step,
offload both). The resident baseline runs the same phases with the state left
on the device (its reload, offload and release do nothing; no KV cache).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from .strategies import Strategy

__all__ = ["Span", "StepRecord", "run_step"]


@dataclasses.dataclass
class Span:
    """One bar of the timeline: seconds from the step's start."""

    phase: str  # "rollout", "old_log_prob", "update_actor"
    kind: str  # "d2h", "h2d", "compute", "rollout", "release" (empty_cache)
    start: float
    end: float
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class StepRecord:
    spans: list[Span]
    rollout_alloc_ok: bool | None  # None: not tried (the resident baseline keeps the state on the device)
    rollout_alloc_bytes: int
    gpu_bytes_left_offloaded: int  # memory_reserved() while offloaded, after empty_cache
    pinned_host_bytes: int
    loss: float
    transfer_gpu_s: dict[str, float | None] | None = None
    """Copy-engine seconds of update_actor's offload and reload (``{"d2h", "h2d"}``), where known."""

    def phase_seconds(self) -> dict[str, dict[str, float]]:
        """``{phase: {kind: seconds}}``, spans of one kind in a phase summed."""
        out: dict[str, dict[str, float]] = {}
        for s in self.spans:
            kinds = out.setdefault(s.phase, {})
            kinds[s.kind] = kinds.get(s.kind, 0.0) + s.seconds
        return out

    def seconds(self, kind: str) -> list[float]:
        return [s.seconds for s in self.spans if s.kind == kind]

    @property
    def exposed_transfer_s(self) -> float:
        return sum(s.seconds for s in self.spans if s.kind in ("d2h", "h2d"))

    @property
    def train_s(self) -> float:
        """Seconds of old_log_prob + update_actor, transfers included, phase gaps excluded."""
        return sum(s.seconds for s in self.spans if s.phase != "rollout")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        _sync(device)
        self.t0 = time.perf_counter()
        self.spans: list[Span] = []

    def run(self, phase: str, kind: str, fn, nbytes: int = 0, *, sync_before: bool = True, sync_after: bool = True):
        """Times ``fn`` on the host, the device synchronised before and after unless told not to
        (an overlapped reload must not be waited for: its waits fall inside the compute span)."""
        if sync_before:
            _sync(self.device)
        start = time.perf_counter() - self.t0
        with torch.profiler.record_function(f"bench::{phase}::{kind}"):  # a window for ``trace``'s phases
            out = fn()
            if sync_after:
                _sync(self.device)
        self.spans.append(Span(phase, kind, start, time.perf_counter() - self.t0, nbytes))
        return out


def _reserved(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def run_step(strategy: Strategy, batch: torch.Tensor, *, param_bytes: int, state_bytes: int,
             rollout_s: float, phase_gap_s: float, micro_batches: int = 1) -> StepRecord:
    """Runs one step, starting and ending with the actor state offloaded.

    ``phase_gap_s`` of host time separates the phases, untimed: in verl the
    reward scoring and advantage estimation run there. It also lets the CUDA
    driver finish releasing the memory that ``empty_cache()`` returned: a copy
    issued right after ``empty_cache()`` runs ~8% slower for every strategy
    (``git show 75cc57c:benchmarks/results/probe_reload_h200_qwen2.5-7b-unsharded_2026-11-30.json``).
    """
    model: nn.Module = strategy.model
    opt = strategy.optimizer
    device = strategy.device
    clock = _Clock(device)
    left = _reserved(device)
    pinned = strategy.pinned_host_bytes()

    def rollout() -> tuple[bool | None, int]:
        if strategy.keeps_resident:  # the state holds the memory: no KV cache to prove anything
            if rollout_s:
                time.sleep(rollout_s)
            return None, 0
        # A KV cache as large as the state the offload should have released.
        try:
            kv = torch.empty(state_bytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            return False, state_bytes
        kv.fill_(1)
        if rollout_s:
            time.sleep(rollout_s)
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the rollout engine goes to sleep
        return True, state_bytes

    ok, kv_bytes = clock.run("rollout", "rollout", rollout)
    time.sleep(phase_gap_s)

    def forward_only():
        with torch.no_grad():
            out = [model(input_ids=batch).logits.float().logsumexp(-1).mean() for _ in range(micro_batches)]
        return torch.stack(out).mean()

    sync = not strategy.overlaps_reload
    strategy.begin_phase("old_log_prob")
    clock.run("old_log_prob", "h2d", lambda: strategy.reload(optimizer=False), param_bytes, sync_after=sync)
    strategy.before_forward_only()
    clock.run("old_log_prob", "compute", forward_only, sync_before=sync)
    clock.run("old_log_prob", "d2h", lambda: strategy.offload(optimizer=False), param_bytes)
    clock.run("old_log_prob", "release", strategy.release)
    time.sleep(phase_gap_s)

    def train():
        for _ in range(micro_batches):  # gradient accumulation, as verl's ppo_micro_batch_size
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    strategy.begin_phase("update_actor")
    clock.run("update_actor", "h2d", lambda: strategy.reload(optimizer=True), state_bytes, sync_after=sync)
    loss = clock.run("update_actor", "compute", train, sync_before=sync)
    clock.run("update_actor", "d2h", lambda: strategy.offload(optimizer=True), state_bytes)
    gpu_s = strategy.transfer_gpu_s()
    clock.run("update_actor", "release", strategy.release)
    strategy.after_step()
    return StepRecord(clock.spans, ok, kv_bytes, left, pinned, float(loss), gpu_s)
