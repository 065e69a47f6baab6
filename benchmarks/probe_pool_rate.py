"""Probe: DMA rate of each ferry's pool (model, optimizer) at 7B over FSDP2, by GPU events, against
the same storages copied into a torch pinned buffer (cudaHostAlloc) in the same run, with each
pool's huge-page coverage. Issue 17, part 5 (line rate on every host).

    torchrun --nproc_per_node 2 benchmarks/probe_pool_rate.py OUT_PREFIX [LAYERS]
"""
import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from torchferry import Ferry
from torchferry._host_memory import host_page_report
from torchferry.bench._link import measure_link_peak
from torchferry.bench._model import build_model
from torchferry.bench._setup import init_distributed, shard_fsdp2

prefix = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else None
rank, world, dev = init_distributed(True)
peak = measure_link_peak(dev, barrier=dist.barrier)
model = build_model("qwen2.5-7b", dev, layers=layers)
shard_fsdp2(model, dev, world)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
batch = torch.randint(0, 1000, (1, 512), device=dev)
model(input_ids=batch, labels=batch).loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
mf, of = Ferry(model, device=dev, pin_ahead=False), Ferry(opt, device=dev, pin_ahead=False)
pin_s = [mf.reserve_host(), of.reserve_host()]


def coverage(ferry):
    buf = ferry._pool._buffer
    lo, hi = buf.tensor.data_ptr(), buf.tensor.data_ptr() + buf.nbytes
    huge = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head[0] in "0123456789abcdef" and "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < b
            elif inside and head == "AnonHugePages:":
                huge += int(line.split()[1]) * 1024
    return huge / buf.nbytes


res = {"rank": rank, "peak": peak.__dict__, "pin_s": pin_s, "bytes": [mf.state_bytes, of.state_bytes],
       "coverage": [coverage(mf), coverage(of)], "host_pages": host_page_report(), "cycles": []}
for i in range(4):
    row = {}
    for name, f in (("model", mf), ("opt", of)):
        dist.barrier(); torch.cuda.synchronize()
        t = time.perf_counter(); h = f.offload(); h.wait(); w = time.perf_counter() - t
        row[f"{name}_d2h"] = {"wall": w, "gpu": h.seconds, "GBps_gpu": f.state_bytes / h.seconds / 1e9}
    torch.cuda.empty_cache()
    time.sleep(0.5)
    for name, f in (("model", mf), ("opt", of)):
        dist.barrier(); torch.cuda.synchronize()
        t = time.perf_counter(); h = f.reload(); h.wait(); w = time.perf_counter() - t
        row[f"{name}_h2d"] = {"wall": w, "gpu": h.seconds, "GBps_gpu": f.state_bytes / h.seconds / 1e9}
    res["cycles"].append(row)

# The optimizer's storages into one torch pinned buffer (cudaHostAlloc), same copies, same run.
sts = []
for st in opt.state.values():
    for v in st.values():
        if torch.is_tensor(v) and v.device.type == "cuda":
            loc = v._local_tensor if hasattr(v, "_local_tensor") else v
            sts.append(loc.untyped_storage())
total = sum(s.nbytes() for s in sts)
host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
srcs = [torch.empty(0, dtype=torch.uint8, device=dev).set_(s) for s in sts]
offs, o = [], 0
for s in srcs:
    offs.append(o); o += s.numel()
torch_rates = {"d2h": [], "h2d": []}
for i in range(4):
    for kind in ("d2h", "h2d"):
        dist.barrier(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s, off in zip(srcs, offs):
            if kind == "d2h":
                host[off: off + s.numel()].copy_(s, non_blocking=True)
            else:
                s.copy_(host[off: off + s.numel()], non_blocking=True)
        b.record(); torch.cuda.synchronize()
        torch_rates[kind].append(total / (a.elapsed_time(b) / 1e3) / 1e9)
res["opt_into_torch_pinned_GBps"] = torch_rates
res["summary"] = {k: statistics.median(c[k]["GBps_gpu"] for c in res["cycles"][1:])
                  for k in res["cycles"][0]}
res["env"] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": world,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "torchrun --nproc_per_node 2 benchmarks/probe_pool_rate.py " + " ".join(sys.argv[1:])}
json.dump(res, open(f"{prefix}.rank{rank}.json", "w"), indent=1)
print(rank, json.dumps({"summary": res["summary"], "torch_pinned_opt": {k: max(v) for k, v in torch_rates.items()},
                        "coverage": res["coverage"], "pin_s": pin_s, "peak": res["peak"]}))
mf.close(); of.close()
dist.destroy_process_group()
