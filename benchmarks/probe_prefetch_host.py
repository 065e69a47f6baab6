"""Probe: where the host time of reload(prefetch=True) goes (cProfile), against a plain reload.
One GPU, FSDP2 over one rank, Qwen2.5-7B shapes with LAYERS decoder layers.

    python3 benchmarks/probe_prefetch_host.py OUT_PREFIX [LAYERS]
"""
import cProfile
import io
import json
import pstats
import sys
import time

import torch

from torchferry import Ferry, Prefetch
from torchferry.bench._model import build_model
from torchferry.bench._setup import init_distributed, shard_fsdp2

prefix = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rank, world, dev = init_distributed(True)
model = build_model("qwen2.5-7b", dev, layers=layers)
shard_fsdp2(model, dev, world)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
batch = torch.randint(0, 1000, (1, 1024), device=dev)
model(input_ids=batch, labels=batch).loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
mf, of = Ferry(model, device=dev), Ferry(opt, device=dev)
mf.reserve_host(), of.reserve_host()
out = {"seeds": []}
import torchferry._device_alloc as _da
_orig_seed = _da.ReloadArena.seed.__func__


def _seed(cls, device, sizes):
    st = torch.cuda.memory_stats(device)
    t = time.perf_counter()
    a = _orig_seed(cls, device, sizes)
    large = [n for n in sizes if n > (1 << 20)]
    out["seeds"].append({"arena": a is not None, "s": time.perf_counter() - t, "n_large": len(large),
                         "min_large": min(large) if large else None, "total": sum(large),
                         "cached_free": st.get("reserved_bytes.large_pool.current", 0) - st.get("allocated_bytes.large_pool.current", 0)})
    return a


_da.ReloadArena.seed = classmethod(_seed)
import torchferry._ferry, torchferry._prefetch
torchferry._ferry.ReloadArena = torchferry._prefetch.ReloadArena = _da.ReloadArena


def cycle(kind: str, profile: bool):
    mf.offload().wait(); of.offload().wait()
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    kv = torch.empty(mf.state_bytes + of.state_bytes, dtype=torch.uint8, device=dev); kv.fill_(1); del kv
    torch.cuda.empty_cache()
    time.sleep(0.5)
    torch.cuda.synchronize()
    pr = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if pr: pr.enable()
    if kind == "prefetch":
        h1 = mf.reload(prefetch=Prefetch()); h2 = of.reload(prefetch=Prefetch())
    else:
        h1 = mf.reload(); h2 = of.reload()
    if pr: pr.disable()
    call = time.perf_counter() - t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    mf.reload(); of.reload()
    torch.cuda.synchronize()
    gpu = [h1.seconds, h2.seconds]
    if pr:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        open(f"{prefix}.{kind}.prof.txt", "w").write(s.getvalue())
    return {"call_s": call, "wall_s": wall, "gpu_s": gpu}


for rep in range(2):
    for kind in ("prefetch", "plain"):
        out.setdefault(kind, []).append(cycle(kind, profile=(rep == 1)))
out["bytes"] = [mf.state_bytes, of.state_bytes]
json.dump(out, open(f"{prefix}.json", "w"), indent=1)
print(json.dumps(out))
