"""Probe: where does reload time go after empty_cache? (allocation vs copies). One GPU.

    python3 benchmarks/probe_reload.py OUT.json
"""
import json, statistics, sys, time

import torch

import torchferry
from torchferry.bench._link import measure_link_peak
from torchferry.bench._model import build_model


def wall(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
    return time.perf_counter() - t


dev = torch.device("cuda", 0)
peak = measure_link_peak(dev)
model = build_model("qwen2.5-7b", dev, layers=int(sys.argv[2]) if len(sys.argv) > 2 else 14)
ferry = torchferry.Ferry(model)
ferry.offload().wait(); ferry.reload().wait()
import datetime
res = {"env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": 1,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "python3 " + " ".join(sys.argv)},
       "model": "qwen2.5-7b sizes, unsharded, fp32, %s layers" % (sys.argv[2] if len(sys.argv) > 2 else 14),
       "peak": peak.__dict__, "state_bytes": ferry.state_bytes, "runs": {}}
plan_storages = None


def rec(name, t):
    res["runs"].setdefault(name, []).append(t)


for rep in range(4):
    # A: as shipped, after empty_cache
    ferry.offload().wait(); torch.cuda.empty_cache()
    rec("A_reload_after_empty_cache", wall(lambda: ferry.reload().wait()))
    # B: blocks still cached
    ferry.offload().wait()
    rec("B_reload_cached_blocks", wall(lambda: ferry.reload().wait()))
    # C: one arena allocation first
    ferry.offload().wait(); torch.cuda.empty_cache()
    st = ferry._offloaded.plan.storages; nb = ferry._offloaded.plan.nbytes
    big = sum((n + 511) // 512 * 512 for n in nb if n > (1 << 20))

    def arena_reload():
        a = torch.empty(big, dtype=torch.uint8, device=dev); del a
        ferry.reload().wait()
    rec("C_reload_arena_first", wall(arena_reload))
    # A2: after empty_cache, then 1 s idle (a rollout phase lies between in training)
    ferry.offload().wait(); torch.cuda.empty_cache(); time.sleep(1.0)
    rec("A2_reload_after_empty_cache_and_1s", wall(lambda: ferry.reload().wait()))
    # F: arena allocated and zeroed on the compute stream first (pre-touch), then reload
    ferry.offload().wait(); torch.cuda.empty_cache()

    def arena_touch_reload():
        a = torch.empty(big, dtype=torch.uint8, device=dev); a.zero_(); del a
        ferry.reload().wait()
    rec("F_reload_arena_zeroed_first", wall(arena_touch_reload))
    ferry.offload().wait(); torch.cuda.empty_cache()

    def arena_touch_only():
        a = torch.empty(big, dtype=torch.uint8, device=dev); a.zero_(); del a
    rec("F_arena_zero_only", wall(arena_touch_only))
    torch.cuda.empty_cache()
    # G: fresh memory written by the copy engine from the host vs by a kernel (D2D from cached)
    def fresh_h2d():
        a = torch.empty(big, dtype=torch.uint8, device=dev)
        a[: ferry._pool.nbytes if ferry._pool.nbytes < big else big].copy_(ferry._pool._buffer.tensor[: min(big, ferry._pool.nbytes)], non_blocking=True)
    rec("G_one_h2d_into_fresh", wall(fresh_h2d))
    rec("G_one_h2d_into_cached", wall(fresh_h2d))
    torch.cuda.empty_cache()
    ferry.reload().wait()
    # D: allocation only (resize loop) after empty_cache; and one cudaMalloc of the total
    ferry.offload().wait(); torch.cuda.empty_cache()
    rec("D_resize_loop_only", wall(lambda: [s.resize_(n) for s, n in zip(st, nb)]))
    for s in st:
        s.resize_(0)
    torch.cuda.empty_cache()
    rec("D_one_malloc_total", wall(lambda: torch.empty(big, dtype=torch.uint8, device=dev)))
    torch.cuda.empty_cache()
    # E: copies only, storages pre-allocated, timed by events
    for s, n in zip(st, nb):
        s.resize_(n)
    slots = ferry._offloaded.slots
    dsts = [torch.empty(0, dtype=torch.uint8, device=dev).set_(s) for s in st]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); e0.record()
    for d, sl in zip(dsts, slots):
        if d.numel():
            d.copy_(sl, non_blocking=True)
    e1.record(); torch.cuda.synchronize()
    rec("E_copies_only_events", e0.elapsed_time(e1) / 1e3)
    del dsts
    for s in st:
        s.resize_(0)
    ferry.reload().wait()

out = {k: {"median_s": statistics.median(v), "all": v, "GBps": ferry.state_bytes / statistics.median(v) / 1e9} for k, v in res["runs"].items()}
res["summary"] = out
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps({"peak": res["peak"], "state": ferry.state_bytes, **{k: [round(v["median_s"], 4), round(v["GBps"], 1)] for k, v in out.items()}}, indent=1))
