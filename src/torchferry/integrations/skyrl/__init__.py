"""torchferry for SkyRL 0.4.0: its FSDP2 offload helpers, replaced in one line or one command; in a process of
your own::

    import torchferry.integrations.skyrl as tf_skyrl
    tf_skyrl.patch()      # SkyRL's offload_fsdp2_model_to_cpu & co. now go through torchferry
    tf_skyrl.unpatch()    # what they hold offloaded back on the device; SkyRL's own helpers again

SkyRL's FSDP workers are Ray actors and its training loop a Ray task, so the Ray hook :func:`ray_worker_setup`
patches every worker that imports SkyRL's ``fsdp_utils``. SkyRL starts Ray in ``initialize_ray`` with no
setting for a setup hook: run :mod:`.main_base`, wrap your own ``initialize_ray(cfg)`` in ``with
tf_skyrl.ray_init_with_hook():``, or call ``tf_skyrl.patch_when_imported()`` in the worker before it imports
SkyRL's FSDP code. The helpers re-exported here are the same objects as ``torchferry.integrations.verl``'s.
"""

from .._base import (HookNames, WorkerHook, ferry_for, load_fsdp2_model_to_gpu, load_fsdp_optimizer,
                     offload_fsdp2_model_to_cpu, offload_fsdp_optimizer)
from ._patch import FSDP_UTILS, check_settings, is_patched, patch, unpatch

HOOK_PATH = "torchferry.integrations.skyrl.ray_worker_setup"
ENV_FLAG = "TORCHFERRY_SKYRL"
_HOOK = WorkerHook(HookNames(framework="skyrl", integration="skyrl", module=FSDP_UTILS, hook_path=HOOK_PATH,
                             env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_SKYRL_NEXT_HOOK"),
                   patch=lambda: patch(import_call_sites=False), is_patched=is_patched,
                   check=check_settings)
patch_when_imported = _HOOK.patch_when_imported
ray_worker_setup = _HOOK.ray_worker_setup
with_worker_setup = _HOOK.with_worker_setup
ray_init_with_hook = _HOOK.ray_init_with_hook

__all__ = ["ENV_FLAG", "HOOK_PATH", "ferry_for", "is_patched", "load_fsdp2_model_to_gpu", "load_fsdp_optimizer",
           "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer", "patch", "patch_when_imported", "ray_init_with_hook",
           "ray_worker_setup", "unpatch", "with_worker_setup"]
