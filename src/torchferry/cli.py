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
            phase_gap_s=phase_gap_s, swap=swap,
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
