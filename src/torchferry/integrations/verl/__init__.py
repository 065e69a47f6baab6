"""torchferry for verl: its FSDP offload helpers, replaced in one line or one command
(``docs/verl-quickstart.md``); in a process of your own::

    import torchferry.integrations.verl as tf_verl
    tf_verl.patch()      # verl's offload_fsdp_model_to_cpu & co. now go through torchferry
    tf_verl.unpatch()    # what they hold offloaded back on the device; verl's own helpers again
    tf_verl.patch(dock=0.6)  # the trainer under a Dock of 0.6 of the GPU: state stays while it fits

verl's FSDP workers are Ray actors: :mod:`.main_ppo`, or the Ray hook :func:`ray_worker_setup` given to verl's
own entry point, patches each worker that imports ``verl.utils.fsdp_utils``. The drop-in helpers are SkyRL's too,
from :mod:`torchferry.integrations._base.helpers` (``torchferry.compat.verl``: their older path).
"""

from .._base import (HookNames, WorkerHook, check_environment, ferry_for, load_fsdp2_model_to_gpu, load_fsdp_optimizer,
                     offload_fsdp2_model_to_cpu, offload_fsdp_optimizer)
from ._dock import dock_rollout, docked
from ._patch import FSDP_UTILS, is_patched, patch, unpatch

HOOK_PATH = "torchferry.integrations.verl.ray_worker_setup"
ENV_FLAG = "TORCHFERRY_VERL"
_HOOK = WorkerHook(HookNames(framework="verl", integration="verl", module=FSDP_UTILS, hook_path=HOOK_PATH,
                             env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_VERL_NEXT_HOOK"),
                   patch=patch, is_patched=is_patched, check=lambda: check_environment(with_dock=True))
patch_when_imported = _HOOK.patch_when_imported
ray_worker_setup = _HOOK.ray_worker_setup
with_worker_setup = _HOOK.with_worker_setup
ray_init_with_hook = _HOOK.ray_init_with_hook

__all__ = ["ENV_FLAG", "HOOK_PATH", "dock_rollout", "docked", "ferry_for", "is_patched", "load_fsdp2_model_to_gpu",
           "load_fsdp_optimizer", "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer", "patch",
           "patch_when_imported", "ray_worker_setup", "unpatch", "with_worker_setup"]
