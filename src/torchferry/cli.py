"""The ``torchferry`` command line (typer): argument parsing and dispatch only.

Each command hands its options to its scenario's ``*_command`` function (``torchferry.bench``), which
runs it and draws its own table and summary. Nothing heavy is imported before a command runs
(no model code, no plotting), so that ``--help`` answers at once.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import typer

from .bench._common.presets import PRESETS
from .bench.grpo.config import STRATEGIES as GRPO_STRATEGIES
from .bench.rl_step.config import ORDERS, STRATEGY_NAMES, WORKLOADS

app = typer.Typer(help="torchferry: move training state between GPU and pinned host memory.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``error: message`` on one line of stderr (no markup, no wrapping) and exits with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _dispatch(command: Callable[..., int], **options: object) -> None:
    """Runs a scenario's command; its refusals become one line of stderr (exit 2), its status the exit code."""
    from .bench._common.output import CommandError

    for name, value in options.items():  # sizes (GB, GiB) > 0, seconds >= 0, every number finite
        if isinstance(value, float):
            size = name.endswith(("_gb", "_gib"))
            if not math.isfinite(value) or value < 0 or (size and value == 0):
                _fail(f"--{name.replace('_', '-')} must be a finite number {'>' if size else '>='} 0, got {value}")
    try:
        code = command(**options)
    except CommandError as e:
        _fail(str(e), e.code)
    if code:
        raise typer.Exit(code)


def _names(xs) -> str:
    xs = list(xs)
    return ", ".join(xs[:-1]) + " or " + xs[-1] if len(xs) > 1 else "".join(xs)


_PRESETS = _names(sorted(PRESETS, key=lambda p: (p == "tiny", p))) + "."


def _version(value: bool) -> None:
    if value:
        import torch

        from . import __version__

        typer.echo(f"torchferry {__version__} (torch {torch.__version__})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the torchferry and torch versions and exit."),
) -> None:
    """torchferry command line."""


@app.command()
def bench(
    preset: str | None = typer.Option(None, help=_PRESETS, show_default="qwen2.5-1.5b on a GPU, tiny on the CPU"),
    model: Path | None = typer.Option(None, "--model",
                                      help="A local Hugging Face checkpoint folder instead of a preset."),
    layers: int | None = typer.Option(None, help="Override the number of decoder layers."),
    strategies: str = typer.Option(",".join(STRATEGY_NAMES),
                                   help=f"Comma-separated, from {', '.join(STRATEGY_NAMES)}; set up in the order "
                                        "given; a resident baseline (state left on the device) always runs too.",
                                   show_default="all four, in that order"),
    steps: int = typer.Option(3, help="Timed steps per strategy, i.e. rounds (>= 2; the noise figure "
                                      "noise_frac needs several)."),
    workload: str = typer.Option("default", help=f"{_names(WORKLOADS)} (compute-rich: seq-len 4096, batch-size 2, "
                                                 "micro-batches 4, unless given)."),
    order: str = typer.Option(ORDERS[0], help="interleaved: rounds of one step per strategy, the order "
                                              "rotated each round; sequential: all steps of one strategy, "
                                              "then the next."),
    seq_len: int | None = typer.Option(None, help="Tokens per sequence.",
                                          show_default="512; 32 for tiny; 4096 for compute-rich"),
    batch_size: int | None = typer.Option(None, help="Sequences per batch.", show_default="1; 2 for compute-rich"),
    micro_batches: int | None = typer.Option(None, help="Forward(/backward) passes per phase, gradients "
                                                "accumulated.", show_default="1; 4 for compute-rich"),
    rollout_s: float = typer.Option(0.0, help="Seconds the simulated rollout holds its KV cache."),
    swap: bool = typer.Option(True, help="Also measure a swap: actor out while a critic of the same size comes in."),
    phase_gap_s: float = typer.Option(1.0, help="Untimed host seconds between phases (verl: rewards, advantages)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here (checked before "
                                             "the run; missing folders are made)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG timeline of one step per strategy here."),
    trace: Path | None = typer.Option(None, "--trace", help="Path prefix: profile one extra step of each "
                                         "torchferry strategy and of the resident baseline (rank 0); writes "
                                         "PREFIX.<strategy>.json.gz (Chrome/Perfetto trace), .summary.json "
                                         "(with per-phase kernel time) and .png."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs of every transfer."),
) -> None:
    """A colocated RL step (rollout, old_log_prob, update_actor) on Qwen2, strategies side by side.

    Run under `torchrun --nproc_per_node N -m torchferry bench ...` for N GPUs.

    Without a GPU: the tiny preset end to end (the steps, bit-exactness), and no transfer figures.
    """
    from .bench.rl_step.command import bench_command

    _dispatch(bench_command, preset=preset, model=model, layers=layers, strategies=strategies, steps=steps,
              workload=workload, order=order, seq_len=seq_len, batch_size=batch_size, micro_batches=micro_batches,
              rollout_s=rollout_s, swap=swap, phase_gap_s=phase_gap_s, json_path=json_path, plot=plot, trace=trace,
              verbose=verbose)


@app.command("bench-lora")
def bench_lora(
    preset: str | None = typer.Option(None, help=_PRESETS, show_default="qwen2.5-7b on a GPU, tiny on the CPU"),
    layers: int | None = typer.Option(None, help="Override the number of decoder layers."),
    rank: int = typer.Option(64, help="LoRA rank of every adapter (q/k/v/o, gate/up/down projections)."),
    strategies: str = typer.Option("seed,torchferry", help="Comma-separated, from seed and torchferry."),
    steps: int = typer.Option(4, help="Steps per strategy (>= 2; the first is the first cycle)."),
    seq_len: int | None = typer.Option(None, help="Tokens per sequence.", show_default="512; 32 for tiny"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here."),
) -> None:
    """LoRA training with a frozen base: the seed's offload against torchferry's skip_unchanged.

    A frozen bf16 base, fp32 adapters, AdamW on the adapters, FSDP2; steady seconds and bytes copied.

    Run under `torchrun --nproc_per_node N -m torchferry bench-lora ...` for N GPUs.
    """
    from .bench.lora import lora_command

    _dispatch(lora_command, preset=preset, layers=layers, rank=rank, strategies=strategies, steps=steps,
              seq_len=seq_len, json_path=json_path)


@app.command("bench-pin")
def bench_pin(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here (checked before "
                                             "the run; missing folders are made)."),
    pin_gib: float = typer.Option(4.0, help="GiB to pin, torchferry's pool against torch.empty(pin_memory=True)."),
    first_gib: float = typer.Option(8.0, help="GiB of state for the first-offload measurement."),
    train_s: float = typer.Option(3.0, help="Seconds of training between Ferry creation and the first offload."),
) -> None:
    """Pinning GB/s, 4096 x 256 KiB tensors and the first offload after Ferry creation, on one GPU."""
    from .bench.pin import pin_command

    _dispatch(pin_command, json_path=json_path, pin_gib=pin_gib, first_gib=first_gib, train_s=train_s)


@app.command("bench-grpo")
def bench_grpo(
    preset: str | None = typer.Option(None, help=_PRESETS, show_default="qwen2.5-1.5b on a GPU, tiny on the CPU"),
    layers: int | None = typer.Option(None, help="Override the number of decoder layers."),
    strategies: str = typer.Option(",".join(GRPO_STRATEGIES), show_default="both",
                                   help=f"Comma-separated, from {', '.join(GRPO_STRATEGIES)}; steps interleaved."),
    steps: int = typer.Option(4, help="Timed steps per strategy (medians over them)."),
    warmup_steps: int = typer.Option(1, help="Untimed first steps per strategy."),
    seq_len: int | None = typer.Option(None, help="Tokens per sequence.", show_default="512; 32 for tiny"),
    batch_size: int = typer.Option(1, help="Sequences per batch."),
    micro_batches: int = typer.Option(1, help="Forward(/backward) passes per phase, gradients accumulated."),
    rollout_s: float = typer.Option(0.0, help="Seconds the rollout holds its KV cache."),
    kv_gb: float | None = typer.Option(None, help="KV cache per rank, GB.", show_default="actor params + AdamW"),
    budget_gb: float | None = typer.Option(None, help="GPU budget per rank, GB.",
                                           show_default="actor + max(KV, update workspace) + half the reference"),
    phase_gap_s: float = typer.Option(0.0, help="Untimed host seconds between phases."),
    deterministic: bool = typer.Option(True, help="Deterministic kernels and eager attention, so that bit_exact "
                                                  "compares the strategies (--no-deterministic: SDPA attention)."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here (rank 0; checked "
                                             "before the run)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write the PNG timeline here (rank 0)."),
) -> None:
    """A GRPO-like step under a GPU budget: every set offloaded after its phase, against a Dock.

    rollout (KV-cache claimant), reference log-prob, actor old_log_prob, update_actor; both strategies in one run.

    Run under `torchrun --nproc_per_node N -m torchferry bench-grpo ...` for N GPUs.
    """
    from .bench.grpo.command import grpo_command

    _dispatch(grpo_command, preset=preset, layers=layers, strategies=strategies, steps=steps,
              warmup_steps=warmup_steps, seq_len=seq_len, batch_size=batch_size, micro_batches=micro_batches,
              rollout_s=rollout_s, kv_gb=kv_gb, budget_gb=budget_gb, phase_gap_s=phase_gap_s,
              deterministic=deterministic, json_path=json_path, plot=plot)


def main() -> None:
    """The ``torchferry`` command: a usage error (an unknown option or command, a value of the wrong type) is one
    line of stderr naming it, exit 2, not Click's boxed usage."""
    try:
        code = app(prog_name="torchferry", standalone_mode=False)
    except typer.Exit as e:  # --help, --version, and the commands' own exit codes
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C at a prompt
        sys.exit(130)
    except Exception as e:  # Click's usage errors (typer vendors Click from 0.29: matched by what they offer)
        ctx, message = getattr(e, "ctx", None), getattr(e, "format_message", None)
        if getattr(e, "exit_code", None) != 2 or message is None:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # `torchferry` alone: the help, as before (exit 2)
            e.show()  # type: ignore[attr-defined]
            sys.exit(2)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        typer.echo(f"error: {where}{message()}{hint}", err=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)  # without standalone mode Click returns a command's exit code


if __name__ == "__main__":
    main()
