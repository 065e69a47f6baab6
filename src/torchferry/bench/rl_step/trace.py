"""A PyTorch profiler trace of one bench step: torchferry's ranges next to the GPU's copies and kernels.

``torchferry bench --trace PREFIX`` profiles the last step of each
``torchferry*`` strategy on rank 0 and writes ``PREFIX.<strategy>.json.gz``
(Chrome / Perfetto trace), ``PREFIX.<strategy>.summary.json`` (the
``torchferry::d2h`` / ``torchferry::h2d`` ranges with their bytes, the
memcpy activity on the GPU, merged kernel busy spans) and
``PREFIX.<strategy>.png`` (that summary as a timeline). The resident
baseline's step is profiled too (``PREFIX.resident.*``), so each phase's
kernels can be compared with the same phase run with nothing in flight
(``phases`` in the summary: kernel seconds per kind, the compute stream's idle
time, CUDA runtime calls; see :func:`phase_breakdown`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["phase_breakdown", "plot_trace", "profile_step", "summarise_trace", "trace_paths", "write_trace"]

_SUFFIXES = (".json.gz", ".summary.json", ".png")


def trace_paths(prefix: str) -> list[str]:
    """The files :func:`write_trace` writes for ``prefix``: trace, summary, PNG."""
    return [prefix + s for s in _SUFFIXES]


def profile_step(fn):
    """Runs ``fn()`` under ``torch.profiler.profile`` (CPU and CUDA); returns ``(result, profiler)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=False) as prof:
        out = fn()
    return out, prof


def _merge(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def summarise_trace(trace: dict) -> dict:
    """Condenses a Chrome trace (``export_chrome_trace`` JSON) to what the transfers did.

    Returns:
        ``{"ranges": [...], "memcpy": [...], "kernel_busy": [...], "totals": {...}}``:
        ``ranges`` are the CPU-side ``torchferry::*`` record_function ranges
        (``name``, ``bytes``, ``start_s``, ``dur_s``); ``memcpy`` the GPU copies
        (``kind``: ``HtoD`` / ``DtoH`` / other, ``bytes``, ``start_s``,
        ``dur_s``); ``kernel_busy`` the spans where kernels ran (merged over
        gaps < 50 us). Times in seconds from the first event.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    if not events:
        return {"ranges": [], "memcpy": [], "kernel_busy": [], "totals": {}}
    t0 = min(float(e["ts"]) for e in events)
    ranges, memcpy, kernels, labels = [], [], [], []
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        start, dur = (float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0)) / 1e6
        args = e.get("args", {}) or {}
        if name.startswith("torchferry::") and cat in ("user_annotation", "cpu_op"):
            if " bytes=" in name:  # the nested range naming the bytes of its parent
                labels.append((start, start + dur, int(name.rsplit("=", 1)[1])))
            else:
                ranges.append({"name": name, "bytes": None, "start_s": start, "dur_s": dur})
        elif cat == "gpu_memcpy":
            kind = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else name
            memcpy.append({"kind": kind, "bytes": args.get("bytes"), "start_s": start, "dur_s": dur})
        elif cat == "kernel":
            kernels.append((start, start + dur, name, args.get("stream")))
    for r in ranges:
        for s, e, nbytes in labels:
            if r["start_s"] <= s and e <= r["start_s"] + r["dur_s"] + 1e-9:
                r["bytes"] = nbytes
                break
    busy = _merge([(s, e) for s, e, _, _ in kernels], 50e-6)
    totals = {}
    for kind in ("HtoD", "DtoH"):
        cps = [m for m in memcpy if m["kind"] == kind]
        nbytes = sum(m["bytes"] or 0 for m in cps)
        secs = sum(m["dur_s"] for m in cps)
        totals[kind] = {"copies": len(cps), "bytes": nbytes, "gpu_s": secs,
                        "GBps": nbytes / secs / 1e9 if secs else None}
    totals["kernel_busy_s"] = sum(e - s for s, e in busy)
    return {"ranges": ranges, "memcpy": memcpy, "kernel_busy": [{"start_s": s, "dur_s": e - s} for s, e in busy],
            "totals": totals, "phases": phase_breakdown(events, t0, kernels, memcpy)}


_KINDS = (("nccl", ("nccl",)), ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma")),
          ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")), ("other", ("",)))
_RUNTIME = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
            "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMemcpyAsync")


def _kind(name: str) -> str:
    low = name.lower()
    return next(k for k, keys in _KINDS if any(key in low for key in keys))


def phase_breakdown(events: list[dict], t0: float, kernels: list[tuple], memcpy: list[dict]) -> list[dict]:
    """Per ``bench::<phase>::<kind>`` range (the bench's clock, ``workload``): what the GPU did in it.

    A kernel or copy belongs to the range it starts in. Per range: ``wall_s``;
    ``kernel_s`` (summed kernel seconds by kind: ``nccl``, ``gemm``,
    ``attention``, ``other``) and ``kernels`` (their counts); ``compute_stream``
    (the stream with the most non-NCCL kernel seconds) with its ``busy_s``
    (merged over gaps < 5 us) and ``idle_s`` (``wall_s - busy_s``: where it
    waited, for copies, collectives or the host); ``h2d_GB`` / ``d2h_GB`` and
    their copy seconds; ``runtime``: per CUDA runtime call in ``_RUNTIME``,
    ``[count, seconds]`` on the host; ``host_ops``: the ten CPU ops and ranges
    with the most host seconds (nested ones counted in each). Seconds throughout.
    """
    spans = []
    for e in events:
        name = e.get("name", "")
        if name.startswith("bench::") and e.get("cat") in ("user_annotation", "cpu_op"):
            start = (float(e["ts"]) - t0) / 1e6
            spans.append((name, start, start + float(e.get("dur", 0)) / 1e6))
    runtime = [((float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0)) / 1e6, e.get("name", ""))
               for e in events if e.get("cat") == "cuda_runtime" and e.get("name", "") in _RUNTIME]
    ops = [((float(e["ts"]) - t0) / 1e6, float(e.get("dur", 0)) / 1e6, e.get("name", ""))
           for e in events
           if e.get("cat") in ("cpu_op", "user_annotation") and not e.get("name", "").startswith("bench::")]
    out = []
    for name, start, end in sorted(spans, key=lambda x: x[1]):
        inside = [k for k in kernels if start <= k[0] < end]
        kernel_s = {k: 0.0 for k, _ in _KINDS}
        counts = {k: 0 for k, _ in _KINDS}
        per_stream: dict = {}
        for s, e, kname, stream in inside:
            kind = _kind(kname)
            kernel_s[kind] += e - s
            counts[kind] += 1
            if kind != "nccl":
                per_stream.setdefault(stream, []).append((s, e))
        stream = max(per_stream, key=lambda st: sum(e - s for s, e in per_stream[st]), default=None)
        busy = sum(e - s for s, e in _merge(per_stream.get(stream, []), 5e-6))
        row = {"name": name, "start_s": start, "wall_s": end - start, "kernel_s": kernel_s, "kernels": counts,
               "compute_stream": stream, "busy_s": busy, "idle_s": (end - start) - busy, "runtime": {}}
        for kind, key in (("HtoD", "h2d"), ("DtoH", "d2h")):
            cps = [m for m in memcpy if m["kind"] == kind and start <= m["start_s"] < end]
            row[f"{key}_GB"] = sum(m["bytes"] or 0 for m in cps) / 1e9
            row[f"{key}_s"] = sum(m["dur_s"] for m in cps)
        for ts, dur, rname in runtime:
            if start <= ts < end:
                c = row["runtime"].setdefault(rname, [0, 0.0])
                c[0] += 1
                c[1] += dur
        host: dict[str, list] = {}
        for ts, dur, oname in ops:
            if start <= ts < end:
                c = host.setdefault(oname, [0, 0.0])
                c[0] += 1
                c[1] += dur
        row["host_ops"] = dict(sorted(host.items(), key=lambda kv: -kv[1][1])[:10])
        out.append(row)
    return out


def write_trace(prof, prefix: str) -> dict:
    """Writes the files of :func:`trace_paths` (``prefix.json.gz``, ``.summary.json``, ``.png``).

    Returns:
        The summary (see :func:`summarise_trace`).

    Raises:
        OSError: a file could not be written.
    """
    trace_gz, summary_json, png = trace_paths(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace_gz, "wb") as g:
            shutil.copyfileobj(f, g)
        with open(raw) as f:
            summary = summarise_trace(json.load(f))
    with open(summary_json, "w") as f:
        json.dump(summary, f, indent=1)
    plot_trace(summary, png)
    return summary


def plot_trace(summary: dict, path: str) -> None:
    """A timeline PNG of a :func:`summarise_trace` summary (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [("CPU: torchferry ranges", "#444444"), ("GPU: H2D copies", "#1f77b4"),
             ("GPU: D2H copies", "#ff7f0e"), ("GPU: kernels", "#2ca02c")]
    fig, ax = plt.subplots(figsize=(12, 3.2), dpi=110)
    rows = [
        [(r["start_s"], r["dur_s"]) for r in summary["ranges"]],
        [(m["start_s"], m["dur_s"]) for m in summary["memcpy"] if m["kind"] == "HtoD"],
        [(m["start_s"], m["dur_s"]) for m in summary["memcpy"] if m["kind"] == "DtoH"],
        [(k["start_s"], k["dur_s"]) for k in summary["kernel_busy"]],
    ]
    for y, ((_label, color), spans) in enumerate(zip(lanes, rows, strict=False)):
        ax.broken_barh(spans, (len(lanes) - 1 - y - 0.35, 0.7), facecolors=color)
    most = max((r["bytes"] or 0 for r in summary["ranges"]), default=0)
    big = [r for r in summary["ranges"] if (r["bytes"] or 0) >= 0.2 * most > 0]  # per-unit ranges: unlabelled
    for i, r in enumerate(big):
        label = f"{r['name'].split('::')[-1]} {r['bytes'] / 1e9:.2f} GB"
        ax.annotate(label, (r["start_s"], len(lanes) - 1 + 0.4 + 0.25 * (i % 2)), fontsize=7)
    ax.set_yticks(range(len(lanes)), [lab for lab, _ in reversed(lanes)])
    ax.set_ylim(-0.6, len(lanes) + 0.2)
    ax.set_xlabel("seconds (one bench step, rank 0; PyTorch profiler)")
    tot = summary.get("totals", {})
    parts = [f"{k}: {v['bytes'] / 1e9:.2f} GB in {v['gpu_s']:.3f} s GPU time"
             for k, v in tot.items() if isinstance(v, dict) and v.get("bytes")]
    ax.set_title("torchferry transfers in a profiler trace" + (" (" + "; ".join(parts) + ")" if parts else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
