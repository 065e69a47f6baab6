"""torchferry for SkyRL 0.4.0: its FSDP2 offload helpers, replaced in one line or one command; in a process of
your own::

    import torchferry.integrations.skyrl as tf_skyrl
    tf_skyrl.patch()      # SkyRL's offload_fsdp2_model_to_cpu & co. now go through torchferry
    tf_skyrl.unpatch()    # what they hold offloaded back on the device; SkyRL's own helpers again

SkyRL's workers are Ray actors: run :mod:`.main_base`, or see [Note: SkyRL's Ray workers] in
``docs/integrations.md``. The helpers re-exported here are the same objects as ``torchferry.integrations.verl``'s.
"""

from .._base import (HookNames, WorkerHook, check_environment, ferry_for, load_fsdp2_model_to_gpu, load_fsdp_optimizer,
                     offload_fsdp2_model_to_cpu, offload_fsdp_optimizer)
from ._patch import FSDP_UTILS, SWITCH_NAMES, is_patched, patch, unpatch

HOOK_PATH = "torchferry.integrations.skyrl.ray_worker_setup"
ENV_FLAG = "TORCHFERRY_SKYRL"
_HOOK = WorkerHook(HookNames(framework="skyrl", integration="skyrl", module=FSDP_UTILS, hook_path=HOOK_PATH,
                             env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_SKYRL_NEXT_HOOK"),
                   patch=lambda: patch(import_call_sites=False), is_patched=is_patched,
                   check=lambda: check_environment(SWITCH_NAMES))  # what its patch() reads, not verl's
patch_when_imported = _HOOK.patch_when_imported
ray_worker_setup = _HOOK.ray_worker_setup
with_worker_setup = _HOOK.with_worker_setup
ray_init_with_hook = _HOOK.ray_init_with_hook

__all__ = ["ENV_FLAG", "HOOK_PATH", "ferry_for", "is_patched", "load_fsdp2_model_to_gpu", "load_fsdp_optimizer",
           "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer", "patch", "patch_when_imported", "ray_init_with_hook",
           "ray_worker_setup", "unpatch", "with_worker_setup"]
