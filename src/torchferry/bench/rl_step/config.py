"""What ``torchferry bench`` runs: :class:`BenchConfig` and its choices (no torch import here)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from .._common.presets import PRESETS

__all__ = ["ORDERS", "SCHEMA", "STRATEGY_NAMES", "WORKLOADS", "BenchConfig"]

SCHEMA = "torchferry.bench/1"

STRATEGY_NAMES = ("blocking", "seed", "torchferry", "torchferry+prefetch")
"""The strategies a user can select, in their default order (``strategies.STRATEGIES``' keys)."""

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
    strategies: tuple[str, ...] = STRATEGY_NAMES
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
    """Path prefix: profile one extra step of each ``torchferry*`` strategy on rank 0 (see ``trace``)."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"--model {self.model_path}: not a Hugging Face checkpoint folder (no config.json)")
        for s in self.strategies:
            if s not in STRATEGY_NAMES:
                raise ValueError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGY_NAMES)}")
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
