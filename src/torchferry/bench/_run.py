"""``run(...)``: the bench as a typed function (the CLI is a thin layer over it).

Each strategy does its set-up and first round trip, one after another; then the
timed steps run in rounds (``order="interleaved"``): round ``k`` runs every
strategy and the resident baseline once, the order rotated by ``k``, so that
each takes each position and drift falls on all of them alike. The exposures
are taken against the resident baseline of the same round ([Note: exposed time
against a resident baseline] in ``_overlap``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ._link import measure_link_peak, release_host_cache
from ._model import PRESETS, build_model
from ._overlap import apply_peak, observed_rates, raise_peak
from ._rounds import Rounds, checksum, rotated, state_bytes
from ._setup import env_record, shard_fsdp2, start_scenario
from ._strategies import STRATEGIES
from ._summary import account_overlap, prefetch_floor, resident_summary, summarise
from ._units import unit_bytes

__all__ = ["ORDERS", "WORKLOADS", "BenchConfig", "run"]

SCHEMA = "torchferry.bench/1"

WORKLOADS: dict[str, dict[str, int]] = {
    "default": {},
    # Enough tokens per phase that compute can hide a reload: 4096 x 2 x 4 = 32768 per rank.
    "compute-rich": {"seq_len": 4096, "batch_size": 2, "micro_batches": 4},
}
"""Per workload, the values of ``seq_len``, ``batch_size``, ``micro_batches`` it supplies when not given."""

ORDERS = ("interleaved", "sequential")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``torchferry bench`` runs."""

    preset: str | None = None
    """Model size, a key of ``PRESETS``; default ``qwen2.5-1.5b`` on a GPU, ``tiny`` on the CPU."""
    model_path: str | None = None
    """A local Hugging Face checkpoint folder, instead of a preset (default: none)."""
    layers: int | None = None
    """Override the number of decoder layers (default: the preset's)."""
    strategies: tuple[str, ...] = tuple(STRATEGIES)
    """Strategies, set up in this order (default: all); the resident baseline always runs too."""
    steps: int = 3
    """Timed steps per strategy, i.e. rounds (>= 2; ``noise_frac`` needs several to mean much)."""
    workload: str = "default"
    """A key of ``WORKLOADS``: ``compute-rich`` supplies seq_len 4096, batch_size 2, micro_batches 4."""
    order: str = "interleaved"
    """``interleaved``: round-robin rounds, rotated each round; ``sequential``: all steps of one
    strategy, then the next, the resident baseline last."""
    seq_len: int | None = None
    """Tokens per sequence of the forward/backward batch (default: the workload's, else 512; 32 for ``tiny``)."""
    batch_size: int | None = None
    """Sequences per batch (default: the workload's, else 1)."""
    rollout_s: float = 0.0
    """Seconds the simulated rollout holds its KV cache (default 0)."""
    micro_batches: int | None = None
    """Forward(/backward) passes per phase over the batch, gradients accumulated (default: the workload's, else 1)."""
    swap: bool = True
    """Also measure a swap (actor out, a critic of the same size in) with ``torchferry.swap`` (default on)."""
    phase_gap_s: float = 1.0
    """Untimed host seconds between phases, as verl's reward and advantage computation (default 1.0)."""
    trace: str | None = None
    """Path prefix: profile one extra step of each ``torchferry*`` strategy on rank 0 (see ``_trace``)."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"--model {self.model_path}: not a Hugging Face checkpoint folder (no config.json)")
        for s in self.strategies:
            if s not in STRATEGIES:
                raise ValueError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
        if not self.strategies:
            raise ValueError("no strategy to run")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"a strategy is named twice: {', '.join(self.strategies)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        if self.order not in ORDERS:
            raise ValueError(f"unknown order {self.order!r}; choose from {', '.join(ORDERS)}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (first and steady cycles), got {self.steps}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        for name, value, low in (("seq_len", self.seq_len, 2), ("batch_size", self.batch_size, 1),
                                 ("micro_batches", self.micro_batches, 1),
                                 ("rollout_s", self.rollout_s, 0), ("phase_gap_s", self.phase_gap_s, 0)):
            if value is not None and not (value >= low and math.isfinite(value)):  # NaN fails both
                raise ValueError(f"{name} must be a finite number >= {low}, got {value}")
        if self.preset is not None and self.model_path is not None:
            raise ValueError("give either a preset or --model, not both")

    def resolved(self, preset: str) -> dict[str, int]:
        """``{"seq_len", "batch_size", "micro_batches"}``: as given, else the workload's, else the defaults."""
        given = {"seq_len": self.seq_len, "batch_size": self.batch_size, "micro_batches": self.micro_batches}
        defaults = {"seq_len": 32 if preset == "tiny" else 512, "batch_size": 1, "micro_batches": 1}
        defaults.update(WORKLOADS[self.workload])
        return {k: defaults[k] if v is None else v for k, v in given.items()}


def _swap_scenario(config: BenchConfig, preset: str, actor: nn.Module, actor_opt: torch.optim.Optimizer,
                   device: torch.device, world: int, batch: torch.Tensor, peak: dict | None, reps: int = 3) -> dict:
    """Actor out while a critic of the same size comes in, both directions at once.

    Returns ``{"GBps", "out_bytes", "in_bytes", "seconds", "frac_of_bidir_peak", "bit_exact", "timeline"}``:
    medians over ``reps`` swaps alternating direction; seconds from the call until both
    transfers are complete; GB/s counts both directions.
    """
    import torch.distributed as dist

    from .. import Ferry, swap

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


def _host_pages() -> dict | None:
    try:
        from .._core._host.memory import host_page_report
    except ImportError:  # an engine without it
        return None
    return host_page_report()


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
        ("no CUDA device: ran on the CPU end to end; transfer figures need a GPU (GB/s are left out: "
         "CPU copies of a tiny model time Python overhead, not a link)")]
    names = list(config.strategies)
    # The resident baseline's step too: the same phases' kernels with nothing in flight.
    traced = [*(n for n in names if n.startswith("torchferry")), "resident"] if config.trace else []
    bench = Rounds(config, model, opt, device, batch, shape["micro_batches"], sizes, say)
    order_per_round: list[list[str]] | None = None
    release_host_cache()
    if config.order == "interleaved":
        for name in names:
            bench.first_cycle(name)
        order_per_round = [rotated([*names, "resident"], k) for k in range(config.steps)]
        for order in order_per_round:
            for name in order:
                bench.timed_step(name)
        for name in traced:
            bench.traced_step(name, rank, traces, trace_files, notes)
    else:
        for name in [*names, "resident"]:
            if name != "resident":
                release_host_cache()  # as when each strategy ran alone: no pinned blocks inherited
                bench.first_cycle(name)
            for _ in range(config.steps):
                bench.timed_step(name)
            if name in traced:
                bench.traced_step(name, rank, traces, trace_files, notes)
            bench.bring_back()
    host_pages = _host_pages()  # the torchferry pools still alive
    bench.close()
    release_host_cache()

    results = {n: summarise(bench.first[n], bench.records[n], sizes, overlaps_reload=STRATEGIES[n].overlaps_reload)
               for n in names}
    account_overlap(results, bench.records, bench.records["resident"])
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
                                            peak["h2d"] if peak else None, sizes)
        results["torchferry+prefetch"]["exposed_reload_floor_s_per_step"] = floor
        results["torchferry+prefetch"]["floor_detail"] = detail
        if why:
            notes.append(why)
    say("done", 1.0)

    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "link_peak_GBps": peak, "link_peak_measured_GBps": measured,
                                      "strategies": results})
    env = env_record(device, world)
    env["host_pages"] = host_pages
    return {
        "schema": SCHEMA,
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
        },
        # What ran: the defaults resolved (preset, seq_len, batch_size, micro_batches), not the options as given.
        "config": dataclasses.asdict(
            dataclasses.replace(config, preset=None if config.model_path else preset, **shape)),
        "order": config.order,
        "order_per_round": order_per_round,
        "strategies": results,
        "baseline_resident": baseline,
        "noise_frac": noise,
        "swap": swap_result,
        "traces": traces,
        "trace_files": trace_files,
        "per_rank": gathered,
        "notes": notes,
    }
