"""The ``torchferry`` command line (typer)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(help="torchferry: move training state between GPU and pinned host memory.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``error: message`` on one line of stderr (no markup, no wrapping) and exits with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _check_paths(*checks: tuple[str, Path | None, bool, str]) -> None:
    """Refuses, before any work, an output path the command could not write (exit 2, one line)."""
    from .bench._paths import check_output_path

    for option, path, prefix, example in checks:
        if path is None:
            continue
        try:
            check_output_path(option, path, prefix=prefix, example=example)
        except ValueError as e:
            _fail(str(e))


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
    preset: str | None = typer.Option(None, help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or tiny.",
                                         show_default="qwen2.5-1.5b on a GPU, tiny on the CPU"),
    model: Path | None = typer.Option(None, "--model",
                                      help="A local Hugging Face checkpoint folder instead of a preset."),
    layers: int | None = typer.Option(None, help="Override the number of decoder layers."),
    strategies: str = typer.Option("blocking,seed,torchferry,torchferry+prefetch",
                                   help="Comma-separated, set up in this order; a resident baseline (state "
                                        "left on the device) always runs too."),
    steps: int = typer.Option(3, help="Timed steps per strategy, i.e. rounds (>= 2; the noise figure "
                                      "noise_frac needs several)."),
    workload: str = typer.Option("default", help="default or compute-rich (seq-len 4096, batch-size 2, "
                                                 "micro-batches 4, unless given)."),
    order: str = typer.Option("interleaved", help="interleaved: rounds of one step per strategy, the order "
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
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    _check_paths(("--json", json_path, False, "bench.json"), ("--plot", plot, False, "bench.png"),
                 ("--trace", trace, True, ""))
    try:
        import matplotlib  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        _fail(f"torchferry bench needs {e.name}: pip install 'torchferry[bench]'")
    from .bench._paths import write_json_or_fallback
    from .bench._report import on_gpu, overlap_lines, plot_timeline, render_table, swap_line
    from .bench._run import BenchConfig, run

    console = Console(stderr=True)
    if verbose:
        logging.basicConfig(level=logging.DEBUG)
    names = tuple(s.strip() for s in strategies.split(",") if s.strip())
    if trace is not None and not any(n.startswith("torchferry") for n in names):
        _fail(f"--trace profiles the torchferry strategies, and --strategies {strategies} has none")
    try:
        config = BenchConfig(
            preset=preset, model_path=str(model) if model else None, layers=layers,
            strategies=names, steps=steps, workload=workload, order=order,
            seq_len=seq_len, batch_size=batch_size, micro_batches=micro_batches, rollout_s=rollout_s,
            phase_gap_s=phase_gap_s, swap=swap, trace=str(trace) if trace else None,
        )
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("starting", total=1.0)
            result = run(config, on_progress=lambda msg, frac: progress.update(task, description=msg, completed=frac))
    except ValueError as e:
        _fail(str(e))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out = Console()
    if not out.is_terminal:
        out = Console(width=170)  # logs and pipes: keep the table on one line per strategy
    out.print(render_table(result))
    for line in overlap_lines(result):
        out.print(escape(line))
    sw = result.get("swap")
    if sw:
        out.print(escape(swap_line(sw, on_gpu(result))))
    for note in result["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    for path in result.get("trace_files", []):
        typer.echo(f"wrote {path}", err=True)
    failed = False
    if json_path:
        written, error = write_json_or_fallback(result, json_path)
        if error:
            typer.echo(f"error: --json {json_path}: could not write it ({error}); the results are in {written}",
                       err=True)
            failed = True
        else:
            typer.echo(f"wrote {written}", err=True)
    if plot:
        try:
            plot_timeline(result, plot)
            typer.echo(f"wrote {plot}", err=True)
        except OSError as e:
            typer.echo(f"error: --plot {plot}: could not write it ({e.strerror or e})", err=True)
            failed = True
    if failed:
        raise typer.Exit(1)


@app.command("bench-lora")
def bench_lora(
    preset: str | None = typer.Option(None, help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or tiny.",
                                         show_default="qwen2.5-7b on a GPU, tiny on the CPU"),
    layers: int | None = typer.Option(None, help="Override the number of decoder layers."),
    rank: int = typer.Option(64, help="LoRA rank of every adapter (q/k/v/o, gate/up/down projections)."),
    strategies: str = typer.Option("seed,torchferry", help="Comma-separated, from seed and torchferry."),
    steps: int = typer.Option(4, help="Steps per strategy (>= 2; the first is the first cycle)."),
    seq_len: int | None = typer.Option(None, help="Tokens per sequence.", show_default="512; 32 for tiny"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here."),
) -> None:
    """LoRA training (frozen bf16 base, fp32 adapters, AdamW on the adapters; FSDP2): the seed's
    offload against torchferry's with skip_unchanged, steady seconds and bytes copied.

    Run under `torchrun --nproc_per_node N -m torchferry bench-lora ...` for N GPUs.
    """
    _check_paths(("--json", json_path, False, "bench-lora.json"))
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        _fail(f"torchferry bench-lora needs {e.name}: pip install 'torchferry[bench]'")
    from .bench._lora import LoraBenchConfig, run_lora
    from .bench._paths import write_json_or_fallback

    names = tuple(x.strip() for x in strategies.split(",") if x.strip())
    try:
        config = LoraBenchConfig(preset=preset, layers=layers, rank=rank, strategies=names, steps=steps,
                                 seq_len=seq_len)
        result = run_lora(config)
    except ValueError as e:
        _fail(str(e))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from rich.console import Console
    from rich.table import Table

    m = result["model"]
    table = Table(title=f"torchferry bench-lora: LoRA r={m['lora_rank']} on {m['preset']} ({m['layers']} layers, "
                        f"bf16 base), {result['env']['world_size']} rank(s), rank 0; "
                        f"steady = median of steps 2..{steps} [min-max]")
    for col in ("strategy", "offload", "seconds first", "seconds steady", "GB copied", "x state", "bit-exact"):
        table.add_column(col)
    rows = (("params after forward", "offload_params_s", "offload_params_bytes_copied", "params"),
            ("params after update", "offload_params_after_update_s", "offload_params_after_update_bytes_copied",
             "params"),
            ("optimizer after update", "offload_optimizer_s", "offload_optimizer_bytes_copied", "optimizer"),
            ("all after update", "offload_all_s", "offload_all_bytes_copied", "total"))
    for name, r in result["strategies"].items():
        sb = r["state_bytes"]
        same = next(v for k, v in r.items() if k.startswith("same_state"))
        for label, key, copied, of in rows:
            t = r[key]
            table.add_row(name, f"{label} (of {sb[of] / 1e9:.3f} GB)", f"{t['first']:.4f}",
                          f"{t['steady']:.4f} [{t['steady_min']:.4f}-{t['steady_max']:.4f}]",
                          f"{r[copied] / 1e9:.3f}", f"{r[copied] / sb[of]:.3f}",
                          f"{'yes' if r['round_trip_bit_exact'] else 'NO'}; same state as "
                          f"{config.strategies[0]}: {'yes' if same else 'NO'}")
    out = Console()
    (out if out.is_terminal else Console(width=200)).print(table)  # logs and pipes: one line per row
    tf = result["strategies"].get("torchferry", {})
    if "offload_params_s_speedup_vs_seed" in tf:
        typer.echo(f"steady offload seconds, seed / torchferry (above 1: torchferry faster): params after forward "
                   f"{tf['offload_params_s_speedup_vs_seed']:.1f}x, params after update "
                   f"{tf['offload_params_after_update_s_speedup_vs_seed']:.1f}x, optimizer "
                   f"{tf['offload_optimizer_s_speedup_vs_seed']:.1f}x, all {tf['offload_all_s_speedup_vs_seed']:.1f}x; "
                   f"a step writes {tf['written_frac_all']:.3f}x of the state (adapters and AdamW state), "
                   f"all copied {tf['copied_frac_all']:.3f}x")
    if "speedup_vs_full_copy_at_peak" in tf:
        sp = tf["speedup_vs_full_copy_at_peak"]
        typer.echo(f"steady offload seconds, a full copy at the link peak / torchferry "
                   f"({result['link_peak_GBps']['d2h']:.1f} GB/s D2H, this run): params after forward "
                   f"{sp['offload_params_s']:.1f}x, after update {sp['offload_params_after_update_s']:.1f}x, "
                   f"all {sp['offload_all_s']:.1f}x")
    for note in result["notes"]:
        typer.echo(f"note: {note}", err=True)
    if json_path:
        written, error = write_json_or_fallback(result, json_path)
        if error:
            typer.echo(f"error: --json {json_path}: could not write it ({error}); the results are in {written}",
                       err=True)
            raise typer.Exit(1)
        typer.echo(f"wrote {written}", err=True)


@app.command("bench-pin")
def bench_pin(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results JSON here (checked before "
                                             "the run; missing folders are made)."),
    pin_gib: float = typer.Option(4.0, help="GiB to pin, torchferry's pool against torch.empty(pin_memory=True)."),
    first_gib: float = typer.Option(8.0, help="GiB of state for the first-offload measurement."),
    train_s: float = typer.Option(3.0, help="Seconds of training between Ferry creation and the first offload."),
) -> None:
    """Pinning GB/s, 4096 x 256 KiB tensors and the first offload after Ferry creation, on one GPU."""

    from rich.console import Console
    from rich.table import Table

    from .bench._micro import run_pin_bench
    from .bench._paths import write_json_or_fallback

    console = Console(stderr=True)
    _check_paths(("--json", json_path, False, "bench-pin.json"))
    for name, value in (("--pin-gib", pin_gib), ("--first-gib", first_gib)):
        if value <= 0:
            _fail(f"{name} must be > 0, got {value}")
    if train_s < 0:
        _fail(f"--train-s must be >= 0, got {train_s}")
    try:
        result = run_pin_bench(pin_bytes=int(pin_gib * 2**30), first_state_bytes=int(first_gib * 2**30),
                               train_s=train_s, command="torchferry " + " ".join(sys.argv[1:]),
                               on_progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    except ValueError as e:
        _fail(str(e))
    pin, small = result["pinning"], result["small_tensors"]
    first, peak = result["first_offload"], result["link_peak_GBps"]
    table = Table(title=f"torchferry bench-pin on {result['env']['gpu']}; link peak H2D {peak['h2d']:.1f} / "
                        f"D2H {peak['d2h']:.1f} GB/s")
    table.add_column("measurement")
    table.add_column("torchferry", justify="right")
    table.add_column("baseline", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row(f"pin {pin['bytes'] / 2**30:.1f} GiB (GB/s)", f"{pin['torchferry_GBps']:.2f}",
                  f"{pin['torch_GBps']:.2f} (torch.empty pinned)", f"{pin['speedup_vs_torch']:.1f}x")
    table.add_row("4096 x 256 KiB offload (of peak)", f"{small['offload_frac_of_peak']:.1%}",
                  f"{small['per_tensor_offload_frac_of_peak']:.1%} (per-tensor copy_)", "")
    table.add_row("4096 x 256 KiB reload (of peak)", f"{small['reload_frac_of_peak']:.1%}",
                  f"{small['per_tensor_reload_frac_of_peak']:.1%} (per-tensor copy_)", "")
    table.add_row(f"first offload of Ferry() after training, {first['state_bytes'] / 2**30:.1f} GiB (s)",
                  f"{first['first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['first_over_steady']:.2f}x")
    table.add_row("first offload, Ferry(pin_ahead=False) (s)", f"{first['lazy_first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['lazy_first_over_steady']:.2f}x")
    Console().print(table)
    if json_path:
        written, error = write_json_or_fallback(result, json_path)
        if error:
            _fail(f"--json {json_path}: could not write it ({error}); the results are in {written}", code=1)
        typer.echo(f"wrote {written}", err=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
