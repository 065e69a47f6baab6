"""``torchferry bench-grpo`` as the command line runs it (it replaces the script
``git show 72c0885^:benchmarks/grpo_dock.py``, same options and JSON): checks, progress, the run, the summary, the
JSON and the PNG (rank 0)."""

from __future__ import annotations

import os
from pathlib import Path

from .._common.output import CommandError, check_paths, on_rank0, print_notes, require, run_with_progress
from .._common.output import write_plot, write_results
from .config import GrpoConfig

__all__ = ["grpo_command"]


def _bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * 1e9)


def grpo_command(*, preset: str | None, layers: int | None, strategies: str, steps: int, warmup_steps: int,
                 seq_len: int | None, batch_size: int, micro_batches: int, rollout_s: float, kv_gb: float | None,
                 budget_gb: float | None, phase_gap_s: float, deterministic: bool, json_path: Path | None,
                 plot: Path | None) -> int:
    """Runs the GRPO scenario with the command line's options; returns the exit status (0, or 1 when an
    output could not be written after the run).

    Raises:
        CommandError: an option refused before the run (or by it), a missing package (exit 2).
    """
    check_paths(("--json", json_path, False, "bench-grpo.json"), ("--plot", plot, False, "bench-grpo.png"))
    require("torchferry bench-grpo", "transformers", "matplotlib")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
    try:
        config = GrpoConfig(
            preset=preset, layers=layers, strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
            steps=steps, warmup_steps=warmup_steps, seq_len=seq_len, batch_size=batch_size,
            micro_batches=micro_batches, rollout_s=rollout_s, kv_bytes=_bytes(kv_gb), budget_bytes=_bytes(budget_gb),
            phase_gap_s=phase_gap_s, deterministic=deterministic,
        )
    except ValueError as e:
        raise CommandError(str(e)) from None
    import torch.distributed as dist

    from .run import run_grpo

    try:
        result = run_with_progress(run_grpo, config)
        if not on_rank0():
            return 0
        from .report import plot_grpo, summary_lines

        for line in summary_lines(result):
            print(line)
        print_notes(result["notes"])
        ok = write_results(result, json_path)
        ok = write_plot(plot_grpo, result, plot) and ok
        return 0 if ok else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
