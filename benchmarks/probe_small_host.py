"""Host microseconds per storage of the pieces of a reload of many small tensors (GPU).

``profile_small_reload.py`` found ``unpack_from_host`` (allocation and scatter, chunk by chunk)
taking 18.9 ms of host time for 4096 x 256 KiB on an H200: as long as the DMA. This times,
with the copies out of the way, each piece alone over ``--reps`` repetitions (median):
``resize_`` of freed storages back to their size, ``split_with_sizes_copy`` of 64 MiB chunks
into them, ``torch.empty`` of the same sizes, the Python loop alone; and storages freed with
``record_stream`` (as an offload frees them): the free, the next allocations (which process the
events), and the allocations once one small allocation drained the completed events.

    python benchmarks/probe_small_host.py OUT.json [--tensors 4096] [--kib 256] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchferry.bench._setup import env_record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tensors", type=int, default=4096)
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    n, nb = a.tensors, a.kib * 1024
    ts = [torch.empty(nb, dtype=torch.uint8, device=device) for _ in range(n)]
    sts = [t.untyped_storage() for t in ts]
    views = [torch.empty(0, dtype=torch.uint8, device=device).set_(s) for s in sts]
    per_chunk = (64 << 20) // nb
    staging = torch.empty(per_chunk * nb, dtype=torch.uint8, device=device)
    sizes = [nb] * per_chunk
    res: dict[str, list[float]] = {k: [] for k in ("resize_free", "resize_alloc", "split_copy", "empty", "loop",
                                                   "record_free", "alloc_after_record", "alloc_after_record_drained")}
    side = torch.cuda.Stream(device)

    def record_free():
        for v, s in zip(views, sts):
            v.record_stream(side)
            s.resize_(0)

    def timed(key, fn):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        res[key].append((time.perf_counter() - t0) * 1e6 / n)
        torch.cuda.synchronize(device)

    for _ in range(a.reps):
        timed("resize_free", lambda: [s.resize_(0) for s in sts])
        timed("resize_alloc", lambda: [s.resize_(nb) for s in sts])
        timed("split_copy", lambda: [torch.split_with_sizes_copy(staging, sizes, out=views[i:i + per_chunk])
                                     for i in range(0, n, per_chunk)])
        keep = []
        timed("empty", lambda: keep.extend(torch.empty(nb, dtype=torch.uint8, device=device) for _ in range(n)))
        del keep
        timed("loop", lambda: [nb for s in sts])
        # Freed with record_stream (as an offload releases): the next allocations process the events.
        timed("record_free", record_free)
        timed("alloc_after_record", lambda: [s.resize_(nb) for s in sts])
        record_free()
        torch.cuda.synchronize(device)
        torch.empty(1, device=device)  # one allocation drains the completed events
        timed("alloc_after_record_drained", lambda: [s.resize_(nb) for s in sts])
    out = {"env": env_record(device, 1), "tensors": n, "bytes_each": nb,
           "host_us_per_storage": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                   for k, v in res.items()}}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["host_us_per_storage"], indent=1))


if __name__ == "__main__":
    main()
