"""Presenting bench results: the terminal table, the JSON file, the PNG timeline."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

__all__ = ["on_gpu", "overlap_lines", "plot_timeline", "render_table", "swap_line", "write_json"]

_COLORS = {"rollout": "#c8c8c8", "h2d": "#1f77b4", "compute": "#2ca02c", "d2h": "#ff7f0e", "release": "#9467bd"}
_LABELS = {"rollout": "rollout (KV cache)", "h2d": "reload (H2D)", "compute": "compute", "d2h": "offload (D2H)",
           "release": "empty_cache"}


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


def render_table(result: dict):
    """A ``rich.table.Table`` of the strategies, one row each.

    Without a GPU the GB/s columns hold "-": CPU copies of a tiny model time
    Python overhead, not a link (the run's notes say so once).
    """
    from rich.table import Table

    gpu = on_gpu(result)
    m = result["model"]
    state = sum(m["state_bytes"].values())
    peak = result["link_peak_GBps"]
    title = (
        f"{m['preset'] or m['path']} ({m['layers']} layers), {result['env']['world_size']} rank(s), "
        f"state {state / 1e9:.2f} GB/rank on {result['env']['gpu'] or 'CPU'}"
    )
    if peak:
        title += f"; link peak H2D {peak['h2d']:.1f} / D2H {peak['d2h']:.1f} / both {peak['bidir']:.1f} GB/s"
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
    its exposed reload against plain torchferry's reload and the floor no overlap can remove."""
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
        lines.append(line)
    return lines


def swap_line(sw: dict, gpu: bool) -> str:
    """The one-line summary of the swap scenario (no GB/s without a GPU)."""
    head = "swap (torchferry.swap, actor out + critic in): "
    exact = f"bit-exact: {'yes' if sw['bit_exact'] else 'NO'}"
    if not gpu:
        return head + f"{sw['seconds']:.3f} s, {exact}"
    frac = f" ({100 * sw['frac_of_bidir_peak']:.1f}% of the bidirectional peak)" if sw["frac_of_bidir_peak"] else ""
    return head + f"{sw['seconds']:.3f} s, {sw['GBps']:.1f} GB/s both ways{frac}, {exact}"


def write_json(result: dict, path: str | Path) -> None:
    """Writes ``result`` to ``path`` as indented JSON, creating missing folders.

    Raises:
        OSError: the file could not be written.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def plot_timeline(result: dict, path: str | Path) -> None:
    """One steady step per strategy as horizontal bars: rollout, reloads, compute, offloads.

    Raises:
        OSError: the PNG could not be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(result["strategies"])
    rows = names + (["swap"] if result.get("swap") else [])
    fig, ax = plt.subplots(figsize=(11, 1.1 + 0.8 * len(rows)))
    for row, name in enumerate(names):
        spans = result["strategies"][name]["timeline_step"]
        for s in spans:
            ax.broken_barh([(s["start"], s["end"] - s["start"])], (row - 0.35, 0.7), color=_COLORS[s["kind"]])
        for a, b in itertools.pairwise(spans):  # untimed host work between phases (--phase-gap-s)
            if b["start"] - a["end"] > 0.02:
                ax.broken_barh([(a["end"], b["start"] - a["end"])], (row - 0.2, 0.4), facecolor="none",
                               edgecolor="#bbbbbb", hatch="///", linewidth=0)
        end = max(s["end"] for s in spans)
        transfer = result["strategies"][name].get("exposed_transfer_s_per_step")
        exposed = "" if transfer is None else f" (exposed transfers {transfer:.2f} s)"
        ax.text(end, row, f"  {end:.2f} s{exposed}", va="center", fontsize=9)
        for phase in ("old_log_prob", "update_actor"):
            ph = [s for s in spans if s["phase"] == phase]
            if ph:
                ax.text(ph[0]["start"], row + 0.42, phase, fontsize=7, color="#444")
    sw = result.get("swap")
    if sw:
        row = len(names)
        for span, y in zip(sw["timeline"], (row - 0.35, row + 0.02), strict=False):
            ax.broken_barh([(span["start"], span["end"] - span["start"])], (y, 0.33), color=_COLORS[span["kind"]])
        rate = f", {sw['GBps']:.1f} GB/s both ways" if on_gpu(result) else ""
        ax.text(max(x["end"] for x in sw["timeline"]), row,
                f"  actor out + critic in: {sw['seconds']:.2f} s{rate}", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [*names, "swap (not a step)"] if sw else names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of one steady step")
    m = result["model"]
    ax.set_title(
        f"One colocated RL step: {m['preset'] or m['path']}, {result['env']['world_size']} rank(s), "
        f"{result['env']['gpu'] or 'CPU'}, torch {result['env']['torch']}",
        fontsize=10,
    )
    gap = Patch(facecolor="none", edgecolor="#bbbbbb", hatch="///", label="host work between phases (untimed)")
    ax.legend(handles=[Patch(color=c, label=_LABELS[k]) for k, c in _COLORS.items()] + [gap],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(names) < 3 else -0.2), ncol=3, fontsize=8)
    ax.set_xlim(0, max(max(s["end"] for s in r["timeline_step"]) for r in result["strategies"].values()) * 1.35)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
