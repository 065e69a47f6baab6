"""The PCIe link peak, measured in the same run as the figures it normalises."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LinkPeak", "measure_link_peak", "release_host_cache"]


@dataclasses.dataclass(frozen=True)
class LinkPeak:
    """Pinned copy bandwidth of one GPU's link, GB/s (1e9 B/s).

    Measured the way the figures it normalises run: every rank of the node
    copying at the same time (a barrier before each timed burst of ``burst``
    back-to-back copies, so the ranks overlap for all of it). On 2 H200s of
    one host the two ranks' copies share the host side: one 1 GiB copy per
    timed rep let the ranks run mostly apart, and the strategies, whose
    transfers always overlap across ranks, then reached only 0.84-0.88 of that
    peak (``git show 75cc57c:benchmarks/results/bench_qwen2.5-7b_h200x2_compute-rich_before_2026-11-30.json``),
    while one rank alone reached 1.00 of it on one GPU
    (``git show 75cc57c:benchmarks/results/probe_pool_rate_h200_2026-11-30.rank0.json``).

    Attributes:
        h2d: host -> device, one stream, all ranks at once.
        d2h: device -> host, one stream, all ranks at once.
        bidir: both directions at once on two streams (total of the two), all ranks at once.
        nbytes: bytes per copy (1 GiB: past the size where an H200's pinned copies reach their plateau).
        solo: ``{"h2d", "d2h", "bidir"}`` with the ranks taking turns (one at a
            time); ``None`` with one rank (then the same as above).
    """

    h2d: float
    d2h: float
    bidir: float
    nbytes: int
    solo: dict | None = None


def release_host_cache() -> None:
    """Empties PyTorch's caching host allocator (pinned blocks back to the OS)."""
    if not torch.cuda.is_available():
        return
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def _timed(fn, reps: int, sync) -> float:
    """Fastest seconds of ``fn`` over ``reps`` runs, by CUDA events, after one warm-up; ``sync()``
    (a barrier) before each, so that every rank runs it at the same time.

    The fastest, not the median: a peak is the best the link does, and a
    median over a few reps let one slow rep set a peak below what the
    engine then reached in the same run.
    """
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        sync()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def _measure(gpu, gpu2, host, host2, s1, s2, nbytes: int, reps: int, burst: int, sync) -> dict:
    def h2d():
        for _ in range(burst):
            gpu.copy_(host, non_blocking=True)

    def d2h():
        for _ in range(burst):
            host.copy_(gpu, non_blocking=True)

    def both():
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        for _ in range(burst):
            with torch.cuda.stream(s1):
                gpu.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(gpu2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    n = burst * nbytes
    return {"h2d": n / _timed(h2d, reps, sync) / 1e9, "d2h": n / _timed(d2h, reps, sync) / 1e9,
            "bidir": 2 * n / _timed(both, reps, sync) / 1e9}


def measure_link_peak(device: torch.device, nbytes: int = 1 << 30, reps: int = 5, barrier=None,
                      burst: int = 4) -> LinkPeak:
    """Measures pinned H2D, D2H and bidirectional copy bandwidth on ``device``.

    Args:
        device: a CUDA device.
        nbytes: bytes per copy.
        reps: timed repetitions (the fastest is taken).
        barrier: ``dist.barrier`` when several ranks run: the peak is then
            measured with every rank copying at once (see :class:`LinkPeak`),
            and again with the ranks taking turns (``solo``).
        burst: copies per timed repetition, back to back (4 x 1 GiB: about 80 ms,
            long against the ranks' skew after a barrier).

    Returns:
        A :class:`LinkPeak`. The pinned buffers are freed and the host cache
        emptied afterwards, so later strategies do not inherit them.
    """
    import torch.distributed as dist

    sync = barrier or (lambda: None)
    several = barrier is not None and dist.is_initialized() and dist.get_world_size() > 1
    with torch.cuda.device(device):
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
        gpu2 = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(9)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(3)
        host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(5)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
        bufs = (gpu, gpu2, host, host2, s1, s2, nbytes)
        together = _measure(*bufs, reps, burst, sync)
        solo = None
        if several:
            mine = None
            for r in range(dist.get_world_size()):  # one rank at a time, the others wait
                barrier()
                if r == dist.get_rank():
                    mine = _measure(*bufs, reps, burst, lambda: None)
            barrier()
            solo = mine
        del gpu, gpu2, host, host2
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    release_host_cache()
    return LinkPeak(h2d=together["h2d"], d2h=together["d2h"], bidir=together["bidir"], nbytes=nbytes, solo=solo)
