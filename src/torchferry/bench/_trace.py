"""A PyTorch profiler trace of one bench step: torchferry's ranges next to the GPU's copies and kernels.

``torchferry bench --trace PREFIX`` profiles the last step of each
``torchferry*`` strategy on rank 0 and writes ``PREFIX.<strategy>.json.gz``
(Chrome / Perfetto trace), ``PREFIX.<strategy>.summary.json`` (the
``torchferry::d2h`` / ``torchferry::h2d`` ranges with their bytes, the
memcpy activity on the GPU, merged kernel busy spans) and
``PREFIX.<strategy>.png`` (that summary as a timeline).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["plot_trace", "profile_step", "summarise_trace", "trace_paths", "write_trace"]

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
            kernels.append((start, start + dur))
    for r in ranges:
        for s, e, nbytes in labels:
            if r["start_s"] <= s and e <= r["start_s"] + r["dur_s"] + 1e-9:
                r["bytes"] = nbytes
                break
    busy = _merge(kernels, 50e-6)
    totals = {}
    for kind in ("HtoD", "DtoH"):
        cps = [m for m in memcpy if m["kind"] == kind]
        nbytes = sum(m["bytes"] or 0 for m in cps)
        secs = sum(m["dur_s"] for m in cps)
        totals[kind] = {"copies": len(cps), "bytes": nbytes, "gpu_s": secs,
                        "GBps": nbytes / secs / 1e9 if secs else None}
    totals["kernel_busy_s"] = sum(e - s for s, e in busy)
    return {"ranges": ranges, "memcpy": memcpy, "kernel_busy": [{"start_s": s, "dur_s": e - s} for s, e in busy],
            "totals": totals}


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
    for y, ((label, color), spans) in enumerate(zip(lanes, rows)):
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
