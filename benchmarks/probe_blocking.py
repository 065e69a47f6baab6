"""Does a batched copy op block the host until its stream is idle? (GPU)

Queues ``torch.cuda._sleep`` (about 50 ms) on a side stream, then times on the host, with
that stream current, each op that the packing pipeline could use to scatter a 64 MiB
staging buffer into 256 storages of 256 KiB (or gather them): an op that copies its
metadata from pageable host memory waits for the stream (the CUDA runtime syncs the stream
before a pageable H2D copy), which serialises the host with the copy engine.

    python benchmarks/probe_blocking.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from torchferry.bench._setup import env_record


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    n, nb = 256, 256 << 10
    staging = torch.empty(n * nb, dtype=torch.uint8, device=device)
    dests = [torch.empty(nb, dtype=torch.uint8, device=device) for _ in range(n)]
    sizes = [nb] * n
    side = torch.cuda.Stream(device)
    ops = {
        "split_with_sizes_copy": lambda: torch.split_with_sizes_copy(staging, sizes, out=dests),
        "split_with_sizes+_foreach_copy_": lambda: torch._foreach_copy_(dests, torch.split_with_sizes(staging, sizes)),
        "cat_out": lambda: torch.cat(dests, out=staging),
        "_foreach_copy_gather": lambda: torch._foreach_copy_(list(torch.split_with_sizes(staging, sizes)), dests),
    }
    # cycles for ~50 ms of sleep
    torch.cuda.synchronize()
    t = time.perf_counter(); torch.cuda._sleep(10_000_000); torch.cuda.synchronize(); per = (time.perf_counter() - t) / 10_000_000
    cycles = int(0.05 / per)
    out = {"env": env_record(device, 1), "sleep_s": cycles * per, "host_ms_behind_busy_stream": {}, "host_ms_idle_stream": {}}
    for name, op in ops.items():
        for busy in (True, False):
            vals = []
            for _ in range(5):
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    if busy:
                        torch.cuda._sleep(cycles)
                    t0 = time.perf_counter()
                    op()
                    vals.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
            key = "host_ms_behind_busy_stream" if busy else "host_ms_idle_stream"
            out[key][name] = sorted(vals)[len(vals) // 2]
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "env"}, indent=1))


if __name__ == "__main__":
    main()
