"""``torchferry bench-lora``: LoRA training, where most of the state is a frozen base.

The preset's Qwen2 is built as the main bench builds it (random init), its base weights cast to
bf16 and frozen (as verl's LoRA path holds them), LoRA adapters (``peft``; rank 64 by default on
q/k/v/o and gate/up/down projections, fp32) added, FSDP2 applied as the main bench does (frozen
and trainable parameters share units, bf16 compute), AdamW over the adapters only. Each strategy
gets its own copy of that model (same seed) and runs the same steps: reload the parameters,
forward (old_log_prob), offload the parameters; reload everything, forward, backward, step,
offload the parameters, then the optimizer state (verl's order: ``offload_fsdp_model_to_cpu``,
``offload_fsdp_optimizer``), each timed; ``offload_all`` is the two together. A step writes the
adapters and their AdamW state (``state_bytes["written_per_step"]``): no exact method can copy
less after an update. Offload seconds are from the call until the host copies are complete
(synchronised); ``torchferry`` runs its two ferries with ``skip_unchanged=True``, so its offloads
copy only what was written ([Note: unchanged storages]). ``round_trip_bit_exact``: after every
offload the state read on the host equals its bytes on the device before it (what a skipped copy
could break); ``same_state_as_<first>``: each step's state equals the first strategy's (the same
training; deterministic algorithms on, so a difference is worth a look, not proof of a bug).
Without a GPU the run checks the bytes copied and bit-exactness; its seconds are ``None`` and no
speed-up is computed (CPU copies of a tiny model time Python, not a link).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ._common.link import measure_link_peak
from ._common.model import build_model
from ._common.output import NO_GPU, CommandError, check_paths, on_rank0, print_notes, require, run_with_progress
from ._common.output import stdout_console, write_results
from ._common.presets import PRESETS
from ._common.setup import env_record, shard_fsdp2, start_scenario
from ._common.state import bit_sums, checksum, state_bytes, unique_storage_bytes
from ._common.units import local_of, reshard
from .rl_step.strategies import SharedFerries, Strategy, Torchferry, make_strategy

__all__ = ["LORA_STRATEGIES", "LORA_TARGETS", "LoraBenchConfig", "build_lora", "lora_command", "run_lora"]

SCHEMA = "torchferry.bench-lora/1"
_SECONDS = ("offload_params_s", "offload_params_after_update_s", "offload_optimizer_s", "offload_all_s", "reload_all_s")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_STRATEGIES = ("seed", "torchferry")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraBenchConfig:
    """What ``torchferry bench-lora`` runs."""

    preset: str | None = None
    """Model size, a key of ``PRESETS``; default ``qwen2.5-7b`` on a GPU, ``tiny`` on the CPU."""
    layers: int | None = None
    """Override the number of decoder layers (default: the preset's)."""
    rank: int = 64
    """LoRA rank r of every adapter (default 64; ``lora_alpha`` = 2r)."""
    strategies: tuple[str, ...] = LORA_STRATEGIES
    """Strategies, run in this order, each on its own copy of the model (default: seed, torchferry)."""
    steps: int = 4
    """Steps per strategy (>= 2: the first is the first cycle, the rest are steady)."""
    seq_len: int | None = None
    """Tokens per sequence (default 512; 32 for ``tiny``), one sequence per step."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        bad = [s for s in self.strategies if s not in LORA_STRATEGIES]
        if bad or not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be distinct names from {', '.join(LORA_STRATEGIES)}, "
                             f"got {','.join(self.strategies)}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (first and steady cycles), got {self.steps}")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")


def build_lora(preset: str, device: torch.device, world: int, *, rank: int, layers: int | None = None,
               seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The preset's model with a frozen bf16 base and fp32 LoRA adapters, under FSDP2, and AdamW
    over the adapters.

    Raises:
        ImportError: ``peft`` is not installed.
    """
    from peft import LoraConfig, get_peft_model

    base = build_model(preset, device, layers=layers, seed=seed).to(torch.bfloat16)
    torch.manual_seed(seed + 1)
    # init_lora_weights=False: B random too, so that the adapters change the output from the first step.
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                     init_lora_weights=False)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing (a FutureWarning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(base, cfg)  # freezes the base; adapters in fp32 (autocast_adapter_dtype)
    shard_fsdp2(model.base_model.model, device, world)  # pyright: ignore[reportArgumentType]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-4)


def _optimizer_checksum(opt: torch.optim.Optimizer, device: torch.device) -> list[int]:
    tensors = [v for st in opt.state.values() for k in sorted(st) if torch.is_tensor(v := st[k])]
    return bit_sums([local_of(t) for t in tensors], device)


def _trainable_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of the device storages of parameters that require grad (what a step writes, with
    the optimizer state)."""
    return unique_storage_bytes((p for p in model.parameters() if p.requires_grad), device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _run_strategy(name: str, preset: str, config: LoraBenchConfig, device: torch.device, world: int,
                  batch: torch.Tensor) -> dict:
    model, opt = build_lora(preset, device, world, rank=config.rank, layers=config.layers)
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up: AdamW state exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    sizes = state_bytes(model, opt, device)
    written = _trainable_bytes(model, device) + sizes["optimizer"]
    ferries = SharedFerries(model, opt, device, skip_unchanged=True) if name == "torchferry" else None
    strategy: Strategy = make_strategy(name, model, opt, device, ferries=ferries)
    strategy.setup()
    total = sizes["params"] + sizes["optimizer"]
    steps, sums = [], []
    strategy.offload(optimizer=True)  # the state starts offloaded, as in an RL step
    for _ in range(config.steps):
        rec: dict = {}
        rec["reload_params_s"] = _timed(device, functools.partial(strategy.reload, optimizer=False))
        with torch.no_grad():
            model(input_ids=batch).logits.float().logsumexp(-1).mean().item()
        # FSDP2 keeps the root unit unsharded after a forward; every strategy moves the sharded state
        # (the ferry reshards by itself), and the checksums compare the same shards.
        reshard(model)
        before = checksum(model, device)
        rec["offload_params_s"] = _timed(device, functools.partial(strategy.offload, optimizer=False))
        exact = checksum(model, device) == before  # the host copies
        rec["offload_params_bytes_copied"] = _copied(strategy, optimizer=False, default=sizes["params"])
        rec["reload_all_s"] = _timed(device, functools.partial(strategy.reload, optimizer=True))
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        before = (checksum(model, device), _optimizer_checksum(opt, device))
        # verl's order after update_actor: the weights (offload_fsdp_model_to_cpu), then the optimizer.
        rec["offload_params_after_update_s"] = _timed(device, functools.partial(strategy.offload, optimizer=False))
        rec["offload_params_after_update_bytes_copied"] = _copied(strategy, optimizer=False,
                                                                 default=sizes["params"])
        rec["offload_optimizer_s"] = _timed(device, functools.partial(strategy.offload, optimizer=True))
        rec["offload_optimizer_bytes_copied"] = _copied(strategy, optimizer=True, default=total,
                                                        only_optimizer=True) if ferries else sizes["optimizer"]
        rec["offload_all_s"] = rec["offload_params_after_update_s"] + rec["offload_optimizer_s"]
        rec["offload_all_bytes_copied"] = (rec["offload_params_after_update_bytes_copied"]
                                           + rec["offload_optimizer_bytes_copied"])
        sums.append((checksum(model, device), _optimizer_checksum(opt, device)))  # the host copies
        rec["round_trip_bit_exact"] = exact and sums[-1] == before
        steps.append(rec)
    strategy.reload(optimizer=True)
    strategy.close()
    del strategy, ferries, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    steady = steps[1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    def spread(key: str) -> dict:
        return {"first": steps[0][key], "steady": med(key), "steady_min": min(r[key] for r in steady),
                "steady_max": max(r[key] for r in steady)}

    return {
        "state_bytes": {"params": sizes["params"], "optimizer": sizes["optimizer"], "total": total,
                        "written_per_step": written},
        **{key: spread(key) for key in _SECONDS},
        "offload_params_bytes_copied": int(med("offload_params_bytes_copied")),
        "offload_params_after_update_bytes_copied": int(med("offload_params_after_update_bytes_copied")),
        "offload_optimizer_bytes_copied": int(med("offload_optimizer_bytes_copied")),
        "offload_all_bytes_copied": int(med("offload_all_bytes_copied")),
        "copied_frac_params": med("offload_params_bytes_copied") / sizes["params"],
        "copied_frac_params_after_update": med("offload_params_after_update_bytes_copied") / sizes["params"],
        "copied_frac_all": med("offload_all_bytes_copied") / total,
        "written_frac_all": written / total,
        "steps": steps,
        "_sums": sums,
    }


def _copied(strategy: Strategy, *, optimizer: bool, default: int, only_optimizer: bool = False) -> int:
    """Bytes the last offload copied D2H: the ferries' ``offload_bytes_copied``, else all of it."""
    if not isinstance(strategy, Torchferry):
        return default
    chosen = [strategy.opt_ferry] if only_optimizer else strategy.ferries_moved(optimizer)
    return sum(f.stats.offload_bytes_copied for f in chosen)


def run_lora(config: LoraBenchConfig, *, on_progress: Callable[[str, float], None] | None = None) -> dict:
    """Runs the LoRA scenario and returns its results (the ``torchferry.bench-lora/1`` JSON, as a dict).

    Bytes are per rank (rank 0's; ``per_rank`` holds every rank's), seconds wall clock,
    synchronised. ``speedup_vs_seed``: the seed's steady offload seconds over torchferry's;
    ``speedup_vs_full_copy_at_peak``: the seconds a copy of all of it would take at the link
    peak measured in the same run (all ranks copying at once), over the strategy's.

    Raises:
        ValueError: a preset that needs a GPU on a machine without one.
        ImportError: ``peft`` or ``transformers`` is not installed.
    """
    import torch.distributed as dist

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before its first use)
    torch.use_deterministic_algorithms(True, warn_only=True)  # strategies compared bit for bit
    if torch.cuda.is_available():  # the math attention: cuDNN's and flash's backward are not deterministic
        for enable in (torch.backends.cuda.enable_cudnn_sdp, torch.backends.cuda.enable_flash_sdp,
                       torch.backends.cuda.enable_mem_efficient_sdp):
            enable(False)
    use_cuda, preset, rank, world, device, say = start_scenario(config.preset, "qwen2.5-7b", on_progress)
    seq_len = config.seq_len or (32 if preset == "tiny" else 512)
    vocab = PRESETS[preset].vocab_size
    batch = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(rank)).to(device)
    peak = None
    if use_cuda:
        say("measuring the link peak", 0.0)
        peak = measure_link_peak(device, barrier=dist.barrier)
    results: dict[str, dict] = {}
    for i, name in enumerate(config.strategies):
        say(f"{name}: building and running {config.steps} steps", i / len(config.strategies))
        results[name] = _run_strategy(name, preset, config, device, world, batch)
    first = config.strategies[0]
    for r in results.values():
        r["round_trip_bit_exact"] = all(x["round_trip_bit_exact"] for x in r["steps"])
        r["same_state_as_" + first] = r["_sums"] == results[first]["_sums"]
    for r in results.values():
        del r["_sums"]
    if not use_cuda:  # no transfer figures without a GPU: the seconds are null, no speed-up
        for r in results.values():
            for key in _SECONDS:
                r[key] = None
            for step in r["steps"]:
                step.update({k: None for k in step if k.endswith("_s")})
    elif "seed" in results and "torchferry" in results:
        for key in ("offload_params_s", "offload_params_after_update_s", "offload_optimizer_s", "offload_all_s"):
            ours = results["torchferry"][key]["steady"]
            results["torchferry"][f"{key}_speedup_vs_seed"] = (
                results["seed"][key]["steady"] / ours if ours > 0 else math.inf)
    if peak is not None:  # what copying everything at the link's peak would take: no full copy beats it
        for r in results.values():
            sb = r["state_bytes"]
            r["full_copy_at_peak_s"] = {k: sb[of] / (peak.d2h * 1e9) for k, of in (
                ("offload_params_s", "params"), ("offload_params_after_update_s", "params"),
                ("offload_optimizer_s", "optimizer"), ("offload_all_s", "total"))}
            r["speedup_vs_full_copy_at_peak"] = {k: v / r[k]["steady"] for k, v in r["full_copy_at_peak_s"].items()}
    say("done", 1.0)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "strategies": results})
    notes = [] if use_cuda else [f"no CUDA device: ran on the CPU end to end; {NO_GPU} (the seconds are null: "
                                 "CPU copies of a tiny model time Python, not a link)"]
    return {
        "schema": SCHEMA,
        "env": env_record(device, world),
        "model": {"preset": preset, "layers": config.layers or PRESETS[preset].num_hidden_layers,
                  "lora_rank": config.rank, "lora_targets": list(LORA_TARGETS), "base_dtype": "bfloat16",
                  "seq_len": seq_len},
        "config": dataclasses.asdict(dataclasses.replace(config, preset=preset, seq_len=seq_len)),
        "strategies": results,
        "link_peak_GBps": None if peak is None else {"h2d": peak.h2d, "d2h": peak.d2h, "solo": peak.solo},
        "per_rank": gathered,
        "notes": notes,
    }


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


_ROWS = (("params after forward", "offload_params_s", "offload_params_bytes_copied", "params"),
         ("params after update", "offload_params_after_update_s", "offload_params_after_update_bytes_copied",
          "params"),
         ("optimizer after update", "offload_optimizer_s", "offload_optimizer_bytes_copied", "optimizer"),
         ("all after update", "offload_all_s", "offload_all_bytes_copied", "total"))


def render_table(result: dict):
    """The ``rich.table.Table`` ``torchferry bench-lora`` prints: per strategy and offload, its seconds
    (not without a GPU), the bytes copied and their share of the state, bit-exactness."""
    from rich.table import Table

    m, gpu, steps = result["model"], result["env"]["gpu"] is not None, result["config"]["steps"]
    first = result["config"]["strategies"][0]
    title = (f"torchferry bench-lora: LoRA r={m['lora_rank']} on {m['preset']} ({m['layers']} layers, bf16 base), "
             f"{result['env']['world_size']} rank(s), rank 0")
    if gpu:
        title += f"; steady = median of steps 2..{steps} [min-max]"
    table = Table(title=title, caption=None if gpu else f"{NO_GPU}: the CPU run checks the bytes copied and "
                                                        "bit-exactness")
    seconds = ("seconds first", "seconds steady") if gpu else ()
    for col in ("strategy", "offload", *seconds, "copied", "x state", "bit-exact"):
        table.add_column(col)
    for name, r in result["strategies"].items():
        sb = r["state_bytes"]
        same = next(v for k, v in r.items() if k.startswith("same_state"))
        for label, key, copied, of in _ROWS:
            t = r[key]
            secs = ((f"{t['first']:.4f}", f"{t['steady']:.4f} [{t['steady_min']:.4f}-{t['steady_max']:.4f}]")
                    if gpu else ())
            table.add_row(name, f"{label} (of {_size(sb[of])})", *secs, _size(r[copied]), f"{r[copied] / sb[of]:.3f}",
                          f"{'yes' if r['round_trip_bit_exact'] else 'NO'}; same state as "
                          f"{first}: {'yes' if same else 'NO'}")
    return table


def summary_lines(result: dict) -> list[str]:
    """The lines under the table: torchferry's speed-ups over the seed and over a full copy at the link
    peak (on a GPU), and what a step writes against what it copies."""
    tf = result["strategies"].get("torchferry", {})
    lines = []
    if "offload_params_s_speedup_vs_seed" in tf:
        lines.append(f"steady offload seconds, seed / torchferry (above 1: torchferry faster): params after forward "
                     f"{tf['offload_params_s_speedup_vs_seed']:.1f}x, params after update "
                     f"{tf['offload_params_after_update_s_speedup_vs_seed']:.1f}x, optimizer "
                     f"{tf['offload_optimizer_s_speedup_vs_seed']:.1f}x, "
                     f"all {tf['offload_all_s_speedup_vs_seed']:.1f}x; "
                     f"a step writes {tf['written_frac_all']:.3f}x of the state (adapters and AdamW state), "
                     f"all copied {tf['copied_frac_all']:.3f}x")
    elif tf:
        lines.append(f"torchferry: a step writes {tf['written_frac_all']:.3f}x of the state (adapters and AdamW "
                     f"state), all copied {tf['copied_frac_all']:.3f}x; seconds and speed-ups: {NO_GPU}")
    if "speedup_vs_full_copy_at_peak" in tf:
        sp = tf["speedup_vs_full_copy_at_peak"]
        lines.append(f"steady offload seconds, a full copy at the link peak / torchferry "
                     f"({result['link_peak_GBps']['d2h']:.1f} GB/s D2H, this run): params after forward "
                     f"{sp['offload_params_s']:.1f}x, after update {sp['offload_params_after_update_s']:.1f}x, "
                     f"all {sp['offload_all_s']:.1f}x")
    return lines


def lora_command(*, preset: str | None, layers: int | None, rank: int, strategies: str, steps: int,
                 seq_len: int | None, json_path: Path | None) -> int:
    """``torchferry bench-lora`` with the command line's options; returns the exit status.

    Raises:
        CommandError: an option refused before the run (or by it), a missing package (exit 2).
    """
    check_paths(("--json", json_path, False, "bench-lora.json"))
    names = tuple(x.strip() for x in strategies.split(",") if x.strip())
    try:
        config = LoraBenchConfig(preset=preset, layers=layers, rank=rank, strategies=names, steps=steps,
                                 seq_len=seq_len)
    except ValueError as e:  # refused before peft and transformers are imported (seconds)
        raise CommandError(str(e)) from None
    require("torchferry bench-lora", "peft", "transformers")
    result = run_with_progress(run_lora, config)
    if not on_rank0():
        return 0
    out = stdout_console(200)  # logs and pipes: one line per row
    out.print(render_table(result))
    for line in summary_lines(result):
        print(line)
    print_notes(result["notes"])
    return 0 if write_results(result, json_path) else 1
