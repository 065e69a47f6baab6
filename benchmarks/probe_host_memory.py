"""Probe: which host allocation reaches the link peak on this host, and why (issue 17, part 5).

Variants of the same bytes, their DMA rates measured round-robin (order effects
cancel) on one GPU:
  torch_pinned  torch.empty(pin_memory=True): PyTorch's caching host allocator, cudaHostAlloc
  cuda_host_alloc  cudaHostAlloc of the exact size, through ctypes
  pool          torchferry's HostBuffer: mmap, MADV_HUGEPAGE, touched by threads, cudaHostRegister
  pool_nohuge   the same with MADV_NOHUGEPAGE
For mmap'ed variants, the huge-page coverage of the mapping (AnonHugePages of its VMA in
/proc/self/smaps). Also the THP settings and the small-tensor offload/reload split into host
issue time and completion.

    python3 benchmarks/probe_host_memory.py OUT.json [GiB]
"""
import ctypes
import datetime
import json
import mmap
import statistics
import sys
import time

import torch

from torchferry import Ferry
from torchferry._host_memory import HostBuffer, _touch
from torchferry.bench._link import measure_link_peak

dev = torch.device("cuda", 0)
torch.cuda.init()
nbytes = int(float(sys.argv[2]) * 2**30) if len(sys.argv) > 2 else 2 << 30


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def smaps_coverage(ptr: int) -> dict:
    """Rss and AnonHugePages (bytes) of the VMA holding ``ptr``."""
    out, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= ptr < hi
                if inside:
                    out["vma_bytes"] = hi - lo
            elif inside and head[0] in ("Rss:", "AnonHugePages:"):
                out[head[0][:-1]] = int(head[1]) * 1024
    return out


def cudart_lib():
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    return ctypes.CDLL("libcudart.so")


class Variant:
    def __init__(self, name, make):
        self.name = name
        t = time.perf_counter()
        self.host, self.extra = make()
        self.alloc_s = time.perf_counter() - t
        self.h2d, self.d2h = [], []


def make_torch():
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1), {}


_cudart = None


def make_cha():
    global _cudart
    _cudart = _cudart or cudart_lib()
    p = ctypes.c_void_p()
    rc = _cudart.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(nbytes), ctypes.c_uint(1))
    assert rc == 0, rc
    arr = (ctypes.c_uint8 * nbytes).from_address(p.value)
    t = torch.frombuffer(arr, dtype=torch.uint8)
    _touch(t)
    return t, {"ptr": p.value, "smaps": smaps_coverage(p.value)}


def make_pool():
    b = HostBuffer(nbytes, pin_bytes=nbytes, device=0)
    return b.tensor, {"keep": b, "smaps": smaps_coverage(b.tensor.data_ptr())}


def make_nohuge():
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    _touch(t)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1)
    return t, {"keep": mm, "rc": int(rc[0] if isinstance(rc, tuple) else rc), "smaps": smaps_coverage(t.data_ptr())}


peak = measure_link_peak(dev)
variants = [Variant(n, f) for n, f in (("torch_pinned", make_torch), ("cuda_host_alloc", make_cha),
                                       ("pool", make_pool), ("pool_nohuge", make_nohuge))]
gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(2)


def timed(fn):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3


for v in variants:  # warm-up
    gpu.copy_(v.host, non_blocking=True)
    v.host.copy_(gpu, non_blocking=True)
for rep in range(6):
    for v in variants if rep % 2 == 0 else variants[::-1]:
        v.h2d.append(nbytes / timed(lambda: gpu.copy_(v.host, non_blocking=True)) / 1e9)
        v.d2h.append(nbytes / timed(lambda: v.host.copy_(gpu, non_blocking=True)) / 1e9)
res = {}
for v in variants:
    res[v.name] = {"alloc_s": v.alloc_s, "h2d_GBps_max": max(v.h2d), "h2d_GBps_median": statistics.median(v.h2d),
                   "d2h_GBps_max": max(v.d2h), "d2h_GBps_median": statistics.median(v.d2h),
                   "h2d_all": v.h2d, "d2h_all": v.d2h,
                   **{k: x for k, x in v.extra.items() if k != "keep"}}
del variants, gpu
torch.cuda.empty_cache()

# Small tensors: where the host time of offload()/reload() goes.
count, each = 4096, 256 << 10
ts = [torch.randint(0, 2**31 - 1, (each // 4,), device=dev, dtype=torch.int32) for _ in range(count)]
ferry = Ferry(*ts)
ferry.reserve_host()
small = {"offload_call_s": [], "offload_wall_s": [], "offload_gpu_s": [],
         "reload_call_s": [], "reload_wall_s": [], "reload_gpu_s": []}
for i in range(8):
    for kind, fn in (("offload", ferry.offload), ("reload", ferry.reload)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = fn()
        c = time.perf_counter() - t
        h.wait()
        w = time.perf_counter() - t
        if i >= 2:
            small[f"{kind}_call_s"].append(c)
            small[f"{kind}_wall_s"].append(w)
            small[f"{kind}_gpu_s"].append(h.seconds)
small = {k: {"median": statistics.median(x), "all": x} for k, x in small.items()}
small["bytes"] = count * each
ferry.close()

json.dump({"env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "command": "python3 " + " ".join(sys.argv),
                   "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
                   "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
                   "meminfo_huge": [ln for ln in read("/proc/meminfo").splitlines() if "Huge" in ln],
                   "cpus": torch.get_num_threads()},
           "bytes": nbytes, "link_peak_GBps": peak.__dict__, "variants": res, "small_tensors": small},
          open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: (v["h2d_GBps_max"], v["d2h_GBps_max"], v["alloc_s"], v.get("smaps")) for k, v in res.items()}))
print(json.dumps({k: v["median"] for k, v in small.items() if isinstance(v, dict)}), peak)
