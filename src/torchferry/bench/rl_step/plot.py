"""The PNG timeline of ``torchferry bench --plot``: one steady step per strategy, and the swap."""

from __future__ import annotations

import itertools
from pathlib import Path

from .._common.output import NO_GPU
from .report import on_gpu

__all__ = ["plot_timeline"]

_COLORS = {"rollout": "#c8c8c8", "h2d": "#1f77b4", "compute": "#2ca02c", "d2h": "#ff7f0e", "release": "#9467bd"}
_LABELS = {"rollout": "rollout (KV cache)", "h2d": "reload (H2D)", "compute": "compute", "d2h": "offload (D2H)",
           "release": "empty_cache"}


def plot_timeline(result: dict, path: str | Path) -> None:
    """One steady step per strategy as horizontal bars: rollout, reloads, compute, offloads.

    Raises:
        OSError: the PNG could not be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gpu = on_gpu(result)
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
        if gpu:
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
        label = (f"  actor out + critic in: {sw['seconds']:.2f} s, {sw['GBps']:.1f} GB/s both ways" if gpu else
                 f"  actor out + critic in: bit-exact {'yes' if sw['bit_exact'] else 'NO'}")
        ax.text(max(x["end"] for x in sw["timeline"]), row, label, va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [*names, "swap (not a step)"] if sw else names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of one steady step")
    m = result["model"]
    ax.set_title(
        f"One colocated RL step: {m['preset'] or m['path']}, {result['env']['world_size']} rank(s), "
        f"{result['env']['gpu'] or 'CPU'}, torch {result['env']['torch']}"
        + ("" if gpu else f"\n{NO_GPU}: on the CPU the bars time Python overhead, not a link"),
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
