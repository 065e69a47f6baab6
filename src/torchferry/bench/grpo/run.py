"""A GRPO-like colocated step under a GPU budget: verl-style offload after every phase, against a Dock.

One step, as a colocated GRPO trainer runs it on every rank::

    rollout       a rollout engine's KV cache (a claimant of ``kv_bytes``) fills and is freed
    ref_log_prob  forward of the reference model (parameters only; same architecture as the actor)
    old_log_prob  forward of the actor (parameters)
    update_actor  forward, backward and AdamW step of the actor (parameters + optimizer state)

under a GPU budget too small to hold all of it at once (the reason verl users
turn offload on). Strategies, measured in the same run, their steps
interleaved (the order alternates every round, to cancel order effects):

* ``torchferry``: one ``Ferry`` per state set, each reloaded before its phase
  and offloaded after it, as verl's ``param_offload`` / ``optimizer_offload``
  do (offload waited for; no ``empty_cache``: the KV cache here is allocated
  through PyTorch's caching allocator, which reuses the blocks).
* ``torchferry+dock``: the same ferries in a :class:`~torchferry.Dock` with
  the step's schedule; each phase is a ``dock.use(...)`` that prefetches the
  next phase. The phases' workspaces (activations, gradients, AdamW
  temporaries, measured in a warm-up) are byte-count claimants, so the
  budget covers everything the step allocates.

Exposed transfer time of a phase is its wall time minus the same phase's
compute with its state resident, measured in the same run (every round, on
both strategies' models, moves untimed). A step's figure is the sum over its
phases; a background move still in flight at the end of a step is waited for
inside ``update_actor`` (the next rollout would need its room). ``bit_exact``:
both strategies' actors (parameters and AdamW state) are identical after the
run (``torch.equal``, deterministic kernels, eager attention).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from torchferry import Dock

from .._common.link import measure_link_peak
from .._common.output import NO_GPU
from .._common.presets import PRESETS
from .._common.setup import env_record, start_scenario
from .config import BUDGET_RULE, PHASES, SCHEDULE, SCHEMA, STRATEGIES, GrpoConfig
from .report import median, summarise
from .steps import (
    StepClock,
    build_side,
    calibrate,
    check_room,
    compare,
    log_prob,
    settle,
    step_dock,
    step_torchferry,
    train,
    workspace,
)

__all__ = ["PHASES", "SCHEMA", "STRATEGIES", "GrpoConfig", "run_grpo"]


def run_grpo(config: GrpoConfig, *, on_progress: Callable[[str, float], None] | None = None) -> dict:
    """Runs the GRPO scenario and returns its results (the ``torchferry.bench-grpo/1`` JSON, as a dict).

    Every rank runs the same steps; rank 0's figures are the headline and
    ``per_rank`` holds every rank's. Bytes are per rank; seconds are wall
    clock (the current stream synchronised at phase ends); GB/s = 1e9 B/s.

    Raises:
        ValueError: a preset that needs a GPU on a machine without one, more
            ranks than GPUs, or a budget that cannot hold the largest phase.
    """
    import torch.distributed as dist

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before its first use)
    use_cuda, preset, rank, world, device, say = start_scenario(config.preset, "qwen2.5-1.5b", on_progress)
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # no memsets in every reload
    seq_len = config.seq_len if config.seq_len is not None else (32 if preset == "tiny" else 512)
    notes: list[str] = []

    peak = None
    if use_cuda:
        say("measuring the link peak (pinned 1 GiB copies)", 0.0)
        p = measure_link_peak(device, barrier=dist.barrier)
        peak = {"h2d": p.h2d, "d2h": p.d2h, "bidir": p.bidir}
    gen = torch.Generator().manual_seed(rank)
    vocab = PRESETS[preset].vocab_size
    batch = torch.randint(0, vocab, (config.batch_size, seq_len), generator=gen).to(device)

    # The baseline's models first: their workspaces are measured with everything resident, then
    # their state goes to the host before the dock's models are built.
    say(f"building {preset} (actor, AdamW, reference) for torchferry", 0.02)
    base = build_side("torchferry", preset, config, device, world, batch, 0)
    if use_cuda:
        w_upd = workspace(device, lambda: train(base.actor, base.opt, batch, config.micro_batches))
        w_fwd = workspace(device, lambda: log_prob(base.actor, batch, config.micro_batches))
        w_upd, w_fwd = int(w_upd * 1.02) + (64 << 20), int(w_fwd * 1.02) + (64 << 20)
    else:
        train(base.actor, base.opt, batch, config.micro_batches)
        notes.append("no CUDA device: ran on the CPU end to end; workspaces estimated (2x and 0.25x the "
                     f"actor's parameters); {NO_GPU} (the JSON's seconds time Python, not a link)")
        w_upd = w_fwd = -1
    for f in base.ferries.values():
        f.reserve_host()
    for f in base.ferries.values():
        f.offload().wait()
    sizes = {n: f.state_bytes for n, f in base.ferries.items()}  # what an offload moves (FSDP2 resharded)
    vals = torch.tensor([sizes["actor_params"], sizes["actor_optimizer"], sizes["ref"], w_upd, w_fwd],
                        dtype=torch.int64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    P, O_, R, w_upd, w_fwd = (int(v) for v in vals.tolist())
    if w_upd < 0:
        w_upd, w_fwd = 2 * P, P // 4
    kv_bytes = config.kv_bytes if config.kv_bytes is not None else P + O_
    everything = P + O_ + R + max(kv_bytes, w_upd, w_fwd)
    budget = config.budget_bytes
    if budget is None:
        budget = max(P + O_ + max(kv_bytes, w_upd) + R // 2, P + O_ + R + w_fwd)
    largest = max(kv_bytes, P + O_ + w_upd, R + w_fwd, P + w_fwd)
    if budget < largest:
        raise ValueError(f"budget_bytes={budget} cannot hold the largest phase ({largest} bytes: KV cache "
                         f"{kv_bytes}, actor + update workspace {P + O_ + w_upd}, reference + forward {R + w_fwd})")
    if budget >= everything:
        notes.append(f"the budget ({budget} bytes) holds everything at once ({everything} bytes): "
                     "nothing needs to move")
    base.kv.nbytes = kv_bytes
    sides = {"torchferry": base} if "torchferry" in config.strategies else {}
    if "torchferry+dock" in config.strategies:
        say(f"building {preset} for torchferry+dock", 0.1)
        d = build_side("torchferry+dock", preset, config, device, world, batch, kv_bytes)
        train(d.actor, d.opt, batch, config.micro_batches)  # the same two warm-up updates as the baseline
        d.ferries["ref"].reserve_host()
        d.ferries["ref"].offload().wait()
        dock = Dock(budget, device=device)
        for n in ("actor_params", "actor_optimizer", "ref"):
            dock.add(n, d.ferries[n])
        dock.add_claimant("rollout", kv_bytes, sleep=d.kv.sleep, wake=d.kv.wake)
        dock.add_claimant("fwd_workspace", w_fwd)
        dock.add_claimant("update_workspace", w_upd)
        dock.plan(SCHEDULE)
        d.dock = dock
        sides["torchferry+dock"] = d
    for side in sides.values():
        side.workspace = {"forward": w_fwd, "update": w_upd}
    if use_cuda:
        torch.cuda.synchronize(device)
    probes = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)} if use_cuda else None

    names = list(sides)
    records: dict[str, list[dict]] = {n: [] for n in names}
    calib: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    timelines: dict[str, dict] = {}
    rounds = config.warmup_steps + config.steps
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            side = sides[name]
            say(f"step {r + 1}/{rounds}: {name}", 0.15 + 0.8 * (r + 0.5) / rounds)
            if use_cuda and side.dock is None and "torchferry+dock" in sides:
                check_room(device, sides["torchferry+dock"].resident_bytes(),
                            max(kv_bytes, P + O_ + w_upd, R + w_fwd))
            dist.barrier()
            if use_cuda:
                settle(device)  # memory_allocated() without blocks whose copies are done
                foreign = torch.cuda.memory_allocated(device) - side.resident_bytes()  # the other side's, the batch
                torch.cuda.reset_peak_memory_stats(device)
            clock = StepClock(device, probes)
            step = (step_dock if side.dock is not None else step_torchferry)(side, batch, config, clock)
            if use_cuda:
                torch.cuda.synchronize(device)
                step["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) - foreign
            else:
                step["peak_gpu_bytes"] = None
            tl = clock.finish()
            step["bytes"] = {e: sum(c["nbytes"] for c in tl["copies"] if c["engine"] == e) for e in ("h2d", "d2h")}
            step["copies"] = len(tl["copies"])
            step["peak_accounted_bytes"] = max(clock.accounted)
            if r >= config.warmup_steps:
                records[name].append(step)
                timelines[name] = tl
        for name in (names if r % 2 else names[::-1]):
            c = calibrate(sides[name], batch, config, device)
            if r >= config.warmup_steps:
                calib[name].append(c)

    pooled = {p: median([c[p] for n in names for c in calib[n]]) for p in PHASES}
    results = {n: summarise(records[n], pooled, budget, timelines.get(n)) for n in names}
    for n in names:
        results[n]["calibrated_compute_s"] = {p: median([c[p] for c in calib[n]]) for p in PHASES}
    if "torchferry+dock" in sides:
        results["torchferry+dock"]["dock_stats"] = dataclasses.asdict(sides["torchferry+dock"].dock.stats)
    detail = None
    if len(sides) == 2:
        say("comparing the actors bit for bit", 0.97)
        detail = compare(sides["torchferry"], sides["torchferry+dock"], device)
        same_losses = results["torchferry"]["losses"] == results["torchferry+dock"]["losses"]
        detail["losses_equal"] = same_losses
        bit_exact = detail["actor_params_equal"] and detail["optimizer_state_equal"]
        base_x = results["torchferry"]["exposed_transfer_s_per_step"]
        results["torchferry+dock"]["exposed_vs_torchferry"] = (
            results["torchferry+dock"]["exposed_transfer_s_per_step"] / base_x if base_x else None)
    else:
        bit_exact = None
        notes.append("bit_exact compares two strategies: one ran")
    for n in names:
        results[n]["bit_exact"] = bit_exact
    say("done", 1.0)

    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "strategies": {
        n: {k: v for k, v in s.items() if k != "timeline_step"} for n, s in results.items()}})
    layers = base.actor.config.num_hidden_layers
    for side in sides.values():
        side.let_go()
    return {
        "schema": SCHEMA,
        "env": env_record(device, world),
        "link_peak_GBps": peak,
        "model": {"preset": preset, "layers": layers, "seq_len": seq_len,
                  "batch_size": config.batch_size, "micro_batches": config.micro_batches,
                  "state_bytes": {"actor_params": P, "actor_optimizer": O_, "ref_params": R}},
        "budget": {
            "gpu_budget_bytes": budget,
            "kv_bytes": kv_bytes,
            "workspace_bytes": {"forward": w_fwd, "update": w_upd},
            "everything_bytes": everything,
            "holds_everything": budget >= everything,
            "rule": BUDGET_RULE if config.budget_bytes is None else "given",
        },
        "schedule": [list(p) for p in SCHEDULE],
        "config": dataclasses.asdict(dataclasses.replace(config, preset=preset, seq_len=seq_len)),
        "calibrated_compute_s": pooled,
        "strategies": results,
        "bit_exact": bit_exact,
        "bit_exact_detail": detail,
        "per_rank": gathered,
        "notes": notes,
    }
