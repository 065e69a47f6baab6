"""torchferry for SkyRL: its FSDP2 offload helpers, replaced in one line or one command.

In a process of your own::

    import torchferry.integrations.skyrl as tf_skyrl
    tf_skyrl.patch()      # SkyRL's offload_fsdp2_model_to_cpu & co. now go through torchferry
    tf_skyrl.unpatch()    # what they hold offloaded back on the device; SkyRL's own helpers again

For SkyRL's trainer, whose FSDP workers are Ray actors (each its own process)::

    python -m torchferry.integrations.skyrl.main_base <SkyRL's main_base arguments>

or SkyRL's own entry point, handing over to torchferry's::

    python -m skyrl.train.entrypoints.main_base ... \\
        trainer.override_entrypoint=torchferry.integrations.skyrl.main_base

With an entry point of your own, wrap its ``initialize_ray(cfg)`` in
``with tf_skyrl.ray_init_with_hook():``, or put ``tf_skyrl.patch_when_imported()``
in the worker before it imports SkyRL's FSDP code (see
:mod:`torchferry.integrations.skyrl._ray`).

SkyRL's helpers are verl's (PR #7347) under the same names and signatures, so
the drop-ins re-exported here are the same function objects as
``torchferry.integrations.verl``'s (:mod:`torchferry.integrations._base.helpers`).
Written against SkyRL 0.4.0 (``skyrl.backends.skyrl_train.distributed.fsdp_utils``).
"""

from .._base import (
    ferry_for,
    load_fsdp2_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp2_model_to_cpu,
    offload_fsdp_optimizer,
)
from ._patch import is_patched, patch, unpatch
from ._ray import ENV_FLAG, HOOK_PATH, patch_when_imported, ray_init_with_hook, ray_worker_setup, with_worker_setup

__all__ = [
    "ENV_FLAG",
    "HOOK_PATH",
    "ferry_for",
    "is_patched",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
    "patch",
    "patch_when_imported",
    "ray_init_with_hook",
    "ray_worker_setup",
    "unpatch",
    "with_worker_setup",
]
