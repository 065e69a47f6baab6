"""``torchferry bench`` as the command line runs it: checks, progress, the run, what it prints and writes."""

from __future__ import annotations

import logging
from pathlib import Path

from .._common.output import CommandError, check_paths, on_rank0, require, run_with_progress, write_plot, write_results
from .config import BenchConfig

__all__ = ["bench_command"]


def bench_command(*, preset: str | None, model: Path | None, layers: int | None, strategies: str, steps: int,
                  workload: str, order: str, seq_len: int | None, batch_size: int | None,
                  micro_batches: int | None, rollout_s: float, swap: bool, phase_gap_s: float,
                  json_path: Path | None, plot: Path | None, trace: Path | None, verbose: bool) -> int:
    """Runs the bench with the command line's options; returns the exit status (0, or 1 when an output
    could not be written after the run).

    Raises:
        CommandError: an option refused before the run (or by it), a missing package (exit 2).
    """
    check_paths(("--json", json_path, False, "bench.json"), ("--plot", plot, False, "bench.png"),
                ("--trace", trace, True, ""))
    require("torchferry bench", "matplotlib", "transformers")
    names = tuple(s.strip() for s in strategies.split(",") if s.strip())
    if trace is not None and not any(n.startswith("torchferry") for n in names):
        raise CommandError(f"--trace profiles the torchferry strategies, and --strategies {strategies} has none")
    try:
        config = BenchConfig(
            preset=preset, model_path=str(model) if model else None, layers=layers,
            strategies=names, steps=steps, workload=workload, order=order,
            seq_len=seq_len, batch_size=batch_size, micro_batches=micro_batches, rollout_s=rollout_s,
            phase_gap_s=phase_gap_s, swap=swap, trace=str(trace) if trace else None,
        )
    except ValueError as e:
        raise CommandError(str(e)) from None
    if verbose:
        logging.basicConfig(level=logging.DEBUG)
    from .run import run

    result = run_with_progress(run, config)
    if not on_rank0():
        return 0
    from .plot import plot_timeline
    from .report import print_report

    print_report(result)
    ok = write_results(result, json_path)
    ok = write_plot(plot_timeline, result, plot) and ok
    return 0 if ok else 1
