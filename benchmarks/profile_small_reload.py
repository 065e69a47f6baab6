"""Where the host time of a reload of many small tensors goes (``torchferry bench-pin``'s case).

``bench-pin`` on an H200 (commit 9b9d6b0): 4096 x 256 KiB reload at 0.698 of the link peak,
27.6-28.0 ms against 19.5 ms of DMA, host-bound. This times the phases of that reload (wall
clock around each phase's function, no syncs added) over ``--cycles`` offload/reload cycles
and writes ``OUT.json``: the reload's seconds (median, min, max, with the copies waited for)
and ``phases_ms``, mean host milliseconds per reload.

    python benchmarks/profile_small_reload.py OUT.json [--tensors 4096] [--kib 256] [--cycles 10] [--offload]

With ``--offload``, the offload's phases instead (``offload().wait()`` timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from profile_lora_offload import time_phases
from torchferry import Ferry
from torchferry.bench._setup import env_record

PHASES = (
    ("torchferry._ferry", "Ferry._replaced_while_offloaded"),
    ("torchferry._targets", "Targets.ids"),
    ("torchferry._ferry", "moved_away"),
    ("torchferry._whole", "StateSet.issue_reload"),
    ("torchferry._copies", "unpack_from_host"),
    ("torchferry._repoint", "Parking.to_device"),
    ("torchferry._whole", "StateSet.reloaded"),
    ("torchferry._guards", "OffloadGuards.remove"),
    ("torchferry._ferry", "Ferry.reload"),
)


OFFLOAD_PHASES = (
    ("torchferry._targets", "Targets.resharded"),
    ("torchferry._whole", "fingerprint"),
    ("torchferry._whole", "issue_d2h"),
    ("torchferry._copies", "pack_to_host"),
    ("torchferry._repoint", "Parking.to_host"),
    ("torchferry._guards", "OffloadGuards.install"),
    ("torchferry._ferry", "release"),
    ("torchferry._ferry", "Ferry.offload"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tensors", type=int, default=4096)
    ap.add_argument("--kib", type=int, default=256)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--offload", action="store_true", help="time the offload's phases instead (copies waited for)")
    a = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ts = [torch.randn(a.kib * 256, device=device) for _ in range(a.tensors)]
    ferry = Ferry(*ts, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        ferry.offload()
        ferry.reload()
    record = time_phases(OFFLOAD_PHASES, "Ferry.offload") if a.offload else time_phases(PHASES, "Ferry.reload")
    secs = []
    for _ in range(a.cycles):
        if a.offload:
            sync()
            t0 = time.perf_counter()
            ferry.offload().wait()
            secs.append(time.perf_counter() - t0)
            ferry.reload()
            continue
        ferry.offload()
        sync()
        t0 = time.perf_counter()
        ferry.reload()
        sync()
        secs.append(time.perf_counter() - t0)
    phases_ms = {k: 1e3 * sum(v) / a.cycles for k, v in record.items()}
    nbytes = ferry.state_bytes
    what = "offload" if a.offload else "reload"
    result = {"env": env_record(device, 1), "tensors": a.tensors, "bytes": nbytes,
              f"{what}_s": {"median": statistics.median(secs), "min": min(secs), "max": max(secs), "all": secs},
              f"{what}_GBps": nbytes / statistics.median(secs) / 1e9, "phases_ms": phases_ms}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    ferry.close()


if __name__ == "__main__":
    main()
