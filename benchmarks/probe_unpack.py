"""Host time of each step of the reload's unpack loop ([Note: packing pipeline]), 4096 x 256 KiB (GPU).

``profile_small_reload.py`` found ``unpack_from_host`` taking about 21 ms of host time where
its pieces measured alone (``probe_small_host.py``) add up to about 8. This runs the same loop
(64 MiB chunks, two staging buffers, H2D on one stream, scatter on another, storages re-allocated
while the chunk's DMA is in flight) over torchferry's pool (``HostBuffer``: mmap,
``cudaHostRegister``; a ``torch`` pinned buffer measured the same), with a host timer around
each step, storages freed with ``record_stream`` in between as an offload frees them; variants:
2, 4 or 16 staging buffers, the scatter by ``split_with_sizes_copy`` or ``_foreach_copy_``, or
the DMAs alone; and the storages freed without ``record_stream`` (no events left to process).

    python benchmarks/probe_unpack.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from torchferry._host_memory import HostBuffer
from torchferry.bench._setup import env_record


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    n, nb, per = 4096, 256 << 10, 256
    total = n * nb
    sts = [torch.empty(nb, dtype=torch.uint8, device=device).untyped_storage() for _ in range(n)]
    views = [torch.empty(0, dtype=torch.uint8, device=device).set_(s) for s in sts]
    h2d, pack, d2h = torch.cuda.Stream(device), torch.cuda.Stream(device), torch.cuda.Stream(device)
    result = {"env": env_record(device, 1)}
    pool = HostBuffer(total, pin_bytes=total, device=device.index).tensor
    variants = {  # name: (staging buffers, scatter op or None, storages freed with record_stream)
        "2buf_split_copy": (2, "split", True), "dma_only": (2, None, True), "4buf_split_copy": (4, "split", True),
        "2buf_foreach_copy": (2, "foreach", True), "16buf_split_copy": (16, "split", True),
        "2buf_split_copy_freed_without_events": (2, "split", False),
        "dma_only_freed_without_events": (2, None, False)}
    for variant, (nbuf, scatter, events) in variants.items():
        chunks = [pool[i * per * nb:(i + 1) * per * nb] for i in range(n // per)]
        steps: dict[str, list[float]] = defaultdict(list)
        walls, gpus = [], []
        for rep in range(8):
            for v, s in zip(views, sts):  # an offload's release
                if events:
                    v.record_stream(d2h)
                s.resize_(0)
            torch.cuda.synchronize()
            acc: dict[str, float] = defaultdict(float)
            t_start = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            start.record(h2d)
            bufs, unpacked = [], [None] * nbuf
            for k, pc in enumerate(chunks):
                b = k % nbuf
                t = time.perf_counter()
                with torch.cuda.stream(h2d):
                    if len(bufs) <= b:
                        bufs.append(torch.empty(per * nb, dtype=torch.uint8, device=device))
                    if unpacked[b] is not None:
                        h2d.wait_event(unpacked[b])
                    acc["a_stage_alloc_wait"] += time.perf_counter() - t
                    t = time.perf_counter()
                    bufs[b].copy_(pc, non_blocking=True)
                    acc["b_h2d_copy_issue"] += time.perf_counter() - t
                    t = time.perf_counter()
                    landed = torch.cuda.Event()
                    landed.record(h2d)
                acc["c_event"] += time.perf_counter() - t
                t = time.perf_counter()
                for s in sts[k * per:(k + 1) * per]:
                    s.resize_(nb)
                dests = views[k * per:(k + 1) * per]
                acc["d_alloc"] += time.perf_counter() - t
                t = time.perf_counter()
                if scatter is not None:
                    pack.wait_event(landed)
                    with torch.cuda.stream(pack):
                        if scatter == "split":
                            torch.split_with_sizes_copy(bufs[b], [nb] * per, out=dests)
                        else:
                            torch._foreach_copy_(dests, torch.split_with_sizes(bufs[b], [nb] * per))
                        unpacked[b] = torch.cuda.Event()
                        unpacked[b].record(pack)
                acc["e_scatter"] += time.perf_counter() - t
            h2d.wait_stream(pack)
            end = torch.cuda.Event(enable_timing=True)
            end.record(h2d)
            host = time.perf_counter() - t_start
            torch.cuda.synchronize()
            wall = time.perf_counter() - t_start
            if rep >= 2:
                walls.append(wall), gpus.append(start.elapsed_time(end) / 1e3)
                steps["host_total"].append(host * 1e3)
                for key, v in acc.items():
                    steps[key].append(v * 1e3)
        result[variant] = {"wall_s": statistics.median(walls), "gpu_s": statistics.median(gpus),
                             "GBps": total / statistics.median(walls) / 1e9,
                             "host_ms": {k: statistics.median(v) for k, v in sorted(steps.items())}}
        del bufs
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))


if __name__ == "__main__":
    main()
