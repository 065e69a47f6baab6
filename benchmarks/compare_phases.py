"""Prints the per-phase breakdown of ``torchferry bench --trace PREFIX`` side by side (issue 17):
each strategy's compute phases against the resident baseline's. Usage:
``python3 benchmarks/compare_phases.py PREFIX [OUT.json]``."""
import json
import sys
from pathlib import Path

prefix = sys.argv[1]
rows = {}
for name in ("resident", "torchferry", "torchferry-prefetch"):
    path = Path(f"{prefix}.{name}.summary.json")
    if path.exists():
        rows[name] = {p["name"]: p for p in json.loads(path.read_text())["phases"]}
out = {}
for phase in next(iter(rows.values()), {}):
    print(f"\n== {phase}")
    for name, phases in rows.items():
        p = phases.get(phase)
        if p is None:
            continue
        k, rt = p["kernel_s"], p["runtime"]
        mal = rt.get("cudaMalloc", [0, 0.0])
        print(f"  {name:20s} wall {p['wall_s']:.3f} busy {p['busy_s']:.3f} idle {p['idle_s']:.3f} | "
              f"gemm {k['gemm']:.3f} attn {k['attention']:.3f} nccl {k['nccl']:.3f} other {k['other']:.3f} | "
              f"cudaMalloc {mal[0]} {mal[1]:.3f}s | h2d {p['h2d_GB']:.1f} GB {p['h2d_s']:.3f}s d2h {p['d2h_GB']:.1f} GB")
        top = ", ".join(f"{n} {c}x {t:.3f}" for n, (c, t) in list(p["host_ops"].items())[:5])
        print(f"  {'':20s} host: {top}")
        out.setdefault(phase, {})[name] = p
if len(sys.argv) > 2:
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
