"""Compute seconds of each FSDP2 unit in the first forward pass of a phase, with the state resident.

The inputs of the prefetch floor ([Note: prefetch floor] in ``overlap``): per
unit, in forward pre-order, the seconds its forward takes (the units and their
bytes: ``_common/units.py``).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch import nn

__all__ = ["UnitTimer"]


class UnitTimer:
    """Times each FSDP unit's forward in the first forward pass of a phase.

    ``arm(phase)`` registers a forward pre-hook on every unit (ahead of FSDP2's
    own, so a unit's time includes its all-gather) and a forward hook on the
    model; they record a CUDA event on the current stream (on the CPU,
    ``time.perf_counter()``) at each unit's start and at the model's end, in
    the first forward only. ``collect()``, after the step (device synchronised),
    turns them into seconds and removes the hooks. Unit ``i``'s seconds run from
    its start to the next unit's start (the last unit: to the model's end); a
    unit that did not run counts 0.
    """

    def __init__(self, model: nn.Module, units: list[nn.Module], device: torch.device) -> None:
        self.model, self.units, self.device = model, units, device
        self.samples: dict[str, list[list[float]]] = {}
        """Per phase, per collected step: seconds per unit, in ``units`` order."""
        self._handles: list = []
        self._phase: str | None = None
        self._marks: dict[str, list[tuple[int, object]]] = {}  # phase -> (unit index or -1 = end, event/time)

    def _mark(self) -> object:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def arm(self, phase: str) -> None:
        """Records the next forward pass as ``phase``'s (hooks registered on first use)."""
        if not self.units:
            return
        if not self._handles:
            for i, u in enumerate(self.units):
                self._handles.append(u.register_forward_pre_hook(self._pre_hook(i), prepend=True))
            self._handles.append(self.model.register_forward_hook(self._end_hook))
        self._phase = phase
        self._marks[phase] = []

    def _pre_hook(self, i: int):
        def hook(module: nn.Module, args: object) -> None:
            if self._phase is not None and all(j != i for j, _ in self._marks[self._phase]):
                self._marks[self._phase].append((i, self._mark()))
        return hook

    def _end_hook(self, module: nn.Module, args: object, output: object) -> None:
        if self._phase is not None:
            self._marks[self._phase].append((-1, self._mark()))
            self._phase = None  # the first forward of the phase only

    def _seconds(self, a: object, b: object) -> float:
        if isinstance(a, float):
            return b - a  # type: ignore[operator]
        return a.elapsed_time(b) / 1e3  # type: ignore[union-attr]

    def collect(self) -> None:
        """Turns this step's marks into seconds per unit (appended to ``samples``) and removes the hooks."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for phase, marks in self._marks.items():
            if len(marks) < 2 or marks[-1][0] != -1:
                continue  # no complete forward recorded
            secs = [0.0] * len(self.units)
            for (i, a), (_, b) in itertools.pairwise(marks):
                secs[i] = self._seconds(a, b)
            self.samples.setdefault(phase, []).append(secs)
        self._marks = {}
        self._phase = None
        self.remove()

    def remove(self) -> None:
        """Removes the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def medians(self) -> dict[str, list[float]]:
        """Per phase, per unit: the median of its seconds over the collected steps."""
        return {phase: [statistics.median(col) for col in zip(*rows, strict=False)]
                for phase, rows in self.samples.items() if rows}
