"""Probe: do host-to-device copies slow FSDP2's collectives or its compute on this machine?
(issue 17: with prefetch, the 7B compute-rich phases ran 0.13 s and 0.45 s longer than the
resident baseline's while copies ran.) Two ranks, one GPU each:

  all-gather alone / with a concurrent pinned H2D stream of COPY_GB;
  bf16 matmuls alone / with the same H2D stream;
  the H2D rate alone / during the all-gathers.

Run with NCCL_DEBUG=INFO to see the transport NCCL chose (P2P/NVLink, P2P over PCIe or SHM through
host memory): `NCCL_DEBUG=INFO torchrun --nproc_per_node 2 benchmarks/probe_contention.py OUT.json`.
"""
import datetime
import json
import statistics
import sys

import torch
import torch.distributed as dist

from torchferry.bench._setup import init_distributed, source_commit

rank, world, dev = init_distributed(True)
COPY_GB = 16
host = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
copy_stream = torch.cuda.Stream(dev)
shard = torch.randn(233_000_000 // world, device=dev, dtype=torch.bfloat16)  # one decoder layer, bf16
gathered = torch.empty(shard.numel() * world, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def timed(fn) -> float:
    dist.barrier()
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize(dev)
    return s.elapsed_time(e) / 1e3


def copies():
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        for _ in range(COPY_GB // 2):
            dst.copy_(host, non_blocking=True)


def gathers():
    for _ in range(28):
        dist.all_gather_into_tensor(gathered, shard)


def matmuls():
    for _ in range(60):
        torch.matmul(a, b)


def together(work):
    def run():
        copies()
        work()
        torch.cuda.current_stream().wait_stream(copy_stream)
    return run


def copy_rate_during(work):
    """GB/s of the copies when they overlap ``work`` (timed on the copy stream)."""
    dist.barrier()
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        s.record()
        for _ in range(COPY_GB // 2):
            dst.copy_(host, non_blocking=True)
        e.record()
    work()
    torch.cuda.synchronize(dev)
    return COPY_GB * (1 << 30) / (s.elapsed_time(e) / 1e3) / 1e9


res = {"rank": rank, "copy_bytes": COPY_GB << 30, "runs": []}
for _ in range(3):
    r = {"gather_alone_s": timed(gathers), "gather_with_copies_s": timed(together(gathers)),
         "matmul_alone_s": timed(matmuls), "matmul_with_copies_s": timed(together(matmuls)),
         "copies_alone_GBps": (COPY_GB << 30) / timed(lambda: (copies(), torch.cuda.current_stream().wait_stream(copy_stream))) / 1e9,
         "copies_during_gathers_GBps": copy_rate_during(gathers),
         "copies_during_matmuls_GBps": copy_rate_during(matmuls)}
    res["runs"].append(r)
res["median"] = {k: statistics.median(r[k] for r in res["runs"]) for k in res["runs"][0]}
res["env"] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": world,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "torchrun --nproc_per_node 2 benchmarks/probe_contention.py " + " ".join(sys.argv[1:]),
              "commit": source_commit(), "nccl": str(torch.cuda.nccl.version())}
out = [None] * world
dist.all_gather_object(out, res)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(res["median"]))
dist.destroy_process_group()
