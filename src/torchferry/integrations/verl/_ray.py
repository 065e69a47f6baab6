"""torchferry in every Ray worker of a verl job: a ``worker_process_setup_hook``.

verl's FSDP workers are Ray actors, each its own process, so ``patch()`` in the
driver does not reach them. Ray runs a job's ``worker_process_setup_hook`` in
every worker process it starts for that job, before any task or actor method,
and actors inherit the job's ``runtime_env`` (verl's worker groups add their
own ``env_vars``, which Ray merges). :func:`ray_worker_setup` is that hook: it
patches verl's helpers in the worker as soon as the worker imports
``verl.utils.fsdp_utils`` (at once if it already has), so processes that never
import verl's FSDP code pay nothing. The machinery is :mod:`torchferry.integrations._base.ray_hook`.

Two ways to set it (both tested on the CPU with a real local Ray,
``tests/cpu/test_integration_verl_ray.py``):

* ``python -m torchferry.integrations.verl.main_ppo <verl's arguments>``: the
  launcher adds the hook to the ``runtime_env`` of verl's ``ray.init``;
* with verl's own entry point, a Hydra override:
  ``python -m verl.trainer.main_ppo ...
  +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=torchferry.integrations.verl.ray_worker_setup``.
"""

from __future__ import annotations


from .._base import HookNames, WorkerHook
from ._patch import _FSDP_UTILS, is_patched, patch

__all__ = ["HOOK_PATH", "ENV_FLAG", "ray_worker_setup", "patch_when_imported", "with_worker_setup",
           "ray_init_with_hook"]

HOOK_PATH = "torchferry.integrations.verl.ray_worker_setup"
"""The hook's import path, as Ray's ``runtime_env["worker_process_setup_hook"]`` takes it."""
ENV_FLAG = "TORCHFERRY_VERL"
"""Set to ``"1"`` in the job's ``env_vars`` by :func:`with_worker_setup`; off (``0``, ``false``, ...) does nothing."""

_HOOK = WorkerHook(
    HookNames(framework="verl", integration="verl", module=_FSDP_UTILS, hook_path=HOOK_PATH,
              env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_VERL_NEXT_HOOK"),
    patch=patch,
    is_patched=is_patched,
)
patch_when_imported = _HOOK.patch_when_imported
ray_worker_setup = _HOOK.ray_worker_setup
with_worker_setup = _HOOK.with_worker_setup
ray_init_with_hook = _HOOK.ray_init_with_hook
