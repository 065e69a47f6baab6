"""verl's FSDP offload helpers, backed by torchferry: the same names and signatures as ``verl.utils.fsdp_utils``
(verl PR #7347), the same function objects as SkyRL's, defined in :mod:`torchferry.integrations._base.helpers`
(what they do better than verl's, and [Note: the verl helpers order the caller's stream])::

    from torchferry.integrations.verl import (
        offload_fsdp2_model_to_cpu, load_fsdp2_model_to_gpu,
        offload_fsdp_optimizer, load_fsdp_optimizer,
    )
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
