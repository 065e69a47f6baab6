"""``run(...)``: the bench as a typed function (the CLI is a thin layer over it)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ._link import measure_link_peak, release_host_cache
from ._model import PRESETS, build_model
from ._strategies import STRATEGIES, make_strategy
from ._setup import env_record, init_distributed, shard_fsdp2
from ._trace import profile_step, trace_paths, write_trace
from ._workload import StepRecord, run_step

__all__ = ["BenchConfig", "run"]

SCHEMA = "torchferry.bench/1"


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
    """Strategies, run one after another in this order (default: all)."""
    steps: int = 3
    """RL steps per strategy (>= 2: the first cycle is reported apart from the steady ones)."""
    seq_len: int | None = None
    """Tokens per sequence of the forward/backward batch (default: 512; 32 for ``tiny``)."""
    batch_size: int = 1
    """Sequences per batch (default 1)."""
    rollout_s: float = 0.0
    """Seconds the simulated rollout holds its KV cache (default 0)."""
    micro_batches: int = 1
    """Forward(/backward) passes per phase over the batch, gradients accumulated (default 1)."""
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
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (first and steady cycles), got {self.steps}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        for name, value, low in (("seq_len", 2 if self.seq_len is None else self.seq_len, 2),
                                 ("batch_size", self.batch_size, 1),
                                 ("micro_batches", self.micro_batches, 1),
                                 ("rollout_s", self.rollout_s, 0), ("phase_gap_s", self.phase_gap_s, 0)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.preset is not None and self.model_path is not None:
            raise ValueError("give either a preset or --model, not both")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    def unique(ts):
        seen = {}
        for t in ts:
            st = _local(t).untyped_storage()
            if _local(t).device == device:
                seen[st._cdata] = st.nbytes()
        return sum(seen.values())

    return {
        "params": unique(model.parameters()),
        "grads": unique(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer": unique(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(model: nn.Module) -> list[int]:
    """Per parameter, the sum of its local shard's bits as integers (int64, wrapping).

    Exact and independent of summation order, so a shard read on the host
    (still offloaded, during a layer-wise reload) and on the device give the
    same value; a float sum would differ by rounding.
    """
    with torch.no_grad():
        out = []
        for p in model.parameters():
            t = _local(p).contiguous()
            out.append(int(t.view(_INT_VIEW[t.element_size()]).sum(dtype=torch.int64)) if t.numel() else 0)
        return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _summarise(first_offload_s: float, first_reload_s: float, pin_s: float, records: list[StepRecord],
               sizes: dict[str, int], peak: dict | None, bit_exact: bool) -> dict:
    state = sizes["params"] + sizes["grads"] + sizes["optimizer"]

    def spans(phase: str, kind: str) -> list[float]:
        return [s.seconds for r in records for s in r.spans if s.phase == phase and s.kind == kind]

    off_steady = _median(spans("update_actor", "d2h"))
    re_first, re_steady = first_reload_s, _median(spans("update_actor", "h2d"))
    out = {
        "offload_s": {"first": first_offload_s, "steady": off_steady},
        "reload_s": {"first": re_first, "steady": re_steady},
        "offload_GBps": state / off_steady / 1e9,
        "reload_GBps": state / re_steady / 1e9,
        "offload_frac_of_peak": None,
        "reload_frac_of_peak": None,
        "model_only": {"offload_s": _median(spans("old_log_prob", "d2h")),
                       "reload_s": _median(spans("old_log_prob", "h2d")), "bytes": sizes["params"]},
        "exposed_transfer_s_per_step": _median([r.exposed_transfer_s for r in records[1:]]),
        "transfer_spans_s_per_step": _median([r.exposed_transfer_s for r in records[1:]]),
        "reload_s_per_step": _median([sum(sp.seconds for sp in r.spans if sp.kind == "h2d") for r in records[1:]]),
        "exposed_reload_s_per_step": _median([sum(sp.seconds for sp in r.spans if sp.kind == "h2d")
                                              for r in records[1:]]),
        "compute_s": {ph: _median([s.seconds for r in records[1:] for s in r.spans
                                   if s.phase == ph and s.kind == "compute"]) for ph in ("old_log_prob", "update_actor")},
        "step_s": _median([r.train_s for r in records[1:]]),
        "pinned_host_bytes": max(r.pinned_host_bytes for r in records),
        "gpu_bytes_left_offloaded": _median([r.gpu_bytes_left_offloaded for r in records]),
        "rollout_alloc_ok": all(r.rollout_alloc_ok for r in records),
        "rollout_alloc_bytes": records[0].rollout_alloc_bytes,
        "empty_cache_s": _median(spans("update_actor", "release")),
        "pinning": {"seconds": pin_s, "GBps": (state / pin_s / 1e9) if pin_s else None},
        "round_trip_bit_exact": bit_exact,
        "losses": [r.loss for r in records],
        "timeline_step": [dataclasses.asdict(s) for s in records[min(1, len(records) - 1)].spans],
    }
    if peak:
        out["offload_frac_of_peak"] = out["offload_GBps"] / peak["d2h"]
        out["reload_frac_of_peak"] = out["reload_GBps"] / peak["h2d"]
    return out


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
    want = (_checksum(actor), _checksum(critic))
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
            timeline = [{"phase": "swap", "kind": "d2h", "start": 0.0, "end": h_out.seconds or t_out, "nbytes": h_out.nbytes},
                        {"phase": "swap", "kind": "h2d", "start": 0.0, "end": h_in.seconds or t, "nbytes": h_in.nbytes}]
    if a.residency.on_host:
        a.reload().wait()
    c.offload().wait()
    bit_exact = _checksum(actor) == want[0]
    c.reload().wait()
    bit_exact = bit_exact and _checksum(critic) == want[1]
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


def _account_overlap(results: dict[str, dict]) -> None:
    """Exposed transfer time of overlapped strategies.

    A ``+prefetch`` strategy's reload call returns at once and its waits fall
    inside compute, so its exposed transfer time per step is its transfer spans
    plus the compute time it adds over plain ``torchferry`` in the same run
    (per phase, medians); its exposed reload time likewise, from its reload
    spans, also as a fraction of plain ``torchferry``'s reload time per step. Without a ``torchferry`` run to compare with, it is
    left as measured, with a note.
    """
    base = results.get("torchferry")
    for name, r in results.items():
        if not name.endswith("+prefetch"):
            continue
        if base is None:
            r["overlap_note"] = "no plain torchferry run to compare compute time with"
            continue
        extra = 0.0
        for phase in ("old_log_prob", "update_actor"):
            extra += max(0.0, r["compute_s"][phase] - base["compute_s"][phase])
        r["reload_GBps"] = r["reload_frac_of_peak"] = None  # its reload span is the issue time
        r["exposed_transfer_s_per_step"] = r["transfer_spans_s_per_step"] + extra
        r["exposed_reload_s_per_step"] = r["reload_s_per_step"] + extra
        r["compute_overhead_s_per_step"] = extra
        r["overlap_baseline"] = "torchferry"
        if base.get("reload_s_per_step"):
            # The reload time left on the critical path, against the same run's non-overlapped reload.
            r["exposed_reload_vs_torchferry_reload"] = r["exposed_reload_s_per_step"] / base["reload_s_per_step"]


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

    use_cuda = torch.cuda.is_available()
    preset = config.preset or ("qwen2.5-1.5b" if use_cuda else "tiny")
    if not use_cuda and config.model_path is None and preset != "tiny":
        raise ValueError(f"preset {preset!r} needs a GPU; on a machine without CUDA use --preset tiny")
    rank, world, device = init_distributed(use_cuda)
    say = on_progress if (on_progress and rank == 0) else (lambda msg, frac: None)
    seq_len = config.seq_len if config.seq_len is not None else (32 if preset == "tiny" else 512)

    peak = None
    if use_cuda:
        say("measuring the link peak (pinned 1 GiB copies)", 0.0)
        p = measure_link_peak(device, barrier=dist.barrier)
        peak = {"h2d": p.h2d, "d2h": p.d2h, "bidir": p.bidir}
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
    batch = torch.randint(0, vocab, (config.batch_size, seq_len), generator=gen).to(device)
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up: optimizer state exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    sizes = _state_bytes(model, opt, device)
    state = sum(sizes.values())

    results: dict[str, dict] = {}
    traces: dict[str, dict] = {}
    trace_files: list[str] = []
    notes: list[str] = [] if use_cuda else [
        "no CUDA device: ran on the CPU end to end; transfer figures need a GPU (GB/s are left out: "
        "CPU copies of a tiny model time Python overhead, not a link)"]
    n = len(config.strategies)
    for i, name in enumerate(config.strategies):
        say(f"{name}: setting up", 0.05 + 0.95 * i / n)
        release_host_cache()
        if use_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        strategy = make_strategy(name, model, opt, device)
        dist.barrier()
        pin_s = strategy.setup()
        before = _checksum(model)
        dist.barrier()
        t = time.perf_counter()
        strategy.offload(optimizer=True)
        first_offload = time.perf_counter() - t
        strategy.release()
        time.sleep(config.phase_gap_s)
        dist.barrier()
        t = time.perf_counter()
        strategy.reload(optimizer=True)
        first_reload = time.perf_counter() - t
        bit_exact = _checksum(model) == before  # the first round trip changed no bit
        strategy.offload(optimizer=True)
        strategy.release()
        records = []
        for step in range(config.steps):
            say(f"{name}: step {step + 1}/{config.steps}", 0.05 + 0.95 * (i + (step + 1) / (config.steps + 1)) / n)
            dist.barrier()
            records.append(run_step(strategy, batch, param_bytes=sizes["params"], state_bytes=state,
                                    rollout_s=config.rollout_s, phase_gap_s=config.phase_gap_s,
                                    micro_batches=config.micro_batches))
        if config.trace and name.startswith("torchferry"):
            say(f"{name}: one profiled step", 0.05 + 0.95 * (i + 1) / n)
            dist.barrier()
            extra = functools.partial(run_step, strategy, batch, param_bytes=sizes["params"], state_bytes=state,
                                      rollout_s=config.rollout_s, phase_gap_s=config.phase_gap_s,
                                      micro_batches=config.micro_batches)
            if rank == 0:
                _, prof = profile_step(extra)
                prefix = f"{config.trace}.{name.replace('+', '-')}"
                try:
                    traces[name] = write_trace(prof, prefix)["totals"]
                    trace_files.extend(trace_paths(prefix))
                except OSError as e:  # checked before the run; a disk that filled up since must not lose it
                    notes.append(f"--trace: could not write {prefix}.* ({e.strerror or e})")
            else:
                extra()
        strategy.reload(optimizer=True)
        strategy.close()
        del strategy
        release_host_cache()
        results[name] = _summarise(first_offload, first_reload, pin_s, records, sizes, peak, bit_exact)
    _account_overlap(results)
    swap_result = None
    if config.swap:
        say("swap: actor out, critic in", 0.98)
        swap_result = _swap_scenario(config, preset, model, opt, device, world, batch, peak)
    say("done", 1.0)

    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "link_peak_GBps": peak, "strategies": results})
    out = {
        "schema": SCHEMA,
        "env": env_record(device, world),
        "link_peak_GBps": peak,
        "model": {
            "preset": None if config.model_path else preset,
            "path": config.model_path,
            "layers": model.config.num_hidden_layers,
            "state_bytes": sizes,
            "seq_len": seq_len,
            "batch_size": config.batch_size,
        },
        # What ran: the defaults resolved (preset, seq_len), not the options as given.
        "config": dataclasses.asdict(dataclasses.replace(
            config, preset=None if config.model_path else preset, seq_len=seq_len)),
        "strategies": results,
        "swap": swap_result,
        "traces": traces,
        "trace_files": trace_files,
        "per_rank": gathered,
        "notes": notes,
    }
    return out
