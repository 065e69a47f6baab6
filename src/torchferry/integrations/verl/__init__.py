"""torchferry for verl: its FSDP2 offload helpers, replaced in one line or one command.

In a process of your own::

    import torchferry.integrations.verl as tf_verl
    tf_verl.patch()      # verl's offload_fsdp_model_to_cpu & co. now go through torchferry
    tf_verl.unpatch()    # what they hold offloaded back on the device; verl's own helpers again
    tf_verl.patch(dock=0.6)  # the trainer under a Dock of 0.6 of the GPU: state stays while it fits

For verl's trainer, whose FSDP workers are Ray actors (each its own process)::

    python -m torchferry.integrations.verl.main_ppo <verl's main_ppo arguments>

or, with verl's own entry point, the Ray hook as a Hydra override::

    python -m verl.trainer.main_ppo ... \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=torchferry.integrations.verl.ray_worker_setup

The drop-in helpers themselves (same names and signatures as verl's, one
:class:`~torchferry.Ferry` per model and optimizer) are re-exported here from
:mod:`torchferry.integrations.verl.helpers`; ``torchferry.compat.verl`` is
their older import path.
"""

from ._dock import dock_rollout, docked
from ._patch import is_patched, patch, unpatch
from ._ray import ENV_FLAG, HOOK_PATH, patch_when_imported, ray_worker_setup, with_worker_setup
from .helpers import (
    ferry_for,
    load_fsdp2_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp2_model_to_cpu,
    offload_fsdp_optimizer,
)

__all__ = [
    "ENV_FLAG",
    "HOOK_PATH",
    "dock_rollout",
    "docked",
    "ferry_for",
    "is_patched",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
    "patch",
    "patch_when_imported",
    "ray_worker_setup",
    "unpatch",
    "with_worker_setup",
]
