"""The overlap arithmetic of ``torchferry bench``: pure functions of measured seconds and bytes.

Units: seconds (wall clock unless said otherwise), bytes, GB/s = 1e9 B/s.

[Note: exposed time against a resident baseline]
A strategy's transfer time on the critical path cannot be read off its
transfer spans alone: an overlapped reload returns at once and its waits fall
inside compute. So every round of the bench also runs ``resident``: the same
phases with the state left on the device (no copies, no KV-cache allocation).
Its compute span of phase ``p`` in round ``k`` is ``C_res[k][p]``, taken in the
same round as the strategies' steps, so that clock and thermal drift fall on
both. For a strategy, round ``k``::

    reload_exposed_k  = sum_p (h2d_span + compute_span - C_res[k][p])
    offload_exposed_k = sum_p (d2h_span + release_span)

and the figures are medians over rounds. ``noise_frac`` is the spread of
``C_res`` over rounds, ``(max - min) / median`` per phase: exposures below it
(times the compute) are noise. It needs several rounds; with two it is the
distance of two samples.

[Note: prefetch floor]
A layer-wise reload cannot hide the copy of a unit behind compute that has
not run yet. With units in forward order, unit ``i`` copying ``b_i / rate``
seconds and computing ``c_i`` seconds, the forward of unit ``k`` starts no
earlier than ``Copy_{<=k}`` (its own copy and every copy before it, back to
back on one copy engine) while it would start at ``Compute_{<k}`` with the
state resident, so the phase's reload leaves at least
``max(0, max_k (Copy_{<=k} - Compute_{<k}))`` exposed. In update_actor the
optimizer state comes last and the step waits for it: also at least
``(params + optimizer bytes) / rate - resident compute of the phase``.

[Note: the copies' own cost]
The floor above assumes the compute runs as fast beside the copies as alone.
It does not quite: DMA from host memory at line rate raises the host's DRAM
latency (13% H2D, 24% D2H in a stand-alone probe on one H200), so the Python
and launches of an eager step slow down, and the issuing of the copies takes
host time too. So on CUDA, with ``torchferry+prefetch``, the bench runs a
second baseline each round, ``resident+dma``: the resident step, with each
reload replaced by as many bytes copied H2D, in the same pieces and switch
points, on a stream nothing waits for (``strategies.ResidentDMA``). Its
exposed reload against the resident baseline of the same round (issue time +
compute over the resident's) is ``dma_penalty_s_per_step``: what the copies
cost beside this step without any schedule, the part of
``exposed_reload_s_per_step`` over the floor that is not the schedule's. Its
copies are queued at once from the caller's thread, so for a large state its
issue time includes waits for a full stream queue (3B on one H200: 0.39 s at
9365f08), which torchferry's issuer thread does not pay;
``baseline_resident_dma.compute_overhead_s_per_step`` is the copies' effect on
the step's compute alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["PHASES", "apply_peak", "exposure", "noise_frac", "observed_rates", "phase_floor", "raise_peak"]

PHASES = ("old_log_prob", "update_actor")


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def exposure(steps: Sequence[Mapping[str, Mapping[str, float]]], resident: Sequence[Mapping[str, float]],
             phases: Iterable[str] = PHASES) -> dict:
    """Exposed reload and offload seconds of one strategy (see [Note: exposed time against a resident baseline]).

    Args:
        steps: per round ``k``, ``{phase: {"h2d", "compute", "d2h", "release": seconds}}`` of the
            strategy's step (a missing kind counts 0).
        resident: per round ``k``, ``{phase: compute seconds}`` of the resident baseline's step.
            Rounds pair by index; extra rounds on either side are left out.
        phases: the phases summed.

    Returns:
        ``{"reload_all", "offload_all", "compute_overhead_all"}`` (seconds per round),
        ``"reload"``, ``"offload"``, ``"compute_overhead"`` (their medians) and ``"per_phase"``:
        ``{phase: {"reload": median, "offload": median}}``. Medians are ``None`` without rounds.
    """
    phases = tuple(phases)
    n = min(len(steps), len(resident))
    per = {p: {"reload": [], "offload": [], "overhead": []} for p in phases}
    for k in range(n):
        for p in phases:
            s = steps[k].get(p, {})
            overhead = s.get("compute", 0.0) - resident[k][p]
            per[p]["reload"].append(s.get("h2d", 0.0) + overhead)
            per[p]["offload"].append(s.get("d2h", 0.0) + s.get("release", 0.0))
            per[p]["overhead"].append(overhead)
    reload_all = [sum(per[p]["reload"][k] for p in phases) for k in range(n)]
    offload_all = [sum(per[p]["offload"][k] for p in phases) for k in range(n)]
    overhead_all = [sum(per[p]["overhead"][k] for p in phases) for k in range(n)]
    return {
        "reload_all": reload_all, "offload_all": offload_all, "compute_overhead_all": overhead_all,
        "reload": _median(reload_all), "offload": _median(offload_all), "compute_overhead": _median(overhead_all),
        "per_phase": {p: {"reload": _median(per[p]["reload"]), "offload": _median(per[p]["offload"])} for p in phases},
    }


def noise_frac(resident: Sequence[Mapping[str, float]], phases: Iterable[str] = PHASES) -> tuple[float | None, dict]:
    """Spread of the resident compute seconds over rounds.

    Returns:
        ``(top, per_phase)``: per phase ``(max - min) / median`` of its compute
        seconds over rounds (``None`` with no round or a median <= 0), and the
        largest of them (``None`` if none).
    """
    per: dict[str, float | None] = {}
    for p in phases:
        xs = [r[p] for r in resident]
        med = _median(xs)
        per[p] = (max(xs) - min(xs)) / med if med else None
    known = [v for v in per.values() if v is not None]
    return (max(known) if known else None), per


def phase_floor(unit_bytes: Sequence[int], unit_compute_s: Sequence[float], copy_GBps: float, *,
                tail_bytes: int | None = None, tail_compute_s: float | None = None) -> float:
    """Seconds of one phase's reload that no overlap can hide ([Note: prefetch floor]).

    Args:
        unit_bytes: bytes each FSDP unit copies, in forward order.
        unit_compute_s: seconds each unit computes in the phase's first forward, same order.
        copy_GBps: the copy rate, GB/s (1e9 B/s).
        tail_bytes: with ``tail_compute_s``, the bytes that must all be resident before the
            phase ends (update_actor: parameters and optimizer state)...
        tail_compute_s: ...and the seconds the whole phase computes with the state resident.

    Returns:
        ``max(0, max_k (Copy_{<=k} - Compute_{<k}), tail_bytes / rate - tail_compute_s)`` seconds.

    Raises:
        ValueError: lists of different lengths, or a rate <= 0.
    """
    if len(unit_bytes) != len(unit_compute_s):
        raise ValueError(f"{len(unit_bytes)} unit sizes but {len(unit_compute_s)} unit compute times")
    if not copy_GBps or copy_GBps <= 0:
        raise ValueError(f"copy rate must be > 0 GB/s, got {copy_GBps}")
    rate = copy_GBps * 1e9
    floor, copy, compute_before = 0.0, 0.0, 0.0
    for nbytes, compute in zip(unit_bytes, unit_compute_s, strict=False):
        copy += nbytes / rate
        floor = max(floor, copy - compute_before)
        compute_before += compute
    if tail_bytes is not None and tail_compute_s is not None:
        floor = max(floor, tail_bytes / rate - tail_compute_s)
    return floor


def raise_peak(measured: Mapping[str, float] | None,
               observed: Mapping[str, Iterable[tuple[str, float | None]]]) -> tuple[dict | None, list[dict]]:
    """The link peak, never below a rate the run itself reached.

    Args:
        measured: ``{"h2d", "d2h", "bidir": GB/s}`` as measured, or ``None`` (no GPU: nothing to do).
        observed: per direction, ``(label, GB/s)`` of every rate observed in the run (``None`` skipped).

    Returns:
        ``(peak, raised)``: the peak with each direction at least its largest observation, and per
        raised direction ``{"direction", "measured_GBps", "GBps", "by"}`` (``by``: the label).
    """
    if measured is None:
        return None, []
    peak, raised = dict(measured), []
    for direction, obs in observed.items():
        best = max(((gbps, label) for label, gbps in obs if gbps is not None), default=None)
        if direction in peak and best is not None and best[0] > peak[direction]:
            raised.append({"direction": direction, "measured_GBps": peak[direction], "GBps": best[0], "by": best[1]})
            peak[direction] = best[0]
    return peak, raised


def observed_rates(strategies: Mapping[str, Mapping], swap: Mapping | None) -> dict[str, list[tuple[str, float]]]:
    """Every rate of the run, per direction, from each strategy's ``observed_GBps`` (and the swap's ``GBps``)."""
    out: dict[str, list[tuple[str, float]]] = {"d2h": [], "h2d": [], "bidir": []}
    for name, r in strategies.items():
        for direction, rates in (r.get("observed_GBps") or {}).items():
            for what, gbps in rates.items():
                if gbps is not None:
                    out[direction].append((f"{name}: {what}", gbps))
    if swap and swap.get("GBps") is not None:
        out["bidir"].append(("swap", swap["GBps"]))
    return out


def apply_peak(strategies: Mapping[str, dict], swap: dict | None, peak: Mapping[str, float] | None) -> None:
    """Sets every ``*_frac_of_peak`` against ``peak`` (``None`` without a peak or a rate)."""
    def frac(gbps, direction):
        return gbps / peak[direction] if (peak and gbps is not None and peak.get(direction)) else None

    for r in strategies.values():
        r["offload_frac_of_peak"] = frac(r.get("offload_GBps"), "d2h")
        r["reload_frac_of_peak"] = frac(r.get("reload_GBps"), "h2d")
    if swap is not None:
        swap["frac_of_bidir_peak"] = frac(swap.get("GBps"), "bidir")
