"""``torchferry bench-lora``: LoRA training, where most of the state is a frozen base (issue 16).

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .._core._state.fsdp import reshard
from ._link import measure_link_peak
from ._model import PRESETS, build_model
from ._rounds import bit_sums, checksum, state_bytes, unique_storage_bytes
from ._setup import env_record, shard_fsdp2, start_scenario
from ._strategies import SharedFerries, Strategy, make_strategy

__all__ = ["LORA_STRATEGIES", "LORA_TARGETS", "LoraBenchConfig", "build_lora", "run_lora"]

SCHEMA = "torchferry.bench-lora/1"
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
    model = get_peft_model(base, cfg)  # freezes the base; adapters in fp32 (autocast_adapter_dtype)
    shard_fsdp2(model.base_model.model, device, world)  # pyright: ignore[reportArgumentType]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-4)


def _optimizer_checksum(opt: torch.optim.Optimizer, device: torch.device) -> list[int]:
    tensors = [v for st in opt.state.values() for k in sorted(st) if torch.is_tensor(v := st[k])]
    return bit_sums([getattr(t, "_local_tensor", t) for t in tensors], device)


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
        reshard([model])
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
        **{key: spread(key) for key in ("offload_params_s", "offload_params_after_update_s",
                                        "offload_optimizer_s", "offload_all_s", "reload_all_s")},
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
    ferries = getattr(strategy, "_ferries", None)
    if ferries is None:
        return default
    chosen = [strategy.opt_ferry] if only_optimizer else ferries(optimizer)
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
    if "seed" in results and "torchferry" in results:
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
    notes = [] if use_cuda else ["no CUDA device: ran on the CPU end to end; the seconds time Python, not a link"]
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
