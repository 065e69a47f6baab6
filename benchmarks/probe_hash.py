"""The content hash of [Note: unchanged storages] against the D2H copy it saves, on one GPU.

Measures, over the same bytes: the fused Triton hash (``_hash_triton``; one launch), the torch-op
hash (``_hash.hash_bytes``), and a D2H copy into pinned memory; also the Triton hash of many small
storages in one launch (a 7B model under FSDP2 has ~300). Medians of CUDA-event times after a
warm-up; GB/s = 1e9 B/s of hashed (or copied) bytes.

    PYTHONPATH=src python3 benchmarks/probe_hash.py OUT.json [--gib 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch


def _time(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON results path")
    ap.add_argument("--gib", type=float, default=8.0, help="GiB hashed and copied (default 8)")
    args = ap.parse_args()
    from torchferry._hash import hash_bytes
    from torchferry._hash_triton import hash_segments

    dev = torch.device("cuda")
    n = int(args.gib * 2**30)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    small = [torch.randint(0, 256, (s,), dtype=torch.uint8, device=dev) for s in [3 << 20] * 280 + [5000] * 20]
    small_bytes = sum(t.numel() for t in small)
    triton_s = _time(lambda: hash_segments([buf.data_ptr()], [n], dev))
    torch_s = _time(lambda: hash_bytes(buf), reps=3)
    copy_s = _time(lambda: host.copy_(buf, non_blocking=True), reps=3)
    many_s = _time(lambda: hash_segments([t.data_ptr() for t in small], [t.numel() for t in small], dev))
    result = {
        "env": {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python3", *sys.argv])},
        "bytes": n,
        "triton_hash": {"seconds": triton_s, "GBps": n / triton_s / 1e9},
        "torch_op_hash": {"seconds": torch_s, "GBps": n / torch_s / 1e9},
        "d2h_copy_pinned": {"seconds": copy_s, "GBps": n / copy_s / 1e9},
        "triton_hash_over_copy": triton_s / copy_s,
        "triton_hash_300_storages": {"storages": len(small), "bytes": small_bytes, "seconds": many_s,
                                     "GBps": small_bytes / many_s / 1e9},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
