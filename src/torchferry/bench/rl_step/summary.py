"""From the steps' records to the bench JSON's figures: per strategy, the resident baseline, the
overlap accounting and the prefetch floor (the arithmetic itself is in ``overlap``).

Seconds are wall clock unless said otherwise, bytes are per rank, GB/s = 1e9 B/s.
"""

from __future__ import annotations

import dataclasses
import statistics

from .overlap import PHASES, exposure, noise_frac, phase_floor
from .workload import StepRecord

__all__ = ["FirstCycle", "account_overlap", "dma_penalty", "prefetch_floor", "resident_summary", "summarise"]


@dataclasses.dataclass(frozen=True)
class FirstCycle:
    """A strategy's set-up and first round trip, before the timed steps (seconds)."""

    offload_s: float
    reload_s: float
    pin_s: float
    bit_exact: bool


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _rate(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def _spans(records: list[StepRecord], phase: str, kind: str) -> list[float]:
    return [s.seconds for r in records for s in r.spans if s.phase == phase and s.kind == kind]


def _gpu(records: list[StepRecord], direction: str) -> float | None:
    return _median([r.transfer_gpu_s[direction] for r in records  # pyright: ignore[reportArgumentType]  # the comprehension keeps only non-None values
                    if r.transfer_gpu_s and r.transfer_gpu_s.get(direction) is not None])


def summarise(first: FirstCycle, records: list[StepRecord], sizes: dict[str, int], *,
              overlaps_reload: bool) -> dict:
    """One strategy's figures over its timed steps (medians over steps; the exposures and the
    ``*_frac_of_peak`` are set later, by :func:`account_overlap` and ``overlap.apply_peak``).

    ``observed_GBps`` holds every rate the strategy reached, per direction (``d2h``, ``h2d``):
    ``steady``, ``first``, ``model_only``, ``per_step_max``, ``gpu`` (bytes over copy-engine
    seconds); the link peak is raised to the largest. Rates whose span does not cover the copy
    are left out: an overlapped reload's (its span is the issue time) and its forward-only
    offload's (pieces of it ran during the forward).
    """
    state = sizes["params"] + sizes["grads"] + sizes["optimizer"]
    params = sizes["params"]
    off_steady = _median(_spans(records, "update_actor", "d2h"))
    re_steady = _median(_spans(records, "update_actor", "h2d"))
    model_off = _median(_spans(records, "old_log_prob", "d2h"))
    model_re = _median(_spans(records, "old_log_prob", "h2d"))
    off_gpu, re_gpu = _gpu(records, "d2h"), _gpu(records, "h2d")
    per_step_d2h = [_rate(state, s) for s in _spans(records, "update_actor", "d2h")]
    per_step_h2d = [_rate(state, s) for s in _spans(records, "update_actor", "h2d")]
    if not overlaps_reload:
        per_step_d2h += [_rate(params, s) for s in _spans(records, "old_log_prob", "d2h")]
        per_step_h2d += [_rate(params, s) for s in _spans(records, "old_log_prob", "h2d")]
    observed = {
        "d2h": {"steady": _rate(state, off_steady), "first": _rate(state, first.offload_s),
                "model_only": None if overlaps_reload else _rate(params, model_off),
                "per_step_max": max((x for x in per_step_d2h if x is not None), default=None),
                "gpu": _rate(state, off_gpu)},
        "h2d": {"gpu": _rate(state, re_gpu)} if overlaps_reload else {
            "steady": _rate(state, re_steady), "first": _rate(state, first.reload_s),
            "model_only": _rate(params, model_re),
            "per_step_max": max((x for x in per_step_h2d if x is not None), default=None),
            "gpu": _rate(state, re_gpu)},
    }
    h2d_per_step = [sum(sp.seconds for sp in r.spans if sp.kind == "h2d") for r in records]
    return {
        "offload_s": {"first": first.offload_s, "steady": off_steady},
        "reload_s": {"first": first.reload_s, "steady": re_steady},
        "offload_GBps": _rate(state, off_steady),
        "reload_GBps": None if overlaps_reload else _rate(state, re_steady),  # overlapped: the issue time
        "offload_frac_of_peak": None,
        "reload_frac_of_peak": None,
        "offload_gpu_s": off_gpu,
        "reload_gpu_s": re_gpu,
        "observed_GBps": observed,
        "model_only": {"offload_s": model_off, "reload_s": model_re, "bytes": params},
        "transfer_spans_s_per_step": _median([r.exposed_transfer_s for r in records]),
        "reload_s_per_step": _median(h2d_per_step),
        "compute_s": {ph: _median(_spans(records, ph, "compute")) for ph in PHASES},
        "step_s": _median([r.train_s for r in records]),
        "pinned_host_bytes": max(r.pinned_host_bytes for r in records),
        "gpu_bytes_left_offloaded": _median([r.gpu_bytes_left_offloaded for r in records]),
        "rollout_alloc_ok": all(r.rollout_alloc_ok for r in records),
        "rollout_alloc_bytes": records[0].rollout_alloc_bytes,
        "empty_cache_s": _median(_spans(records, "update_actor", "release")),
        "pinning": {"seconds": first.pin_s, "GBps": _rate(state, first.pin_s)},
        "round_trip_bit_exact": first.bit_exact,
        "losses": [r.loss for r in records],
        "timeline_step": [dataclasses.asdict(s) for s in records[min(1, len(records) - 1)].spans],
    }


def _resident_compute(records: list[StepRecord]) -> list[dict[str, float]]:
    return [{p: r.phase_seconds().get(p, {}).get("compute", 0.0) for p in PHASES} for r in records]


def resident_summary(records: list[StepRecord], unit_compute_s: dict[str, list[float]]) -> tuple[dict, float | None]:
    """The ``baseline_resident`` entry and the top-level ``noise_frac``.

    Returns:
        ``({"compute_s": {phase: median s}, "compute_s_all": {phase: [s per round]},
        "noise_frac": {phase: (max - min) / median}, "unit_compute_s": {phase: [median s per unit]},
        "step_s", "losses", "rollout_alloc_ok": None, "timeline_step"}, max noise_frac over phases)``.
    """
    res = _resident_compute(records)
    top, per = noise_frac(res)
    return {
        "compute_s": {p: _median([r[p] for r in res]) for p in PHASES},
        "compute_s_all": {p: [r[p] for r in res] for p in PHASES},
        "noise_frac": per,
        "unit_compute_s": unit_compute_s,
        "step_s": _median([r.train_s for r in records]),
        "losses": [r.loss for r in records],
        "rollout_alloc_ok": None,  # not tried: the state stays on the device
        "timeline_step": [dataclasses.asdict(s) for s in records[min(1, len(records) - 1)].spans],
    }, top


def account_overlap(results: dict[str, dict], records: dict[str, list[StepRecord]],
                    resident: list[StepRecord]) -> None:
    """Sets each strategy's exposed seconds against the resident baseline, round by round
    ([Note: exposed time against a resident baseline] in ``overlap``).

    Per strategy: ``exposed_reload_s_per_step``, ``exposed_offload_s_per_step`` (medians over
    rounds), ``exposed_reload_s_all``, ``exposed_offload_s_all`` (per round),
    ``exposed_s_per_phase`` (``{phase: {"reload", "offload"}}``, medians),
    ``compute_overhead_s_per_step`` (compute over the resident's, median) and
    ``exposed_transfer_s_per_step`` (median of reload + offload). For ``+prefetch``, also
    ``exposed_reload_vs_torchferry_reload``: its exposed reload over plain ``torchferry``'s
    ``reload_s_per_step`` in the same run (with a note when there is none).
    """
    res = _resident_compute(resident)
    for name, r in results.items():
        e = exposure([rec.phase_seconds() for rec in records[name]], res)
        r.update({
            "exposed_reload_s_per_step": e["reload"], "exposed_reload_s_all": e["reload_all"],
            "exposed_offload_s_per_step": e["offload"], "exposed_offload_s_all": e["offload_all"],
            "exposed_s_per_phase": e["per_phase"], "compute_overhead_s_per_step": e["compute_overhead"],
            "exposed_transfer_s_per_step": _median(
                [a + b for a, b in zip(e["reload_all"], e["offload_all"], strict=False)]),
            "overlap_baseline": "resident",
            "overlap_note": "exposed reload = reload spans + compute over the resident baseline's compute in "
                            "the same round; exposed offload = offload + empty_cache spans (medians over rounds)",
        })
    base = results.get("torchferry")
    for name, r in results.items():
        if not name.endswith("+prefetch"):
            continue
        if base is None or not base.get("reload_s_per_step"):
            r["exposed_reload_vs_torchferry_reload"] = None
            r["overlap_note"] += "; no plain torchferry run to compare the reload with"
        else:
            r["exposed_reload_vs_torchferry_reload"] = r["exposed_reload_s_per_step"] / base["reload_s_per_step"]


def dma_penalty(results: dict[str, dict], dma: list[StepRecord] | None, resident: list[StepRecord]) -> dict | None:
    """The ``baseline_resident_dma`` entry, and ``dma_penalty_s_per_step`` of each ``+prefetch``
    strategy ([Note: the copies' own cost] in ``overlap``); ``None`` (and nothing set) without that
    baseline's records.

    Returns:
        ``{"compute_s": {phase: median s}, "compute_overhead_s_per_step", "issue_s_per_step",
        "penalty_s_per_step", "penalty_s_all", "penalty_s_per_phase": {phase: median s}}``: the
        penalty is its issue time plus its compute over the resident baseline's in the same round.
    """
    if not dma:
        return None
    e = exposure([rec.phase_seconds() for rec in dma], _resident_compute(resident))
    issue = [sum(s.seconds for s in r.spans if s.kind == "h2d") for r in dma]
    out = {
        "compute_s": {p: _median(_spans(dma, p, "compute")) for p in PHASES},
        "compute_overhead_s_per_step": e["compute_overhead"],
        "issue_s_per_step": _median(issue),
        "penalty_s_per_step": e["reload"], "penalty_s_all": e["reload_all"],
        "penalty_s_per_phase": {p: v["reload"] for p, v in e["per_phase"].items()},
    }
    for name, r in results.items():
        if name.endswith("+prefetch"):
            r["dma_penalty_s_per_step"] = e["reload"]
    return out


def prefetch_floor(unit_bytes: list[int], unit_compute_s: dict[str, list[float]], resident: list[StepRecord],
                   torchferry: list[StepRecord] | None, peak_h2d: float | None,
                   sizes: dict[str, int]) -> tuple[float | None, dict | None, str | None]:
    """The reload seconds per step no overlap can remove ([Note: prefetch floor] in ``overlap``).

    Args:
        unit_bytes: bytes per FSDP unit, forward pre-order.
        unit_compute_s: per phase, the resident baseline's seconds per unit in its first forward.
        resident: the resident baseline's steps (the update_actor compute, for the optimizer tail).
        torchferry: plain torchferry's steps (the copy rate: bytes of a phase's reload over its
            median reload seconds), or ``None``: then ``peak_h2d`` (GB/s).
        sizes: ``{"params", "grads", "optimizer"}`` bytes per rank.

    Returns:
        ``(floor s per step, floor_detail, note)``: ``floor_detail`` is ``{phase: {"unit_bytes",
        "unit_compute_s", "copy_GBps", "copy_rate_from", "floor_s"}}``; without a copy rate or unit
        timings, ``(None, None, why)``.
    """
    if not unit_bytes or any(len(unit_compute_s.get(p, [])) != len(unit_bytes) for p in PHASES):
        return None, None, "prefetch floor: no FSDP unit timings from the resident baseline"
    detail, total = {}, 0.0
    for p in PHASES:
        if torchferry:
            spans = [s for r in torchferry for s in r.spans if s.phase == p and s.kind == "h2d"]
            rate, source = _rate(spans[0].nbytes, _median([s.seconds for s in spans])), "torchferry"
        else:
            rate, source = peak_h2d, "link_peak"
        if not rate:
            return None, None, "prefetch floor: no plain torchferry run and no link peak to take a copy rate from"
        tail = {}
        if p == "update_actor":
            tail = {"tail_bytes": sizes["params"] + sizes["optimizer"],
                    "tail_compute_s": _median([x[p] for x in _resident_compute(resident)])}
        floor = phase_floor(unit_bytes, unit_compute_s[p], rate, **tail)
        detail[p] = {"unit_bytes": list(unit_bytes), "unit_compute_s": list(unit_compute_s[p]), "copy_GBps": rate,
                     "copy_rate_from": source, "floor_s": floor}
        total += floor
    return total, detail, None


_TRANSFER_KEYS = ("offload_GBps", "reload_GBps", "offload_frac_of_peak", "reload_frac_of_peak", "offload_gpu_s",
                  "reload_gpu_s", "observed_GBps", "transfer_spans_s_per_step", "reload_s_per_step", "empty_cache_s",
                  "exposed_reload_s_per_step", "exposed_reload_s_all", "exposed_offload_s_per_step",
                  "exposed_offload_s_all", "exposed_s_per_phase", "compute_overhead_s_per_step",
                  "exposed_transfer_s_per_step", "exposed_reload_vs_torchferry_reload", "step_s",
                  "exposed_reload_floor_s_per_step", "floor_detail")
"""Per strategy, the figures that time or rate a transfer (``None`` without a GPU)."""


def blank_transfer_figures(strategies: dict[str, dict], baseline: dict, swap: dict | None) -> None:
    """Without a GPU, sets every transfer figure to ``None``, in place.

    CPU copies of a tiny model time Python overhead, not a link: their seconds,
    rates, the exposures against the resident baseline (negative as often as
    not), their ratios, the prefetch floor and the resident baseline's noise
    (``noise_frac``, of compute lasting milliseconds) would read as results.
    Per strategy: the ``_TRANSFER_KEYS``, ``offload_s`` / ``reload_s`` (first and
    steady), ``model_only``'s seconds, ``pinning``; the baseline's ``noise_frac``;
    the swap's seconds and GB/s; ``step_s`` too (it holds the transfers). What
    stays: bytes, compute seconds, losses, the timeline's spans, bit-exactness,
    the rollout's allocation.
    """
    for r in strategies.values():
        for key in _TRANSFER_KEYS:
            if key in r:
                r[key] = None
        r["offload_s"] = {"first": None, "steady": None}
        r["reload_s"] = {"first": None, "steady": None}
        r["model_only"].update(offload_s=None, reload_s=None)
        r["pinning"] = {"seconds": None, "GBps": None}
    baseline["noise_frac"] = {p: None for p in baseline["noise_frac"]}
    if swap is not None:
        swap.update(GBps=None, seconds=None, frac_of_bidir_peak=None)
        swap["reps"] = [{**x, "seconds": None} for x in swap["reps"]]
