"""The GRPO scenario's report: the per-strategy summary of the step records, the terminal lines and the plot.

Without a GPU the lines and the plot give no exposed seconds ("no transfer figures without a GPU"):
the CPU run checks the bytes moved, the budget and bit-exactness. The JSON keeps its figures as they are.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .._common.output import NO_GPU
from .config import PHASES

__all__ = ["median", "plot_grpo", "summarise", "summary_lines"]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(records: list[dict], calib: dict[str, float | None], budget: int, timeline: dict | None) -> dict:
    def exposed(r: dict) -> dict[str, float]:
        return {p: r["phase_wall_s"][p] - calib[p] for p in PHASES}

    per_step = [sum(exposed(r).values()) for r in records]
    peaks = [r["peak_gpu_bytes"] for r in records if r["peak_gpu_bytes"] is not None]
    accounted = max(r["peak_accounted_bytes"] for r in records)
    return {
        "exposed_transfer_s_per_step": median(per_step),
        "exposed_transfer_s_by_phase": {p: median([exposed(r)[p] for r in records]) for p in PHASES},
        "phase_wall_s": {p: median([r["phase_wall_s"][p] for r in records]) for p in PHASES},
        "step_s": median([sum(r["phase_wall_s"].values()) for r in records]),
        "peak_gpu_bytes": max(peaks) if peaks else None,
        "peak_accounted_bytes": accounted,
        "within_budget": (max(peaks) <= budget) if peaks else accounted <= budget,
        "bytes_moved_per_step": {"h2d": median([r["bytes"]["h2d"] for r in records]),
                                 "d2h": median([r["bytes"]["d2h"] for r in records])},
        "copies_per_step": median([r["copies"] for r in records]),
        "exposed_transfer_s_steps": per_step,
        "losses": [r["loss"] for r in records],
        "timeline_step": timeline,
    }


# ------------------------------------------------------------------ report
_PHASE_COLORS = {"rollout": "#c8c8c8", "ref_log_prob": "#8fbc8f", "old_log_prob": "#66a266",
                 "update_actor": "#2ca02c"}
_ENGINE_COLORS = {"h2d": "#1f77b4", "d2h": "#ff7f0e"}


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def summary_lines(result: dict) -> list[str]:
    """A few lines for the terminal: per strategy, exposed s/step, peak GB against the budget, bit-exact."""
    b = result["budget"]
    head = (f"{result['model']['preset']} x {result['env']['world_size']} rank(s) on {result['env']['gpu'] or 'CPU'}: "
            f"budget {_size(b['gpu_budget_bytes'])}/rank (everything at once: {_size(b['everything_bytes'])})")
    out = [head]
    gpu = result["env"]["gpu"] is not None
    for name, s in result["strategies"].items():
        ratio = s.get("exposed_vs_torchferry")
        exposed = (f"exposed {s['exposed_transfer_s_per_step']:.3f} s/step"
                   + (f" ({ratio:.2f}x torchferry)" if ratio is not None else "")) if gpu else f"exposed: {NO_GPU}"
        out.append(f"  {name:16s} {exposed}"
                   + f", moved H2D {_size(s['bytes_moved_per_step']['h2d'])} / D2H "
                   f"{_size(s['bytes_moved_per_step']['d2h'])} per step, peak {_size(s['peak_gpu_bytes'])}, "
                   f"within budget {s['within_budget']}, bit-exact {s['bit_exact']}")
    return out


def plot_grpo(result: dict, path: str | Path) -> None:
    """One timed step per strategy: phases and compute, and both copy engines (H2D, D2H) under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gpu = result["env"]["gpu"] is not None
    names = [n for n, s in result["strategies"].items() if s.get("timeline_step")]
    lanes = [(n, lane) for n in names for lane in ("step", "h2d", "d2h")]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * len(lanes)))
    xmax = 0.0
    for row, (n, lane) in enumerate(lanes):
        tl = result["strategies"][n]["timeline_step"]
        if lane == "step":
            for p in tl["phases"]:
                ax.broken_barh([(p["start"], p["end"] - p["start"])], (row - 0.4, 0.8),
                               facecolor="none", edgecolor=_PHASE_COLORS[p["phase"]], linewidth=1.2)
                xmax = max(xmax, p["end"])
            for c in tl["compute"]:
                ax.broken_barh([(c["start"], max(c["end"] - c["start"], 1e-4))], (row - 0.3, 0.6),
                               color=_PHASE_COLORS[c["phase"]])
            s = result["strategies"][n]
            text = f"exposed {s['exposed_transfer_s_per_step']:.2f} s/step" if gpu else NO_GPU
            ax.text(xmax, row, f"  {text}", va="center", fontsize=8)
        else:
            for c in tl["copies"]:
                if c["engine"] != lane:
                    continue
                ax.broken_barh([(c["start"], c["end"] - c["start"])], (row - 0.3, 0.6),
                               color=_ENGINE_COLORS[lane], alpha=0.55 if c["background"] else 1.0)
                ax.text(c["start"], row, f" {c['name']}", va="center", fontsize=6, color="white")
                xmax = max(xmax, c["end"])
    ax.set_yticks(range(len(lanes)), [f"{n}: {'phases' if lane == 'step' else lane.upper() + ' engine'}"
                                      for n, lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax * 1.25 if xmax else 1)
    ax.set_xlabel("seconds from the start of one timed step")
    b, m = result["budget"], result["model"]
    ax.set_title(f"GRPO step under a {_size(b['gpu_budget_bytes'])}/rank budget: {m['preset']}, "
                 f"{result['env']['world_size']} rank(s), {result['env']['gpu'] or 'CPU'}", fontsize=10)
    handles = [Patch(color=c, label=f"{p} compute") for p, c in _PHASE_COLORS.items()]
    handles += [Patch(color=_ENGINE_COLORS["h2d"], label="H2D copy (load)"),
                Patch(color=_ENGINE_COLORS["d2h"], label="D2H copy (evict/offload)"),
                Patch(color="#888888", alpha=0.55, label="issued by a prefetch")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.4 / len(lanes)), ncol=4, fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
