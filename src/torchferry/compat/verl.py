"""verl's FSDP offload helpers, backed by torchferry: the older import path.

The helpers live in :mod:`torchferry.integrations.verl`; this module
re-exports them (the same function objects, the same per-object ferries), so
``from torchferry.compat.verl import offload_fsdp2_model_to_cpu, ferry_for``
keeps working::

    from torchferry.compat.verl import (
        offload_fsdp2_model_to_cpu, load_fsdp2_model_to_gpu,
        offload_fsdp_optimizer, load_fsdp_optimizer, ferry_for,
    )

Deprecated: importing it warns (``DeprecationWarning``); import from
``torchferry.integrations.verl`` instead.
"""

from __future__ import annotations

import warnings

from ..integrations.verl import (
    ferry_for,
    load_fsdp2_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp2_model_to_cpu,
    offload_fsdp_optimizer,
)

warnings.warn("torchferry.compat.verl is deprecated: import the same names from torchferry.integrations.verl",
              DeprecationWarning, stacklevel=2)

__all__ = [
    "ferry_for",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
]
