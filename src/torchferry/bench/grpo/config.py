"""The GRPO scenario's configuration and constants (see ``run`` for what is measured; no torch import here)."""

from __future__ import annotations

import dataclasses

from .._common.presets import PRESETS

__all__ = ["BUDGET_RULE", "PHASES", "SCHEDULE", "SCHEMA", "STRATEGIES", "GrpoConfig"]

SCHEMA = "torchferry.bench-grpo/1"
STRATEGIES = ("torchferry", "torchferry+dock")
PHASES = ("rollout", "ref_log_prob", "old_log_prob", "update_actor")
BUDGET_RULE = ("default: actor params + AdamW + max(KV cache, update workspace) + half the reference "
                "(at least reference + actor + forward workspace)")
# The dock's schedule: the names each phase uses.
SCHEDULE = (("rollout",), ("ref", "fwd_workspace"), ("actor_params", "fwd_workspace"),
             ("actor_params", "actor_optimizer", "update_workspace"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpoConfig:
    """What the GRPO scenario runs."""

    preset: str | None = None
    """Model size, a key of ``PRESETS``; default ``qwen2.5-1.5b`` on a GPU, ``tiny`` on the CPU."""
    layers: int | None = None
    """Override the number of decoder layers (default: the preset's)."""
    strategies: tuple[str, ...] = STRATEGIES
    """Strategies, interleaved step by step (default both)."""
    steps: int = 4
    """Timed steps per strategy (medians over them), after the warm-up steps."""
    warmup_steps: int = 1
    """Steps per strategy run first and left out of the figures (default 1)."""
    seq_len: int | None = None
    """Tokens per sequence (default 512; 32 for ``tiny``)."""
    batch_size: int = 1
    """Sequences per batch (default 1)."""
    micro_batches: int = 1
    """Forward(/backward) passes per phase, gradients accumulated (default 1)."""
    rollout_s: float = 0.0
    """Seconds the rollout holds its KV cache after filling it (generation stand-in; default 0)."""
    kv_bytes: int | None = None
    """Bytes of the rollout's KV cache per rank (default: the actor's parameters + AdamW state)."""
    budget_bytes: int | None = None
    """GPU budget per rank, bytes (default: actor state + the larger of KV cache and update
    workspace + half the reference model: everything but half the reference fits at once)."""
    phase_gap_s: float = 0.0
    """Untimed host seconds between phases (default 0: nothing hides in a gap)."""
    deterministic: bool = True
    """Deterministic kernels and eager attention, so that ``bit_exact`` compares the strategies."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise ValueError(f"strategies must be a non-empty subset of {', '.join(STRATEGIES)}, got {self.strategies}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"a strategy is repeated in {self.strategies}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        for name, value, low in (("steps", self.steps, 1), ("warmup_steps", self.warmup_steps, 0),
                                 ("seq_len", 2 if self.seq_len is None else self.seq_len, 2),
                                 ("batch_size", self.batch_size, 1), ("micro_batches", self.micro_batches, 1),
                                 ("rollout_s", self.rollout_s, 0), ("phase_gap_s", self.phase_gap_s, 0),
                                 ("kv_bytes", 0 if self.kv_bytes is None else self.kv_bytes, 0),
                                 ("budget_bytes", 1 if self.budget_bytes is None else self.budget_bytes, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")

