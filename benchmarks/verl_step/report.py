"""``report`` and ``timeline``: a run's records turned into the torchferry.verl-step/1 JSON and a PNG."""

from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path

from verl_step.common import SCHEMA, VERL_CODE
from verl_step.records import against


def merge_runs(parts: list[dict]) -> dict:
    """The records of one run from its processes' records (one per strategy, ``run --own``; or one
    process's of every strategy): strategies in the run's order, per rank every strategy's records, and
    each strategy's ``against_verl`` from the fingerprints.

    Raises:
        ValueError: the parts disagree on the ranks or the strategies, or verl's records are missing.
    """
    order = [s["label"] for s in parts[0]["strategies_all"]]
    specs = {s["label"]: s for part in parts for s in part["strategies"]}
    if sorted(specs) != sorted(order) or any([s["label"] for s in p["strategies_all"]] != order for p in parts):
        raise ValueError(f"the parts hold strategies {sorted(specs)}, the run names {order}")
    worlds = {len(p["per_rank"]) for p in parts}
    if len(worlds) != 1:
        raise ValueError(f"the parts have different numbers of ranks: {sorted(worlds)}")
    per_rank = []
    for rank in range(worlds.pop()):
        merged: dict = {"rank": rank, "strategies": {}}
        for p in parts:
            r = p["per_rank"][rank]
            merged["strategies"].update(r["strategies"])
            pinned = r["caching_host_allocator_pinned_bytes"]  # a merged run's records: already per label
            merged.setdefault("caching_host_allocator_pinned_bytes", {}).update(
                {label: pinned[label] if isinstance(pinned, dict) else pinned for label in r["strategies"]})
        if "verl" not in merged["strategies"]:
            raise ValueError("verl's records are missing: it is the reference of against_verl")
        ref = merged["strategies"]["verl"]["fingerprints"]
        for rec in merged["strategies"].values():
            rec["against_verl"] = against(ref, rec["fingerprints"])
        per_rank.append(merged)
    base = parts[0]
    steps = min(p["config"]["steps"] for p in parts)
    return {**base, "strategies": [specs[label] for label in order], "per_rank": per_rank,
            "config": {**base["config"], "steps": steps, "processes": len(parts)}}



# --------------------------------------------------------------------------------------------- report
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _view(runs: dict, label: str) -> dict:
    """One strategy's records, per rank: ``{"per_rank": [...]}`` (what :func:`identical` compares)."""
    return {"per_rank": [{"rank": r["rank"], **r["strategies"][label]} for r in runs["per_rank"]]}


def _transfers(rank_result: dict) -> dict:
    """FSDPEngine.to seconds, first and steady (median of the later ones).

    ``offload_s`` / ``reload_s``: update_actor's, of the full state (parameters and AdamW state;
    the first reload with optimizer state is step 2's, the state exists after step 1's update);
    ``model_only_*``: compute_log_prob's (parameters); ``init_offload_s``: the engine's
    initialize() (parameters, before any optimizer state).
    """
    events = rank_result["events"]
    out = {}
    full = [e for e in events if e["phase"] == "update" and e["model"] and e["optimizer"]]
    lp = [e for e in events if e["phase"] == "log_prob" and e["model"]]
    for key, evs, direction in (("offload_s", full, "offload"), ("reload_s", full, "reload"),
                                ("model_only_offload_s", lp, "offload"), ("model_only_reload_s", lp, "reload")):
        xs = [e["seconds"] for e in evs if e["direction"] == direction]
        out[key] = {"first": xs[0] if xs else None, "steady": _median(xs[1:]), "all": xs}
    init = [e["seconds"] for e in events if e["phase"] == "init" and e["direction"] == "offload"]
    out["init_offload_s"] = init[0] if init else None
    out["gpu_bytes_left_offloaded"] = _median([e["gpu_allocated_after"] for e in full if e["direction"] == "offload"])
    return out


def _bytes_per_step(rank_result: dict) -> dict[str, int | None]:
    """Bytes each direction moved per step (median over the steps after the first), from
    ``FSDPEngine.to``'s events: verl's helpers move whole parts, torchferry skips unchanged storages."""
    out: dict[str, int | None] = {}
    steps = sorted({e["step"] for e in rank_result["events"] if e["step"] >= 1})
    for direction in ("offload", "reload"):
        per = [sum(e.get("bytes", 0) for e in rank_result["events"] if e["step"] == s and e["direction"] == direction)
               for s in steps]
        out[direction] = int(statistics.median(per)) if per else None
    return out


def _dock_bytes_per_step(rank_result: dict) -> dict[str, int | None]:
    """A dock strategy's bytes per step (median over the steps after the first): its evictions (offload)
    and loads (reload), prefetches included, from the dock's counts."""
    steps = rank_result["dock_steps"][1:]
    return {"offload": int(statistics.median([x["bytes_evicted"] for x in steps])) if steps else None,
            "reload": int(statistics.median([x["bytes_loaded"] for x in steps])) if steps else None}


def identical(a: dict, b: dict) -> tuple[dict[str, bool], dict[str, object]]:
    """Exact comparison of a strategy's records (:func:`_view`) with verl's (``a``): losses, old
    (and reference) log-probs (sha256), and ``b``'s parameter shards, optimizer state and
    weight-sync buffers, compared byte for byte in the run against verl's (``against_verl``).

    Returns:
        ``(same, differing)``: per kind whether all are equal, and what differs (rank:name).

    Raises:
        ValueError: the two have different numbers of ranks.
    """
    if len(a["per_rank"]) != len(b["per_rank"]):
        raise ValueError(f"the runs have {len(a['per_rank'])} and {len(b['per_rank'])} ranks")
    diffs: dict[str, object] = {"losses": a["per_rank"][0]["losses"] != b["per_rank"][0]["losses"],
                                "log_probs": [], "params": [], "optimizer_state": [], "weight_sync": []}
    for ra, rb in zip(a["per_rank"], b["per_rank"], strict=True):
        if (ra["log_prob_sha256"], ra.get("ref_log_prob_sha256")) != (rb["log_prob_sha256"],
                                                                      rb.get("ref_log_prob_sha256")):
            diffs["log_probs"].append(ra["rank"])
        for kind in ("params", "optimizer_state", "weight_sync"):
            diffs[kind] += [f"rank{rb['rank']}:{n}" for n in rb["against_verl"][kind]]
    same = {k: not v for k, v in diffs.items()}
    return same, {k: v for k, v in diffs.items() if v}


def _spread(xs: list[float]) -> dict:
    return {"median": _median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "all": xs}


def _exposed(views: dict[str, dict], resident: str = "resident") -> dict:
    """What offload costs a step: per round, each strategy's step seconds less the resident step of
    the same round (rank 0), over the rounds after the first; per phase too; and each against verl's.
    Without a resident strategy, only what needs none: the seconds inside the calls and the stalls."""
    base = views[resident]["per_rank"][0] if resident in views else None
    out: dict = {"what": "per round after the first: the strategy's step seconds less the resident strategy's step "
                         "of the same round (rank 0); median, min, max over the rounds; per phase: the median of "
                         "the phase's seconds less the resident's of the same round"}
    if base is not None:
        rs = base["step_s"][1:]
        out.update({"resident_step_s": _spread(rs),
                    "resident_step_spread": (max(rs) - min(rs)) / _median(rs) if rs else None,
                    "resident_phase_s": {k: _spread([p[k] for p in base["phase_s"][1:] if k in p])
                                         for k in _keys(base["phase_s"][1:])}})
    for label, v in views.items():
        if label == resident:
            continue
        r0 = v["per_rank"][0]
        phases = _keys(r0["phase_s"][1:])
        at_calls = [sum(e["seconds"] for e in r0["events"] if e["step"] == st) for st in range(1, len(r0["step_s"]))]
        at_phase = {k: _median([sum(e["seconds"] for e in r0["events"] if e["step"] == st and e["phase"] == k)
                                for st in range(1, len(r0["step_s"]))]) for k in phases}
        host_phase = {k: _median([sum(e["host_s"] for e in r0["events"] if e["step"] == st and e["phase"] == k)
                                  for st in range(1, len(r0["step_s"]))]) for k in phases}
        out[label] = {"step_s": _spread(r0["step_s"][1:]), "transfer_at_calls_s_per_step": _spread(at_calls),
                      "transfer_at_calls_s_per_phase": at_phase, "host_s_in_calls_per_phase": host_phase}
        if base is not None:
            per_round = [a - b for a, b in zip(r0["step_s"][1:], base["step_s"][1:], strict=False)]
            pairs = list(zip(r0["phase_s"][1:], base["phase_s"][1:], strict=False))
            out[label].update({
                "exposed_transfer_s_per_step": _spread(per_round),
                "exposed_s_per_phase": {k: _median([a[k] - b[k] for a, b in pairs if k in a and k in b])
                                        for k in phases},
                "exposed_s_per_phase_per_round": [{k: a[k] - b[k] for k in a if k in b} for a, b in pairs]})
        stalls = [st or {} for st in (r0.get("stall_s") or [])[1:]]
        if len(stalls) == len(at_calls) and stalls:  # recorded on a GPU ([Note: stalls recorded])
            out[label]["stall_s_per_phase"] = {k: _median([st.get(k, 0.0) for st in stalls]) for k in phases}
            out[label]["attributed_s_per_step"] = _spread([a + sum(st.values()) for a, st in zip(at_calls, stalls,
                                                                                                  strict=True)])
    out["attribution"] = ("exposed_s_per_phase (the phase less the resident's of the same round) beside "
                          "transfer_at_calls_s_per_phase (the phase's FSDPEngine.to seconds, as transfer_at_calls) and "
                          "host_s_in_calls_per_phase (the host's seconds inside those calls): where the first exceeds "
                          "the second, the phase waited on transfers after its calls returned (a layer-wise reload's "
                          "units, optimizer_at_step's state) or ran slower beside them")
    out["transfer_at_calls"] = ("per round after the first: the sum of the step's FSDPEngine.to seconds (an offload "
                                "until its copies are complete, a reload until the compute stream may go on); what a "
                                "layer-wise reload's units or optimizer.step() wait for later is not in it")
    out["attributed"] = ("per round after the first: transfer_at_calls plus the compute stream's waits for "
                         "torchferry's copies outside those calls (stall_s_per_phase: a layer-wise reload's units, "
                         "the optimizer state at step(); CUDA events around each wait, no added synchronisation); "
                         "it does not depend on the resident step, so the host's jitter does not enter it")
    for key, ratio in (("exposed_transfer_s_per_step", "over_verl"), ("transfer_at_calls_s_per_step",
                                                                       "at_calls_over_verl"),
                       ("attributed_s_per_step", "attributed_over_verl")):
        if key not in out.get("verl", {}):
            continue
        v = out["verl"][key]
        for label in out:
            if isinstance(out[label], dict) and key in out[label] and label != "verl":
                t = out[label][key]["median"]
                out[label][ratio] = t / v["median"] if _decided(v) and t is not None else None
    out["ratios"] = ("each *_over_verl: the strategy's median over verl's; None where verl's median is not above "
                     "its own spread (max - min over the rounds): a ratio to a figure smaller than its noise "
                     "decides nothing")
    return out


def _decided(v: dict | None) -> bool:
    """Whether a figure (:func:`_spread`) can be a ratio's denominator: a positive median above its own
    spread (max - min over the rounds)."""
    return bool(v) and v["median"] is not None and v["median"] > 0 and v["median"] > v["max"] - v["min"]


def _keys(rounds: list[dict]) -> list[str]:
    """The phases named in any round, in the order they first appear (a round may lack one: a phase a
    strategy skipped, or a round cut short)."""
    return list(dict.fromkeys(k for r in rounds for k in r))


def report(runs: dict, command: str | None = None) -> dict:
    """The ``torchferry.verl-step/1`` JSON from a run's records (:func:`cmd_run`)."""
    labels = [s["label"] for s in runs["strategies"]]
    kinds = {s["label"]: s["kind"] for s in runs["strategies"]}
    views = {label: _view(runs, label) for label in labels}
    world = runs["env"]["world_size"]

    def summary(label: str) -> dict:
        r0 = views[label]["per_rank"][0]
        sizes = r0["state_bytes"]
        tr = _transfers(r0)
        state = sizes["params"] + sizes["optimizer"]
        spec = next(s for s in runs["strategies"] if s["label"] == label)
        pools = r0["torchferry_pool_bytes"]["pinned"]
        return {
            "kind": kinds[label], **tr,
            "offload_GBps_steady": state / tr["offload_s"]["steady"] / 1e9 if tr["offload_s"]["steady"] else None,
            "reload_GBps_steady": state / tr["reload_s"]["steady"] / 1e9 if tr["reload_s"]["steady"] else None,
            "state_bytes": sizes,
            "pinned_host_bytes": pools + (runs["per_rank"][0]["caching_host_allocator_pinned_bytes"][label]
                                          if kinds[label] == "verl" else 0),
            "pinned_host_bytes_detail": {"torchferry_pools": pools, "torchferry_pool_bytes":
                                         r0["torchferry_pool_bytes"]["host"], "ferries": r0["ferries"]},
            "peak_gpu_allocated_bytes": max(r0["peak_gpu_allocated"]) if r0["peak_gpu_allocated"] else None,
            "gpu_allocated_at_step_start_bytes": _median(r0["gpu_allocated_at_start"]),
            "losses": r0["losses"], "grad_norms": r0["grad_norms"], "log_prob_sum": r0["log_prob_sum"],
            "step_s": r0["step_s"], "phase_s": r0["phase_s"], "order_in_round": r0["order"],
            "bytes_moved_per_step": _bytes_per_step(r0) if "dock" not in r0 else _dock_bytes_per_step(r0),
            "peak_own_gpu_bytes": max(r0["peak_own_gpu_bytes"]) if r0.get("peak_own_gpu_bytes") else None,
            "weight_sync_bytes": r0.get("weight_sync_bytes", 0),  # the last sync's bf16 rollout bytes
            "weight_sync_bytes_per_step": r0.get("weight_sync_bytes_per_step", []),
            "torchferry_settings": spec["settings"] if kinds[label] == "torchferry" else {},
            "build_s": r0["build_s"], "patched": spec["patched"],
            "per_rank": [{"rank": x["rank"], **_transfers(x), "state_bytes": x["state_bytes"]}
                         for x in views[label]["per_rank"]],
        }

    compared = {label: identical(views["verl"], views[label]) for label in labels if label != "verl"}
    ferried = [label for label in labels if kinds[label] == "torchferry"]
    env = dict(runs["env"])
    env["command"] = command or "bash benchmarks/verl_actor.sh"
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env["ray"] = runs["ray"]
    env["torchferry_commit"] = os.environ.get("TORCHFERRY_COMMIT")
    r0 = views["verl"]["per_rank"][0]
    out = {
        "schema": SCHEMA,
        "env": env,
        "verl_code": VERL_CODE,
        "model": runs["config"]["model"],
        "config": {**{k: v for k, v in runs["config"].items() if k not in ("model", "model_dir")},
                   "strategies": runs["strategies"], "interleaved": (
                       "one process per strategy ([Note: one process per strategy] in benchmarks/verl_isolate.py), "
                       "taking turns: " if runs["config"].get("processes", 1) > 1 else
                       "one process, one actor per strategy; ") + "each round runs every strategy's step, the order "
                   "rotated by one each round"},
        "units": "seconds; offload_s: from the call of verl's FSDPEngine.to until its copies are complete "
                 "(synchronised); reload_s: from the call until the compute stream may go on (CUDA events: "
                 "a reload left to the forward or to optimizer.step() counts only its call); bytes per rank; "
                 "GB/s = 1e9 B/s; offload/reload_s are update_actor's (parameters + AdamW state), first = "
                 "step 1, steady = median of the later steps; model_only_* are compute_log_prob's",
        "runs": {label: summary(label) for label in labels},
        "bit_identical": all(all(same.values()) for same, _ in compared.values()),
        "bit_identical_to_verl": {label: all(same.values()) for label, (same, _) in compared.items()},
        "bit_identical_detail": {
            label: {**same, "differing": diff} for label, (same, diff) in compared.items()},
        "compared": {"steps": len(r0["losses"]), "ranks": world,
                     "parameter_shards": sum(x["against_verl"]["compared"]["params"]
                                             for x in views["verl"]["per_rank"]),
                     "optimizer_state_tensors": sum(x["against_verl"]["compared"]["optimizer_state"]
                                                    for x in views["verl"]["per_rank"]),
                     "weight_sync_tensors": r0["against_verl"]["compared"]["weight_sync"]},
        "torchferry_strategies": ferried,
    }
    out["exposed"] = _exposed(views)
    out["strategies"] = {}
    for label in labels:  # per strategy, the dock's bar: its peak against its budget
        ranks = views[label]["per_rank"]
        peaks = [max(x["peak_own_gpu_bytes"]) for x in ranks if x.get("peak_own_gpu_bytes")]
        entry: dict = {"kind": kinds[label], "peak_gpu_bytes": max(peaks) if peaks else None,
                       "bytes_moved_per_step": out["runs"][label]["bytes_moved_per_step"], **_memory(ranks[0])}
        ex = out.get("exposed", {}).get(label)
        if isinstance(ex, dict) and "exposed_transfer_s_per_step" in ex:
            entry["exposed_transfer_s_per_step"] = ex["exposed_transfer_s_per_step"]["median"]
            entry["exposed_over_verl"] = ex.get("over_verl")
        dock = ranks[0].get("dock")
        if dock:
            entry.update(budget_bytes=dock["budget_bytes"], budget=dock["budget"],
                         within_budget=entry["peak_gpu_bytes"] is not None and all(
                             p <= x["dock"]["budget_bytes"] for p, x in zip(peaks, ranks, strict=True)),
                         dock_stats=dock["stats"], dock_phase_log=dock["phase_log"],
                         dock_steps=ranks[0]["dock_steps"])
        out["strategies"][label] = entry
    out["strategies_what"] = ("peak_gpu_bytes: the largest over the steps and ranks of the device's peak allocated "
                              "bytes in the strategy's step (its own: its process's less what it held beside the "
                              "strategy at its first step, or, in one process, less the other strategies' bytes at "
                              "its start); left_behind_bytes_per_step: per step, the process's allocated bytes at its"
                              " start that are neither the strategy's state on the device, its rollout's, nor there "
                              "at the first step (what its helpers left on the device); phase_peak_gpu_bytes: per "
                              "phase, the median over the rounds after the first of that phase's peak allocated bytes"
                              " (rank 0); free_at_rollout_wake_bytes: the median over the rounds after the first, at "
                              "the start of the step before the rollout's KV cache is allocated, of the device's "
                              "bytes less what the strategy's process holds (the caching allocator's reserved bytes "
                              "and its CUDA context, NVML): what a rollout engine allocating outside PyTorch's "
                              "allocator finds free beside this strategy alone; device_free_at_rollout_wake_bytes: "
                              "torch.cuda.mem_get_info()'s free bytes then (other processes' bytes included); "
                              "probe_per_step: the allocator's retries, the garbage collector's seconds, the "
                              "process's CPU seconds, the SM clock per step and NVML's seconds of the step with the "
                              "GPU's clocks capped by power or temperature (gpu_power_capped_s, gpu_thermal_capped_s)"
                              " and its joules (gpu_energy_j); phase_s_per_step / phase_cpu_s_per_step: per step, "
                              "each phase's wall seconds and the process's CPU seconds in it (rank 0; CPU seconds "
                              "near the wall seconds under --blocking-sync: the phase is the host's work); "
                              "gpu_busy_per_step (--gpu-busy): per step, the GPU's busy seconds per phase and in the "
                              "step, from the profiler's CUDA activity (verl_step/gpu_busy.py); "
                              "budget_bytes: the dock's budget (TORCHFERRY_VERL_DOCK); dock_steps: per step, "
                              "the dock's moves (issued at at_s after "
                              "the step's start) and bytes")
    out["bars"] = bars(out)
    return out


def _memory(r0: dict) -> dict:
    """A strategy's device memory per phase and at the rollout's wake (rank 0, rounds after the first)."""
    later = r0.get("phase_peak_gpu_bytes", [])[1:]
    wakes = r0.get("at_rollout_wake", [])[1:]
    alone = [w["free_alone_bytes"] for w in wakes if w.get("free_alone_bytes") is not None]
    return {"phase_peak_gpu_bytes": {k: int(statistics.median([p[k] for p in later if k in p]))
                                     for k in (later[0] if later else {})},
            "phase_peak_gpu_bytes_per_round": r0.get("phase_peak_gpu_bytes", []),
            "free_at_rollout_wake_bytes": int(statistics.median(alone)) if alone else None,
            "device_free_at_rollout_wake_bytes": int(statistics.median([w["device_free_bytes"] for w in wakes]))
            if wakes else None,
            "at_rollout_wake_per_round": r0.get("at_rollout_wake", []), "context_bytes": r0.get("context_bytes"),
            "left_behind_bytes_per_step": r0.get("left_behind_bytes", []),
            "probe_per_step": r0.get("probe", []), "phase_s_per_step": r0.get("phase_s", []),
            "phase_cpu_s_per_step": r0.get("phase_cpu_s", []), "gpu_busy_per_step": r0.get("gpu_busy", [])}


def bars(out: dict) -> dict:
    """The verl step's bars, decided from this run alone: the resident step's spread (max - min over the median,
    <= 0.05), each strategy's exposed transfer over verl's (median, and its worst round against verl's best),
    and its device memory against verl's (free at the rollout's wake >= verl's; no phase's peak above verl's
    by more than 1%). ``None`` where the run lacks what a bar needs, or verl's figure is not above its own
    spread (:func:`_decided`)."""
    ex, st = out.get("exposed") or {}, out["strategies"]
    res: dict = {"resident_step_spread": ex.get("resident_step_spread")}
    v = ex.get("verl", {}).get("exposed_transfer_s_per_step") if ex else None
    vmem = st.get("verl", {})
    for label, entry in st.items():
        if label in ("verl", "resident"):
            continue
        e = ex.get(label, {}).get("exposed_transfer_s_per_step") if ex else None
        row: dict = {}
        if e and v and _decided(v):
            row["exposed_over_verl"] = e["median"] / v["median"]
            row["worst_round_over_verl_best"] = e["max"] / v["min"] if v["min"] > 0 else None
        ea = ex.get(label, {}).get("attributed_s_per_step") if ex else None
        va = ex.get("verl", {}).get("attributed_s_per_step") if ex else None
        if ea and va and _decided(va):  # calls + stalls: no resident step in it
            row["attributed_over_verl"] = ea["median"] / va["median"]
            row["attributed_worst_over_verl_best"] = ea["max"] / va["min"] if va["min"] > 0 else None
        free, vfree = entry.get("free_at_rollout_wake_bytes"), vmem.get("free_at_rollout_wake_bytes")
        row["free_at_wake_ge_verl"] = None if free is None or vfree is None else free >= vfree
        peaks, vpeaks = entry.get("phase_peak_gpu_bytes") or {}, vmem.get("phase_peak_gpu_bytes") or {}
        row["phase_peak_over_verl"] = {k: peaks[k] / vpeaks[k] for k in peaks if vpeaks.get(k)}
        row["no_phase_above_verl_by_1pct"] = all(x <= 1.01 for x in row["phase_peak_over_verl"].values()) \
            if row["phase_peak_over_verl"] else None
        res[label] = row
    return res


def result_name(out: dict) -> str:
    """``verl_step_<preset>_<strategy>-<full|lora>-<shape>_<gpu>x<n>_<date>.json``."""
    c, env = out["config"], out["env"]
    words = (env["gpu"] or "cpu").split()  # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200
    gpu = next((w.lower() for w in words if w[:1] in "HABL" and any(c.isdigit() for c in w)), words[-1].lower())
    mode = f"{c.get('strategy', 'fsdp2')}-{'lora' if c.get('lora') else 'full'}-{c.get('shape', 'small')}"
    return f"verl_step_{out['model']['preset']}_{mode}_{gpu}x{env['world_size']}_{env['date'][:10]}.json"


def per_dock(out: dict) -> dict[str, dict]:
    """One result per dock strategy of a run (``config.docks``): the run's JSON with that strategy as
    ``strategies["torchferry+dock"]`` (the other dock strategies left out of ``strategies``) and its
    budget as ``config.budget`` (tight / roomy), ``config.budget_bytes``, ``config.budget_why``; keyed by
    the file-name suffix ``dock-<budget>``."""
    docks = out["config"].get("docks") or {}
    results = {}
    for label, d in docks.items():
        def one(table: dict, label: str = label) -> dict:  # this dock strategy as torchferry+dock, no other
            return {("torchferry+dock" if k == label else k): v for k, v in table.items()
                    if k == label or k not in docks}

        config = {**out["config"], "budget": d["budget"], "budget_why": d["budget_why"],
                  "budget_bytes": out["strategies"][label].get("budget_bytes"), "dock_strategy": label}
        res = {**out, "config": config}
        for key in ("strategies", "runs", "bit_identical_to_verl", "bit_identical_detail", "exposed"):
            if key in out:
                res[key] = one(out[key])
        results[f"dock-{d['budget'] or d['TORCHFERRY_VERL_DOCK']}"] = res
    return results


def cmd_report(args) -> None:
    runs = merge_runs([json.loads(Path(p).read_text()) for p in args.runs])
    if len(args.runs) > 1:  # the merged records beside the result, as one process writes them
        (Path(args.out_dir) / "runs.json").write_text(json.dumps(runs, indent=1))
    out = report(runs, args.command)
    path = Path(args.out_dir) / result_name(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    for suffix, one in per_dock(out).items():
        name = result_name(out).replace(".json", f"_{suffix}.json")
        (Path(args.out_dir) / name).write_text(json.dumps(one, indent=1))

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"{'':12} {'offload s first/steady':>24} {'reload s first/steady':>24} {'pinned host GB':>15}  losses")
    for k, s in out["runs"].items():
        print(f"{k:12} {f(s['offload_s']['first']) + ' / ' + f(s['offload_s']['steady']):>24} "
              f"{f(s['reload_s']['first']) + ' / ' + f(s['reload_s']['steady']):>24} "
              f"{s['pinned_host_bytes'] / 1e9:>15.2f}  {s['losses']}")
    print(f"bit_identical: {out['bit_identical']} (to verl: {out['bit_identical_to_verl']})")
    if "exposed" in out:
        ex = out["exposed"]
        print("exposed s/step (median [min, max]): " + ", ".join(
            f"{k} {f(v['exposed_transfer_s_per_step']['median'])} [{f(v['exposed_transfer_s_per_step']['min'])}, "
            f"{f(v['exposed_transfer_s_per_step']['max'])}]" + (f" = {f(v['over_verl'])}x verl" if "over_verl" in v
                                                                else "")
            for k, v in ex.items() if isinstance(v, dict) and "exposed_transfer_s_per_step" in v))
        print("transfer at FSDPEngine.to s/step (median [min, max]): " + ", ".join(
            f"{k} {f(v['transfer_at_calls_s_per_step']['median'])} [{f(v['transfer_at_calls_s_per_step']['min'])}, "
            f"{f(v['transfer_at_calls_s_per_step']['max'])}]" + (f" = {f(v['at_calls_over_verl'])}x verl"
                                                                 if "at_calls_over_verl" in v else "")
            for k, v in ex.items() if isinstance(v, dict) and "transfer_at_calls_s_per_step" in v))
        print("attributed s/step, calls + stalls (median [min, max]): " + ", ".join(
            f"{k} {f(v['attributed_s_per_step']['median'])} [{f(v['attributed_s_per_step']['min'])}, "
            f"{f(v['attributed_s_per_step']['max'])}]" + (f" = {f(v['attributed_over_verl'])}x verl"
                                                          if "attributed_over_verl" in v else "")
            for k, v in ex.items() if isinstance(v, dict) and "attributed_s_per_step" in v))
        for k, v in ex.items():
            if isinstance(v, dict) and "exposed_s_per_phase" in v:
                print(f"  {k} per phase: " + ", ".join(f"{p} {f(x)}" for p, x in v["exposed_s_per_phase"].items()))
            if isinstance(v, dict) and "stall_s_per_phase" in v:
                print(f"  {k} stalls per phase: " + ", ".join(f"{p} {f(x)}" for p, x in v["stall_s_per_phase"].items()))
    print(f"wrote {path}")


def cmd_timeline(args) -> None:
    """A PNG of what a dock strategy moved and when: per result (``..._dock-<budget>.json``), its last step's
    phases (from ``dock_steps[-1].marks_s``) and the dock's moves issued in it (loads H2D, evictions D2H;
    the marker at the issue time, the label the set and its GB, "bg" for a prefetch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in args.results]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.3 * len(results)), squeeze=False)
    colors = {"rollout": "#bbbbbb", "log_prob": "#9ecae1", "ref": "#c6dbef", "update": "#6baed6",
              "weight_sync": "#fdae6b"}
    for ax, res in zip(axes[:, 0], results, strict=True):
        st = res["strategies"]["torchferry+dock"]["dock_steps"][-1]
        prev = 0.0
        for phase, end in st["marks_s"].items():
            ax.barh(2, end - prev, left=prev, color=colors.get(phase, "#dddddd"), edgecolor="white")
            if end - prev > 0.15:
                ax.text((prev + end) / 2, 2, phase, ha="center", va="center", fontsize=8)
            prev = end
        for m in st["moves"]:
            if m["kind"] not in ("load", "evict"):
                continue
            row = 1 if m["kind"] == "load" else 0
            ax.plot(m["at_s"], row, marker=">" if row else "<", color="tab:blue" if row else "tab:orange")
            ax.text(m["at_s"], row + 0.28, f"{m['name'].split('.', 1)[1]} {m['bytes'] / 1e9:.1f} GB"
                    + (" bg" if m["background"] else ""), fontsize=7, ha="left")
        if not any(m["kind"] in ("load", "evict") for m in st["moves"]):
            ax.text(0.02, 0.5, "no state moved", fontsize=8)
        c = res["config"]
        ax.set_yticks([0, 1, 2], ["D2H (evict)", "H2D (load)", "phase"])
        ax.set_ylim(-0.6, 2.6)
        ax.set_title(f"{c['budget']} budget, {c['budget_bytes'] / 1e9:.1f} GB: moves issued in the last step "
                     f"(step {len(res['strategies']['torchferry+dock']['dock_steps']) - 1})", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the step's start")
    fig.suptitle(f"verl under a Dock ({results[0]['model']['preset']}, {results[0]['env']['gpu']}, commit "
                 f"{results[0]['env'].get('torchferry_commit')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
