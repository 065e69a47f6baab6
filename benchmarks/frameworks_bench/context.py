"""A run's settings and the host-side helpers every framework's cycles use."""

from __future__ import annotations

import contextlib
import gc
import time

import torch


# --------------------------------------------------------------------------------------------- context
class Run:
    def __init__(self, args, device, peak) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak = peak  # dict or None
        self.flags: list[str] = []

    def peak_of(self, op: str) -> float | None:
        if not self.peak:
            return None
        return self.peak["d2h"] if op.startswith("offload") else self.peak["h2d"]

    def gap(self) -> None:
        if self.args.gap_s > 0:
            time.sleep(self.args.gap_s)


def _cycles(args) -> int:
    return args.warmup + args.cycles


@contextlib.contextmanager
def _cpu_current_device(cuda: bool):
    """On the CPU: ``torch.cuda.current_device()`` answers "cpu" (SkyRL's load helpers call it)."""
    if cuda:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def _release_host(cuda: bool) -> None:
    from torchferry.bench._common.link import release_host_cache

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    release_host_cache()


def _pinned_cache_bytes(cuda: bool) -> int | None:
    if not cuda or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    hs = torch.cuda.host_memory_stats()
    return int(hs.get("reserved_bytes.current", hs.get("allocated_bytes.current", 0)))
