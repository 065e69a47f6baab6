"""The PCIe link peak, measured in the same run as the figures it normalises."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LinkPeak", "measure_link_peak", "release_host_cache"]


@dataclasses.dataclass(frozen=True)
class LinkPeak:
    """Pinned copy bandwidth of one GPU's link, GB/s (1e9 B/s).

    Attributes:
        h2d: host -> device, one stream.
        d2h: device -> host, one stream.
        bidir: both directions at once on two streams, total of the two.
        nbytes: bytes per copy (1 GiB by default: the plateau of the H200's
            curve in ``shared/anchors/bw.json``).
    """

    h2d: float
    d2h: float
    bidir: float
    nbytes: int


def release_host_cache() -> None:
    """Empties PyTorch's caching host allocator (pinned blocks back to the OS)."""
    if not torch.cuda.is_available():
        return
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def _timed(fn, reps: int) -> float:
    """Fastest seconds of ``fn`` over ``reps`` runs, by CUDA events, after one warm-up.

    The fastest, not the median: a peak is the best the link does, and a
    median over a few reps let one slow rep set a peak below what the
    engine then reached in the same run.
    """
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def measure_link_peak(device: torch.device, nbytes: int = 1 << 30, reps: int = 10,
                      barrier=None) -> LinkPeak:
    """Measures pinned H2D, D2H and bidirectional copy bandwidth on ``device``.

    Args:
        device: a CUDA device.
        nbytes: bytes per copy.
        reps: timed repetitions (the fastest is taken).
        barrier: called before each measurement (e.g. ``dist.barrier``) so
            that all ranks of a node copy at once, as they do in training.

    Returns:
        A :class:`LinkPeak`. The pinned buffers are freed and the host cache
        emptied afterwards, so later strategies do not inherit them.
    """
    sync = barrier or (lambda: None)
    with torch.cuda.device(device):
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
        gpu2 = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(9)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(3)
        host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(5)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        sync()
        h2d = nbytes / _timed(lambda: gpu.copy_(host, non_blocking=True), reps) / 1e9
        sync()
        d2h = nbytes / _timed(lambda: host.copy_(gpu, non_blocking=True), reps) / 1e9

        def both():
            s1.wait_stream(torch.cuda.current_stream())
            s2.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s1):
                gpu.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(gpu2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)

        sync()
        bidir = 2 * nbytes / _timed(both, reps) / 1e9
        del gpu, gpu2, host, host2
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    release_host_cache()
    return LinkPeak(h2d=h2d, d2h=d2h, bidir=bidir, nbytes=nbytes)
