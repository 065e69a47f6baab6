"""Probe: host cost of device allocations after empty_cache (arena vs none), one GPU."""
import json, os, sys, time
import torch
from torchferry._device_alloc import arena_supported, ReloadArena
dev = torch.device("cuda", 0)
torch.ones(1, device=dev)
info = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF"),
        "backend": torch.cuda.memory.get_allocator_backend(), "arena_supported": arena_supported(),
        "allocator_settings": getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: None)() if False else None}
n, k = 40 << 20, 300
def run(arena):
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    sts = [torch.UntypedStorage(0, device=dev) for _ in range(k)]
    t = time.perf_counter()
    a = ReloadArena.seed(dev, [n] * k) if arena else None
    t1 = time.perf_counter()
    for s in sts: s.resize_(n)
    t2 = time.perf_counter()
    if a: a.seal()
    r = {"seed_s": t1 - t, "resize_s": t2 - t1, "arena": a is not None, "reserved": torch.cuda.memory_reserved(dev)}
    del sts; torch.cuda.synchronize(); torch.cuda.empty_cache()
    t = time.perf_counter(); x = torch.empty(n * k, dtype=torch.uint8, device=dev); r["empty_one_s"] = time.perf_counter() - t
    t = time.perf_counter(); x.fill_(1); torch.cuda.synchronize(); r["first_fill_s"] = time.perf_counter() - t
    t = time.perf_counter(); x.fill_(2); torch.cuda.synchronize(); r["second_fill_s"] = time.perf_counter() - t
    del x
    return r
res = {"info": info, "runs": [run(a) for a in (True, False, True, False)]}
json.dump(res, open(sys.argv[1], "w"), indent=1); print(json.dumps(res))
