"""The ``torchferry`` command line (typer)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="torchferry: move training state between GPU and pinned host memory.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """torchferry command line."""


@app.command()
def bench(
    preset: Optional[str] = typer.Option(None, help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or tiny "
                                         "[default: qwen2.5-1.5b on a GPU, tiny on the CPU]"),
    model: Optional[Path] = typer.Option(None, "--model", help="A local Hugging Face checkpoint folder instead of a preset."),
    layers: Optional[int] = typer.Option(None, help="Override the number of decoder layers."),
    strategies: str = typer.Option("blocking,seed,torchferry,torchferry+prefetch",
                                   help="Comma-separated, run in this order."),
    steps: int = typer.Option(3, help="RL steps per strategy (>= 2)."),
    seq_len: int = typer.Option(512, help="Tokens per sequence (tiny: 32 unless set)."),
    batch_size: int = typer.Option(1, help="Sequences per batch."),
    micro_batches: int = typer.Option(1, help="Forward(/backward) passes per phase, gradients accumulated."),
    rollout_s: float = typer.Option(0.0, help="Seconds the simulated rollout holds its KV cache."),
    swap: bool = typer.Option(True, help="Also measure a swap: actor out while a critic of the same size comes in."),
    phase_gap_s: float = typer.Option(1.0, help="Untimed host seconds between phases (verl: rewards, advantages)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results JSON here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG timeline of one step per strategy here."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Path prefix: profile one extra step of each "
                                         "torchferry strategy (rank 0); writes PREFIX.<strategy>.json.gz "
                                         "(Chrome/Perfetto trace), .summary.json and .png."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logs of every transfer."),
) -> None:
    """A colocated RL step (rollout, old_log_prob, update_actor) on Qwen2, strategies side by side.

    Run under `torchrun --nproc_per_node N -m torchferry bench ...` for N GPUs.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        import matplotlib  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        typer.echo(f"error: torchferry bench needs {e.name}: pip install 'torchferry[bench]'", err=True)
        raise typer.Exit(2) from None
    from .bench._report import plot_timeline, render_table, write_json
    from .bench._run import BenchConfig, run

    console = Console(stderr=True)
    if verbose:
        logging.basicConfig(level=logging.DEBUG)
    try:
        config = BenchConfig(
            preset=preset, model_path=str(model) if model else None, layers=layers,
            strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()), steps=steps,
            seq_len=seq_len, batch_size=batch_size, micro_batches=micro_batches, rollout_s=rollout_s,
            phase_gap_s=phase_gap_s, swap=swap, trace=str(trace) if trace else None,
        )
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("starting", total=1.0)
            result = run(config, on_progress=lambda msg, frac: progress.update(task, description=msg, completed=frac))
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    out = Console()
    if not out.is_terminal:
        out = Console(width=170)  # logs and pipes: keep the table on one line per strategy
    out.print(render_table(result))
    for name, r in result["strategies"].items():
        if r.get("exposed_reload_vs_torchferry_reload") is not None:
            out.print(f"{name}: exposed reload {r['exposed_reload_s_per_step']:.3f} s/step, "
                      f"{r['exposed_reload_vs_torchferry_reload']:.3f}x torchferry's "
                      f"{result['strategies']['torchferry']['reload_s_per_step']:.3f} s/step")
    sw = result.get("swap")
    if sw:
        frac = f" ({100 * sw['frac_of_bidir_peak']:.1f}% of the bidirectional peak)" if sw["frac_of_bidir_peak"] else ""
        out.print(f"swap (torchferry.swap, actor out + critic in): {sw['seconds']:.3f} s, "
                  f"{sw['GBps']:.1f} GB/s both ways{frac}, bit-exact: {'yes' if sw['bit_exact'] else 'NO'}")
    for note in result["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    if json_path:
        write_json(result, json_path)
        console.print(f"wrote {json_path}")
    if plot:
        plot_timeline(result, plot)
        console.print(f"wrote {plot}")


@app.command("bench-pin")
def bench_pin(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results JSON here."),
    pin_gib: float = typer.Option(4.0, help="GiB to pin, torchferry's pool against torch.empty(pin_memory=True)."),
    first_gib: float = typer.Option(8.0, help="GiB of state for the first-offload measurement."),
    train_s: float = typer.Option(3.0, help="Seconds of training between Ferry creation and the first offload."),
) -> None:
    """Pinning GB/s, 4096 x 256 KiB tensors and the first offload after Ferry creation, on one GPU."""
    import json
    import sys

    from rich.console import Console
    from rich.table import Table

    from .bench._micro import run_pin_bench

    console = Console(stderr=True)
    for name, value in (("--pin-gib", pin_gib), ("--first-gib", first_gib)):
        if value <= 0:
            console.print(f"[bold red]error:[/] {name} must be > 0, got {value}")
            raise typer.Exit(2)
    if train_s < 0:
        console.print(f"[bold red]error:[/] --train-s must be >= 0, got {train_s}")
        raise typer.Exit(2)
    try:
        result = run_pin_bench(pin_bytes=int(pin_gib * 2**30), first_state_bytes=int(first_gib * 2**30),
                               train_s=train_s, command="torchferry " + " ".join(sys.argv[1:]),
                               on_progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    pin, small, first, peak = result["pinning"], result["small_tensors"], result["first_offload"], result["link_peak_GBps"]
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
    table.add_row(f"first offload, {first['state_bytes'] / 2**30:.1f} GiB (s)", f"{first['first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['first_over_steady']:.2f}x")
    table.add_row("first offload, no background pinning (s)", f"{first['lazy_first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['lazy_first_over_steady']:.2f}x")
    Console().print(table)
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {json_path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
