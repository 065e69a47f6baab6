"""What ``torchferry bench`` prints: the table of strategies, the lines under it (the resident
baseline's noise, the prefetch floor, the swap), the notes and the files written.

Without a GPU there is no transfer figure to show (the JSON holds ``null``): the table keeps what
the CPU run checks (step seconds, the rollout's allocation, bit-exactness) and says so.
"""

from __future__ import annotations

import sys

from .._common.output import NO_GPU

__all__ = ["on_gpu", "overlap_lines", "print_report", "render_table", "swap_line"]


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def on_gpu(result: dict) -> bool:
    """Whether the run had a GPU: without one, no figure of it is a transfer rate (GB/s)."""
    return result["env"]["gpu"] is not None


def _gbps(gbps: float | None, frac: float | None, gpu: bool) -> str:
    if gbps is None or not gpu:  # +prefetch: the issue time; CPU: no link (see the run's note)
        return "-"
    return f"{gbps:.1f} ({_pct(frac)})"


def _cpu_table(result: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("strategy", "steps", "rollout alloc", "bit-exact"):
        t.add_column(col, justify="right")
    for name, r in result["strategies"].items():
        t.add_row(name, str(len(r["losses"])), "ok" if r["rollout_alloc_ok"] else "FAILED",
                  "yes" if r["round_trip_bit_exact"] else "NO")
    return t


def render_table(result: dict):
    """A ``rich.table.Table`` of the strategies, one row each.

    Without a GPU only what the CPU run checks: the steps that ran, the
    rollout's allocation, bit-exactness (the line under it says why).
    """
    from rich.table import Table

    gpu = on_gpu(result)
    m = result["model"]
    state = sum(m["state_bytes"].values())
    peak = result["link_peak_GBps"]
    size = f"{state / 1e9:.2f} GB" if state >= 1e8 else f"{state / 1e6:.2f} MB"
    title = (
        f"{m['preset'] or m['path']} ({m['layers']} layers), {result['env']['world_size']} rank(s), "
        f"state {size}/rank on {result['env']['gpu'] or 'CPU'}"
    )
    if peak:
        title += f"; link peak H2D {peak['h2d']:.1f} / D2H {peak['d2h']:.1f} / both {peak['bidir']:.1f} GB/s"
    if not gpu:
        return _cpu_table(result, title)
    caption = ("exposed reload: reload + compute over the resident baseline's in the same round; exposed "
               "offload: offload + empty_cache (medians over rounds)")
    if any(n.endswith("+prefetch") for n in result["strategies"]):
        caption += "; +prefetch: reload s is the issue time, its waits fall inside compute; no reload GB/s"
    t = Table(title=title, caption=caption)
    for col in ("strategy", "offload s\nfirst / steady", "reload s\nfirst / steady", "offload\nGB/s (% peak)",
                "reload\nGB/s (% peak)", "exposed s/step\nreload / offload", "step s", "pinned host\nGB",
                "GPU left\noffloaded GB", "rollout\nalloc", "bit-exact"):
        t.add_column(col, justify="right")
    for name, r in result["strategies"].items():
        t.add_row(
            name,
            f"{_s(r['offload_s']['first'])} / {_s(r['offload_s']['steady'])}",
            f"{_s(r['reload_s']['first'])} / {_s(r['reload_s']['steady'])}",
            _gbps(r["offload_GBps"], r["offload_frac_of_peak"], gpu),
            _gbps(r["reload_GBps"], r["reload_frac_of_peak"], gpu),
            f"{_s(r.get('exposed_reload_s_per_step'))} / {_s(r.get('exposed_offload_s_per_step'))}",
            _s(r["step_s"]),
            _gb(r["pinned_host_bytes"]),
            _gb(r["gpu_bytes_left_offloaded"]),
            "ok" if r["rollout_alloc_ok"] else "FAILED",
            "yes" if r["round_trip_bit_exact"] else "NO",
        )
    return t


def overlap_lines(result: dict) -> list[str]:
    """The lines under the table: the resident baseline's noise and, per ``+prefetch`` strategy,
    its exposed reload against plain torchferry's reload and the floor no overlap can remove
    (without a GPU, one line saying there are none)."""
    if not on_gpu(result):
        return [f"{NO_GPU}: CPU copies of a tiny model time Python overhead, not a link (the JSON holds null "
                "for every seconds, GB/s, exposure, noise_frac and floor figure)"]
    lines = []
    base = result.get("baseline_resident")
    if base:
        per = ", ".join(f"{p} {_pct(v)}" for p, v in base["noise_frac"].items())
        rounds = len(next(iter(base["compute_s_all"].values()), []))
        lines.append(f"resident baseline: noise_frac {_pct(result.get('noise_frac'))} ({per}; (max - min) / median "
                     f"of its compute over {rounds} rounds; exposures within it are noise)")
    plain = result["strategies"].get("torchferry")
    for name, r in result["strategies"].items():
        if not name.endswith("+prefetch"):
            continue
        line = f"{name}: exposed reload {_s(r.get('exposed_reload_s_per_step'))} s/step"
        if r.get("exposed_reload_vs_torchferry_reload") is not None and plain:
            line += (f", {r['exposed_reload_vs_torchferry_reload']:.3f}x torchferry's reload "
                     f"{_s(plain['reload_s_per_step'])} s/step")
        if "exposed_reload_floor_s_per_step" in r:
            line += f"; floor {_s(r['exposed_reload_floor_s_per_step'])} s/step (copies no overlap can hide)"
        if r.get("dma_penalty_s_per_step") is not None:
            line += (f"; the same bytes copied beside the resident step, nothing waiting for them, cost "
                     f"{_s(r['dma_penalty_s_per_step'])} s/step (resident+dma)")
        lines.append(line)
        for key, what in (("small_h2d_latency_ms", "a 34 KiB H2D copy on the compute stream during its reload"),
                          ("small_d2h_latency_ms", "a 34 KiB D2H copy during its offload")):
            lat = r.get(key)
            if lat and lat.get("p50") is not None:
                lines.append(f"{name}: {what} waits p50 {lat['p50']:.3f} ms, p90 {lat['p90']:.3f} ms "
                             f"(alone {lat['alone_p50']:.3f} ms)")
    return lines


def swap_line(sw: dict, gpu: bool) -> str:
    """The one-line summary of the swap scenario (no GB/s without a GPU)."""
    head = "swap (torchferry.swap, actor out + critic in): "
    exact = f"bit-exact: {'yes' if sw['bit_exact'] else 'NO'}"
    if not gpu:
        return head + f"{exact}; {NO_GPU}"
    frac = f" ({100 * sw['frac_of_bidir_peak']:.1f}% of the bidirectional peak)" if sw["frac_of_bidir_peak"] else ""
    return head + f"{sw['seconds']:.3f} s, {sw['GBps']:.1f} GB/s both ways{frac}, {exact}"


def print_report(result: dict) -> None:
    """Prints the table and the lines under it (stdout), then the notes and the trace files (stderr)."""
    from rich.markup import escape

    from .._common.output import print_notes, stdout_console

    out = stdout_console(170)  # logs and pipes: the table on one line per strategy
    out.print(render_table(result))
    for line in overlap_lines(result):
        out.print(escape(line), soft_wrap=True)
    sw = result.get("swap")
    if sw:
        out.print(escape(swap_line(sw, on_gpu(result))), soft_wrap=True)
    print_notes(result["notes"])
    for path in result.get("trace_files", []):
        print(f"wrote {path}", file=sys.stderr)
