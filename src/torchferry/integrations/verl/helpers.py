"""verl's FSDP offload helpers, backed by torchferry: the names and signatures of ``verl.utils.fsdp_utils``
(verl PR #7347), the same objects as SkyRL's, defined in :mod:`torchferry.integrations._base.helpers`."""

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
