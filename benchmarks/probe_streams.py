"""Probe: does splitting reload copies over several H2D streams (copy engines) avoid the
slowdown right after empty_cache? One GPU.  python3 benchmarks/probe_streams.py OUT.json"""
import datetime, json, statistics, sys, time

import torch

import torchferry
from torchferry.bench._link import measure_link_peak
from torchferry.bench._model import build_model

dev = torch.device("cuda", 0)
peak = measure_link_peak(dev)
model = build_model("qwen2.5-7b", dev, layers=28)
ferry = torchferry.Ferry(model)
ferry.offload().wait(); ferry.reload().wait()
streams = [torch.cuda.Stream() for _ in range(4)]


def wall(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return time.perf_counter() - t


def reload_split(k):
    off = ferry._offloaded
    st, nb, slots = off.plan.storages, off.plan.nbytes, off.slots
    cur = torch.cuda.current_stream()
    for s in streams[:k]:
        s.wait_stream(cur)
    load = [0] * k
    for s, n, sl in zip(st, nb, slots):
        s.resize_(n)
        if not n:
            continue
        i = min(range(k), key=load.__getitem__)
        load[i] += n
        with torch.cuda.stream(streams[i]):
            torch.empty(0, dtype=torch.uint8, device=dev).set_(s).copy_(sl, non_blocking=True)
    for s in streams[:k]:
        cur.wait_stream(s)
    for s in st:  # hand back to the ferry: pretend nothing happened
        pass
    torch.cuda.synchronize()


res = {"env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": 1,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "python3 " + " ".join(sys.argv)}, "peak": peak.__dict__,
       "state_bytes": ferry.state_bytes, "runs": {}}
for rep in range(3):
    for k in (1, 2, 4):
        for idle in (0.0, 1.0):
            ferry.offload().wait(); torch.cuda.empty_cache(); time.sleep(idle)
            t = wall(lambda: reload_split(k))
            res["runs"].setdefault(f"streams{k}_idle{idle}", []).append(t)
            # restore ferry state: storages are full again; copy back is a no-op reload
            for s in ferry._offloaded.plan.storages:
                s.resize_(0)
            ferry.reload().wait()
    # bidirectional pinned copies split over streams, for the peak
summary = {k: {"median_s": statistics.median(v), "GBps": ferry.state_bytes / statistics.median(v) / 1e9,
               "frac_h2d_peak": ferry.state_bytes / statistics.median(v) / 1e9 / peak.h2d} for k, v in res["runs"].items()}
res["summary"] = summary
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: [round(v["median_s"], 4), round(v["GBps"], 1), round(v["frac_h2d_peak"], 3)] for k, v in summary.items()}, indent=1))
