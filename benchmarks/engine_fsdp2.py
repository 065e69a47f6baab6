"""The engine on FSDP2 parameters at Qwen2.5 sizes, torchferry vs the seed, one run.

    torchrun --nproc_per_node 2 benchmarks/engine_fsdp2.py --preset qwen2.5-7b --json OUT.json

Per rank: the link peak (pinned 1 GiB copies, all ranks at once), then the
one-time pinning of the pool (``reserve_host``), then torchferry
offload/reload cycles (first and steady, host seconds from the call to
``handle.wait()``; ``empty_cache`` timed apart; ``--gap-s`` of idle host time
between ``empty_cache`` and the reload, as a rollout phase would leave),
a bit-exact check of every
parameter after every cycle, pinned host bytes against state bytes, GPU
memory released; then the seed's ``model.to(..., non_blocking=True)`` in the
same process for the ratio. Rank 0 writes one JSON with every rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _wall(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--seed-cycles", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=1.0,
                    help="host seconds between empty_cache and reload (a rollout phase lies there)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import torchferry
    from torchferry.bench._common.link import measure_link_peak, release_host_cache
    from torchferry.bench._common.model import build_model

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    peak = measure_link_peak(dev, barrier=dist.barrier)

    model = build_model(args.preset, dev, layers=args.layers)
    mesh = init_device_mesh("cuda", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 1000, (1, 256), device=dev)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = list(model.parameters())
    local = lambda p: p._local_tensor  # noqa: E731
    ref = [local(p).detach().clone() for p in params]
    state_bytes = sum(local(p).untyped_storage().nbytes() for p in params)

    def check():
        for a, p in zip(ref, params):
            assert torch.equal(a, local(p)), "round trip mismatch"

    res = {"rank": rank, "link_peak_GBps": {"h2d": peak.h2d, "d2h": peak.d2h, "bidir": peak.bidir},
           "state_bytes": state_bytes, "n_params": len(params), "torchferry": [], "seed": []}
    ferry = torchferry.Ferry(model)
    res["pool_pin_s"] = ferry.reserve_host()  # the one-time pinning, apart from the first offload
    for i in range(args.cycles):
        dist.barrier()
        torch.cuda.synchronize()
        reserved_on = torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        ferry.offload().wait()
        off_s = time.perf_counter() - t0
        empty_s, _ = _wall(torch.cuda.empty_cache)
        reserved_off = torch.cuda.memory_reserved(dev)
        pinned = all(local(p).is_pinned() for p in params)
        time.sleep(args.gap_s)
        dist.barrier()
        t0 = time.perf_counter()
        ferry.reload().wait()
        on_s = time.perf_counter() - t0
        check()
        res["torchferry"].append({
            "offload_s": off_s, "empty_cache_s": empty_s, "reload_s": on_s,
            "offload_GBps": ferry.state_bytes / off_s / 1e9, "reload_GBps": ferry.state_bytes / on_s / 1e9,
            "all_pinned": pinned, "gpu_bytes_released": reserved_on - reserved_off,
        })
        if rank == 0:
            print("torchferry", json.dumps(res["torchferry"][-1]), flush=True)
    res["torchferry_host_bytes"] = ferry.host_bytes
    res["torchferry_ferry_state_bytes"] = ferry.state_bytes
    ferry.close()

    # The seed (verl PR #7347), same process, after torchferry's pool is gone.
    release_host_cache()
    for i in range(args.seed_cycles):
        dist.barrier()
        d, _ = _wall(lambda: (model.to("cpu", non_blocking=True), torch.cuda.empty_cache()))
        pinned = all(local(p).is_pinned() for p in params)
        stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        time.sleep(args.gap_s)
        dist.barrier()
        h, _ = _wall(lambda: model.to(dev, non_blocking=True))
        check()
        res["seed"].append({"offload_s": d, "reload_s": h, "offload_GBps": state_bytes / d / 1e9,
                            "reload_GBps": state_bytes / h / 1e9, "all_pinned": pinned,
                            "pinned_host_bytes": stats.get("allocated_bytes.current")})
        if rank == 0:
            print("seed", json.dumps(res["seed"][-1]), flush=True)
    release_host_cache()

    allres = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        out = {
            "schema": "torchferry.engine/1",
            "env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": world,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": "torchrun --nproc_per_node %d %s" % (world, " ".join(sys.argv))},
            "preset": args.preset, "layers": args.layers, "ranks": allres, "summary": {},
        }
        for r in allres:
            tf = r["torchferry"][1:] or r["torchferry"]
            off = statistics.median(x["offload_GBps"] for x in tf)
            on = statistics.median(x["reload_GBps"] for x in tf)
            seed = r["seed"][1:] or r["seed"]
            out["summary"][f"rank{r['rank']}"] = {
                "state_bytes": r["state_bytes"],
                "host_bytes_over_state": r["torchferry_host_bytes"] / r["state_bytes"],
                "steady_offload_GBps": off, "steady_reload_GBps": on,
                "offload_frac_of_peak": off / r["link_peak_GBps"]["d2h"],
                "reload_frac_of_peak": on / r["link_peak_GBps"]["h2d"],
                "first_offload_s": r["torchferry"][0]["offload_s"],
                "pool_pin_s": r["pool_pin_s"], "pool_pin_GBps": r["torchferry_host_bytes"] / r["pool_pin_s"] / 1e9,
                "all_pinned": all(x["all_pinned"] for x in r["torchferry"]),
                "seed_steady_offload_GBps": statistics.median(x["offload_GBps"] for x in seed) if seed else None,
                "seed_steady_reload_GBps": statistics.median(x["reload_GBps"] for x in seed) if seed else None,
                "seed_first_offload_s": r["seed"][0]["offload_s"] if r["seed"] else None,
                "seed_pinned_host_bytes_over_state": (r["seed"][-1]["pinned_host_bytes"] or 0) / r["state_bytes"] if r["seed"] else None,
            }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out["summary"], indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
