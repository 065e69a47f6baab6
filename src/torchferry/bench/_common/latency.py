"""The latency of a small copy issued on another stream while torchferry's bulk copies run.

What it stands for: FSDP2's all-gather copy-out and reduce-scatter copy-in copy 34 KiB of
metadata host-to-device on the compute stream once per unit; behind a queue of bulk copies on the
same copy engine it waits (see [Note: switch points] in ``torchferry._core._transfer.switch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["SMALL_COPY_BYTES", "SmallCopyProbe", "percentiles"]

SMALL_COPY_BYTES = 34 * 1024  # FSDP2's per-unit copy-out metadata at Qwen2.5-7B (34176 B)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """``{"p50", "p90", "n"}`` of ``values`` (nearest rank; ``None`` when empty)."""
    if not values:
        return {"p50": None, "p90": None, "n": 0}
    xs = sorted(values)

    def rank(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]

    return {"p50": rank(0.5), "p90": rank(0.9), "n": len(xs)}


class SmallCopyProbe:
    """Small copies on a stream of their own, timed on the GPU with events.

    Args:
        device: a CUDA device.
        direction: ``"h2d"`` (pinned host -> device) or ``"d2h"``.
        nbytes: bytes per copy (default :data:`SMALL_COPY_BYTES`).
    """

    def __init__(self, device: torch.device, direction: str = "h2d", nbytes: int = SMALL_COPY_BYTES) -> None:
        self.device, self.direction = device, direction
        self.stream = torch.cuda.Stream(device)
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def issue(self, stream: torch.cuda.Stream | None = None) -> None:
        """Queues one timed copy on ``stream`` (default: the probe's own; the current stream to stand
        for FSDP2's copies on the compute stream); does not wait."""
        stream = self.stream if stream is None else stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            if self.direction == "h2d":
                self._dev.copy_(self._host, non_blocking=True)
            else:
                self._host.copy_(self._dev, non_blocking=True)
            end.record(stream)
        self._pending.append((start, end))

    def collect(self) -> list[float]:
        """Milliseconds of each copy issued since the last collect (synchronises the device)."""
        torch.cuda.synchronize(self.device)
        out = [s.elapsed_time(e) for s, e in self._pending]
        self._pending = []
        return out

    def alone(self, n: int = 20) -> list[float]:
        """``n`` copies with nothing else queued (the baseline)."""
        torch.cuda.synchronize(self.device)
        for _ in range(n):
            self.issue()
            self.stream.synchronize()
        return self.collect()

    def during(self, start_bulk: Callable[[], object], bulk_s: float, n: int = 24,
               stream: torch.cuda.Stream | None = None) -> list[float]:
        """Runs ``start_bulk()`` (which queues copies and returns before they finish), then issues
        ``n`` copies on ``stream`` (default: the probe's own) spread over the first ``bulk_s``
        seconds (0.8 of it: all while the bulk runs); returns their latencies (ms). The device is
        synchronised before and after."""
        torch.cuda.synchronize(self.device)
        start_bulk()
        t0 = time.perf_counter()
        gap = 0.8 * bulk_s / max(1, n)
        for k in range(n):
            while time.perf_counter() < t0 + k * gap:
                pass
            self.issue(stream)
        return self.collect()
