"""Switch points on one GPU: bulk copy rate and the wait of a small copy on the default stream,
for each piece size and separator ([Note: switch points] in ``torchferry._core._transfer.switch``).

    PYTHONPATH=src python benchmarks/switch_points.py --json switch_points.json

Per direction (H2D, D2H): an 8 GiB copy between pinned host memory and the device on a stream of
its own, whole or in pieces (a 1 KiB or 512 B copy of the piece's first bytes again, or a
one-element kernel, after each), 3 rounds interleaved; meanwhile 20 copies of 34 KiB on the
default stream, 5 ms apart, timed with events. Reports the best rate (GB/s = 1e9 B/s) and the
small copies' p50/p90 (ms).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from torchferry.bench._common.latency import SmallCopyProbe, percentiles

N = 8 << 30
MiB = 1 << 20
VARIANTS = [(0, "none"), (64 * MiB, "none"), (16 * MiB, "none"), (8 * MiB, "copy1k"), (16 * MiB, "copy1k"),
            (24 * MiB, "copy1k"), (32 * MiB, "copy1k"), (16 * MiB, "copy512"), (16 * MiB, "kernel"),
            (32 * MiB, "kernel")]


def _bulk(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, piece: int, sep: str,
          one: torch.Tensor) -> None:
    with torch.cuda.stream(stream):
        if not piece:
            dst.copy_(src, non_blocking=True)
            return
        for o in range(0, N, piece):
            dst[o:o + piece].copy_(src[o:o + piece], non_blocking=True)
            if sep.startswith("copy"):
                k = 1024 if sep == "copy1k" else 512
                dst[o:o + k].copy_(src[o:o + k], non_blocking=True)
            elif sep == "kernel":
                one.add_(1)


def measure(direction: str, rounds: int = 3) -> dict:
    dev = torch.device("cuda")
    host = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    devb = torch.empty(N, dtype=torch.uint8, device=dev)
    dst, src = (devb, host) if direction == "h2d" else (host, devb)
    one, stream, probe = torch.zeros(1, device=dev), torch.cuda.Stream(), SmallCopyProbe(dev, direction)
    raw: dict[str, dict[str, list[float]]] = {f"{p // MiB}MiB-{s}": {"s": [], "ms": []} for p, s in VARIANTS}
    for _ in range(rounds):
        for piece, sep in VARIANTS:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            _bulk(dst, src, stream, piece, sep, one)
            e1.record(stream)
            t0 = time.perf_counter()
            for k in range(20):
                while time.perf_counter() < t0 + 0.002 + k * 0.005:
                    pass
                probe.issue(torch.cuda.default_stream(dev))
            r = raw[f"{piece // MiB}MiB-{sep}"]
            r["ms"] += probe.collect()
            r["s"].append(e0.elapsed_time(e1) / 1e3)
    del host, devb
    torch.cuda.empty_cache()
    return {k: {"GBps_best": N / min(v["s"]) / 1e9, "seconds": v["s"], "small_copy_ms": percentiles(v["ms"])}
            for k, v in raw.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "commit": os.environ.get("TORCHFERRY_COMMIT", "unknown"),
           "command": "PYTHONPATH=src python benchmarks/switch_points.py --json " + args.json,
           "bytes": N, "results": {d: measure(d) for d in ("h2d", "d2h")}}
    for d, res in out["results"].items():
        for k, v in res.items():
            print(f"{d} {k:>14}: {v['GBps_best']:5.1f} GB/s, small copy p50 {v['small_copy_ms']['p50']:.4f} ms "
                  f"p90 {v['small_copy_ms']['p90']:.4f} ms")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
