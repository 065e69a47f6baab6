"""Diagnosis (``run --gpu-busy``, ``VERL_ACTOR_GPU_BUSY=1``): the seconds the GPU was busy in each phase of a
step, from the CUDA activity PyTorch's profiler records (kernels, copies, fills), beside the phase's wall and
CPU seconds. A phase whose busy seconds are well under its wall seconds waited on the host (launches,
Python); one whose busy seconds fill it waited on the GPU. Under ``--blocking-sync`` a phase's CPU seconds
tell the same from the host's side, but only where every wait sleeps; the device's own record needs no such
assumption.

The profiler gives each event's start and end in nanoseconds of the Unix epoch (``_KinetoEvent.start_ns``
/ ``end_ns``), so the phases' ends are taken with :func:`time.time_ns`. The host's CUDA runtime calls are
recorded too: ``aligned`` says whether they fall inside the step as the host timed it (the two clocks agree),
without which the per-phase split is not read."""

from __future__ import annotations

import time

__all__ = ["GpuBusy", "busy_ns"]


def busy_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Nanoseconds of ``[lo, hi)`` covered by at least one of ``intervals`` (``(start, end)`` pairs, any order,
    overlapping or not): the union, clipped to the window."""
    total, reach = 0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
        if reach >= hi:
            break
    return total


class GpuBusy:
    """One step's device activity per phase: :meth:`begin` before the step, :meth:`mark` at each phase's end,
    :meth:`end` after the step (``None`` when off)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._prof = None

    def begin(self) -> None:
        self._marks: list[tuple[str, int]] = []
        self._t0 = self._t_exit = time.time_ns()
        if not self.enabled:
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._t0 = time.time_ns()

    def mark(self, phase: str) -> None:
        if self._prof is not None:
            self._marks.append((phase, time.time_ns()))

    def end(self) -> dict | None:
        if self._prof is None:
            return None
        prof = self._prof
        self._prof = None
        self._t_exit = time.time_ns()
        prof.__exit__(None, None, None)
        device, host = [], []
        for e in prof.profiler.kineto_results.events():  # type: ignore[union-attr]
            (device if str(e.device_type()).endswith("CUDA") else host).append((e.start_ns(), e.end_ns()))
        return self.split(device, host)

    def split(self, device: list[tuple[int, int]], host: list[tuple[int, int]]) -> dict:
        """The busy seconds of each marked phase from the device's intervals (ns of the Unix epoch), the
        step's, and whether the host's runtime calls fall between :meth:`begin` and :meth:`end` give or take
        5 ms (the two clocks agree)."""
        t_end = self._marks[-1][1] if self._marks else self._t0
        phases, lo = {}, self._t0
        for phase, hi in self._marks:
            phases[phase] = busy_ns(device, lo, hi) / 1e9
            lo = hi
        inside = [s for s, _ in host if self._t0 - 5_000_000 <= s <= self._t_exit + 5_000_000]
        return {"busy_s": phases, "step_busy_s": busy_ns(device, self._t0, t_end) / 1e9,
                "device_events": len(device), "aligned": bool(host) and len(inside) == len(host)}
