"""verl's FSDP offload helpers, backed by torchferry.

Same names and signatures as ``verl.utils.fsdp_utils`` (verl PR #7347), so a verl user can swap them in
(``torchferry.compat.verl`` is the same module's older import path)::

    from torchferry.integrations.verl import (
        offload_fsdp2_model_to_cpu, load_fsdp2_model_to_gpu,
        offload_fsdp_optimizer, load_fsdp_optimizer,
    )

The helpers themselves live in :mod:`torchferry.integrations._base.helpers`, shared
with the SkyRL integration (SkyRL's are verl's under the same names); these are
the same function objects and the same per-object ferries. What they do better
than verl's, and how they order the caller's stream: the module docstring of
:mod:`torchferry.integrations._base.helpers`, and its [Note: the verl helpers order
the caller's stream].
"""

from __future__ import annotations

from .._base import (
    ferry_for,
    load_fsdp2_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp2_model_to_cpu,
    offload_fsdp_optimizer,
)

__all__ = [
    "ferry_for",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
]
