"""``run(...)``: the bench as a typed function (the CLI is a thin layer over it).

Each strategy does its set-up and first round trip, one after another; then the
timed steps run in rounds (``order="interleaved"``): round ``k`` runs every
strategy and the resident baseline once, the order rotated by ``k``, so that
each takes each position and drift falls on all of them alike. The exposures
are taken against the resident baseline of the same round ([Note: exposed time
against a resident baseline] in ``overlap``). Without a GPU the run goes end
to end (bit-exactness, the steps, the bytes) and every transfer figure is
``None`` (``summary.blank_transfer_figures``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from torchferry import Ferry, swap

from .._common.host_pages import host_page_report
from .._common.link import measure_link_peak, release_host_cache
from .._common.model import build_model
from .._common.output import NO_GPU
from .._common.setup import env_record, shard_fsdp2, start_scenario
from .._common.state import checksum, state_bytes
from .._common.units import unit_bytes
from .config import ORDERS, SCHEMA, WORKLOADS, BenchConfig
from .overlap import apply_peak, observed_rates, raise_peak
from .rounds import Rounds, rotated
from .strategies import STRATEGIES
from .summary import (account_overlap, blank_transfer_figures, dma_penalty, prefetch_floor, resident_summary,
                      summarise)

__all__ = ["ORDERS", "WORKLOADS", "BenchConfig", "run"]


def _swap_scenario(config: BenchConfig, preset: str, actor: nn.Module, actor_opt: torch.optim.Optimizer,
                   device: torch.device, world: int, batch: torch.Tensor, peak: dict | None, reps: int = 3) -> dict:
    """Actor out while a critic of the same size comes in, both directions at once.

    Returns ``{"GBps", "out_bytes", "in_bytes", "seconds", "frac_of_bidir_peak", "bit_exact", "timeline"}``:
    medians over ``reps`` swaps alternating direction; seconds from the call until both
    transfers are complete; GB/s counts both directions.
    """
    import torch.distributed as dist

    critic = build_model(preset, device, path=config.model_path, layers=config.layers, seed=1)
    shard_fsdp2(critic, device, world)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-5)
    critic(input_ids=batch, labels=batch).loss.backward()
    critic_opt.step()
    critic_opt.zero_grad(set_to_none=True)
    a, c = Ferry(actor, actor_opt), Ferry(critic, critic_opt)
    a.reserve_host()
    c.reserve_host()
    want = (checksum(actor), checksum(critic))
    c.offload().wait()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pairs, times, timeline = [(a, c), (c, a)], [], None
    for i in range(reps):
        out, into = pairs[i % 2]
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        h_out, h_in = swap(out, into)
        h_out.wait()
        t_out = time.perf_counter() - t0
        h_in.wait()
        t = time.perf_counter() - t0
        times.append((t, h_out.nbytes, h_in.nbytes))
        if i == 0:
            timeline = [{"phase": "swap", "kind": "d2h", "start": 0.0, "end": h_out.seconds or t_out,
                         "nbytes": h_out.nbytes},
                        {"phase": "swap", "kind": "h2d", "start": 0.0, "end": h_in.seconds or t, "nbytes": h_in.nbytes}]
    if a.residency.on_host:
        a.reload().wait()
    c.offload().wait()
    bit_exact = checksum(actor) == want[0]
    c.reload().wait()
    bit_exact = bit_exact and checksum(critic) == want[1]
    a.close()
    c.close()
    del critic, critic_opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t, out_b, in_b = sorted(times)[len(times) // 2]
    gbps = (out_b + in_b) / t / 1e9
    return {"GBps": gbps, "out_bytes": out_b, "in_bytes": in_b, "seconds": t,
            "frac_of_bidir_peak": gbps / peak["bidir"] if peak else None, "bit_exact": bit_exact,
            "reps": [{"seconds": x[0], "out_bytes": x[1], "in_bytes": x[2]} for x in times], "timeline": timeline}


def run(config: BenchConfig, *, on_progress: Callable[[str, float], None] | None = None) -> dict:
    """Runs the bench and returns its results (the ``torchferry.bench/1`` JSON, as a dict).

    Every rank runs the same steps; rank 0's figures are the headline and
    ``per_rank`` holds every rank's. Bytes are per rank; seconds are wall
    clock from the call to completion (synchronised); GB/s = 1e9 B/s.

    Args:
        config: what to run.
        on_progress: called with (message, fraction done) on rank 0.

    Raises:
        ValueError: a preset that needs a GPU on a machine without one, or
            more ranks than GPUs.
    """
    import torch.distributed as dist

    use_cuda, preset, rank, world, device, say = start_scenario(
        config.preset, "qwen2.5-1.5b", on_progress, local_model=config.model_path is not None)
    shape = config.resolved(preset)

    measured = solo = None
    if use_cuda:
        say("measuring the link peak (pinned 1 GiB copies)", 0.0)
        p = measure_link_peak(device, barrier=dist.barrier)
        measured, solo = {"h2d": p.h2d, "d2h": p.d2h, "bidir": p.bidir}, p.solo
    say(f"building {config.model_path or preset}", 0.02)
    try:
        model = build_model(preset, device, path=config.model_path, layers=config.layers)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {config.model_path}: could not load it ({e})") from e
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ValueError(
            f"--model {config.model_path}: {type(model).__name__} has no model.layers; the bench needs a "
            "decoder-only causal LM laid out like Qwen2 or Llama"
        )
    shard_fsdp2(model, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (shape["batch_size"], shape["seq_len"]), generator=gen).to(device)  # pyright: ignore[reportArgumentType, reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up: optimizer state exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    sizes = state_bytes(model, opt, device)

    traces: dict[str, dict] = {}
    trace_files: list[str] = []
    notes: list[str] = [] if use_cuda else [
        (f"no CUDA device: ran on the CPU end to end; {NO_GPU} (their seconds, GB/s, exposures and ratios "
         "are null: CPU copies of a tiny model time Python overhead, not a link)")]
    names = list(config.strategies)
    # The resident baseline's step too: the same phases' kernels with nothing in flight.
    traced = [*(n for n in names if n.startswith("torchferry")), "resident"] if config.trace else []
    dma = use_cuda and "torchferry+prefetch" in names  # see [Note: the copies' own cost] in ``overlap``
    bench = Rounds(config, model, opt, device, batch, shape["micro_batches"], sizes, say, dma_baseline=dma)
    order_per_round: list[list[str]] | None = None
    release_host_cache()
    if config.order == "interleaved":
        for name in names:
            bench.first_cycle(name)
        order_per_round = [rotated([*names, *bench.baselines], k) for k in range(config.steps)]
        for order in order_per_round:
            for name in order:
                bench.timed_step(name)
        for name in traced:
            bench.traced_step(name, rank, traces, trace_files, notes)
    else:
        for name in [*names, *bench.baselines]:
            if name not in bench.baselines:
                release_host_cache()  # as when each strategy ran alone: no pinned blocks inherited
                bench.first_cycle(name)
            for _ in range(config.steps):
                bench.timed_step(name)
            if name in traced:
                bench.traced_step(name, rank, traces, trace_files, notes)
            bench.bring_back()
    latency = None
    if use_cuda and "torchferry+prefetch" in names:  # see [Note: switch points]
        latency = bench.small_copy_latency("torchferry+prefetch")
    ferries = bench.ferries  # the torchferry pools still alive
    host_pages = host_page_report(ferries.model.host_bytes + ferries.optimizer.host_bytes if ferries else 0)
    bench.close()
    release_host_cache()

    results = {n: summarise(bench.first[n], bench.records[n], sizes, overlaps_reload=STRATEGIES[n].overlaps_reload)
               for n in names}
    account_overlap(results, bench.records, bench.records["resident"])
    dma_result = dma_penalty(results, bench.records.get("resident+dma"), bench.records["resident"])
    if latency is not None:
        results["torchferry+prefetch"]["small_h2d_latency_ms"] = latency["h2d"]
        results["torchferry+prefetch"]["small_d2h_latency_ms"] = latency["d2h"]
    baseline, noise = resident_summary(bench.records["resident"], bench.timer.medians())
    swap_result = None
    if config.swap:
        say("swap: actor out, critic in", 0.98)
        swap_result = _swap_scenario(config, preset, model, opt, device, world, batch, measured)
    # The link peak, never below a rate the run reached; then every fraction of it.
    peak, raised = raise_peak(measured, observed_rates(results, swap_result))
    apply_peak(results, swap_result, peak)
    if "torchferry+prefetch" in results:
        floor, detail, why = prefetch_floor(unit_bytes(bench.units), baseline["unit_compute_s"],
                                            bench.records["resident"], bench.records.get("torchferry"),
                                            peak["h2d"] if peak else None, sizes) if use_cuda else (None, None, None)
        results["torchferry+prefetch"]["exposed_reload_floor_s_per_step"] = floor
        results["torchferry+prefetch"]["floor_detail"] = detail
        if why:
            notes.append(why)
    if not use_cuda:
        blank_transfer_figures(results, baseline, swap_result)
        noise = None
    say("done", 1.0)

    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "link_peak_GBps": peak, "link_peak_measured_GBps": measured,
                                      "strategies": results})
    env = env_record(device, world)
    env["host_pages"] = host_pages
    return {
        "schema": SCHEMA,
        "transfer_figures": use_cuda,  # False: no GPU, every transfer figure is null
        "env": env,
        "link_peak_GBps": peak,
        "link_peak_measured_GBps": measured,
        "link_peak_solo_GBps": solo,  # the ranks taking turns (see LinkPeak): what contention costs
        "link_peak_raised": raised,
        "model": {
            "preset": None if config.model_path else preset,
            "path": config.model_path,
            "layers": model.config.num_hidden_layers,
            "state_bytes": sizes,
            **shape,
            "tokens_per_phase_per_rank": shape["seq_len"] * shape["batch_size"] * shape["micro_batches"],
            "fsdp_units": len(bench.units),
            "fsdp_unit_bytes": unit_bytes(bench.units),
        },
        # What ran: the defaults resolved (preset, seq_len, batch_size, micro_batches), not the options as given.
        "config": dataclasses.asdict(
            dataclasses.replace(config, preset=None if config.model_path else preset, **shape)),
        "order": config.order,
        "order_per_round": order_per_round,
        "strategies": results,
        "baseline_resident": baseline,
        "baseline_resident_dma": dma_result,
        "noise_frac": noise,
        "swap": swap_result,
        "traces": traces,
        "trace_files": trace_files,
        "per_rank": gathered,
        "notes": notes,
    }
