"""torchferry in every Ray worker of a SkyRL job: a ``worker_process_setup_hook``.

SkyRL's FSDP workers (``PolicyWorker``, ``CriticWorker``, ``RefWorker`` of
``skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker``, started by
``PPORayActorGroup``) are Ray actors, each its own process,
and its training loop runs in a Ray task (``skyrl_entrypoint``), so ``patch()``
in the driver does not reach them. SkyRL's entry points start Ray in one place,
``skyrl.train.utils.utils.initialize_ray``, as ``ray.init(runtime_env={"env_vars":
...})`` with no setting of its own for a setup hook; its worker actors set no
``runtime_env`` of their own (its inference engines add ``env_vars``, which Ray
merges). So the hook goes into that ``ray.init`` call:

* ``python -m torchferry.integrations.skyrl.main_base <SkyRL's arguments>``, or
  SkyRL's own entry point with ``trainer.override_entrypoint=torchferry.integrations.skyrl.main_base``
  (SkyRL's ``main_base`` hands over to it before parsing its config): the
  launcher adds the hook to the ``runtime_env`` of SkyRL's ``ray.init``;
* an entry point of your own that calls ``initialize_ray(cfg)``: call it inside
  ``with torchferry.integrations.skyrl.ray_init_with_hook():``;
* or, in any process that builds a SkyRL FSDP strategy (a worker class of your
  own), one line before it imports SkyRL's FSDP code:
  ``torchferry.integrations.skyrl.patch_when_imported()``.

:func:`ray_worker_setup` patches SkyRL's helpers in the worker as soon as the
worker imports ``skyrl.backends.skyrl_train.distributed.fsdp_utils`` (at once if
it already has); processes that never import it (the inference engines) pay
nothing. The machinery is :mod:`torchferry.integrations._base.ray_hook`.
"""

from __future__ import annotations


from .._base import HookNames, WorkerHook
from ._patch import _FSDP_UTILS, is_patched, patch

__all__ = ["ENV_FLAG", "HOOK_PATH", "patch_when_imported", "ray_init_with_hook", "ray_worker_setup",
           "with_worker_setup"]

HOOK_PATH = "torchferry.integrations.skyrl.ray_worker_setup"
"""The hook's import path, as Ray's ``runtime_env["worker_process_setup_hook"]`` takes it."""
ENV_FLAG = "TORCHFERRY_SKYRL"
"""Set to ``"1"`` in the job's ``env_vars`` by :func:`with_worker_setup`; off (``0``, ``false``, ...) does nothing."""

_HOOK = WorkerHook(
    HookNames(framework="skyrl", integration="skyrl", module=_FSDP_UTILS, hook_path=HOOK_PATH,
              env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_SKYRL_NEXT_HOOK"),
    # Modules imported later (fsdp_strategy) bind the patched names by their own `from ... import`.
    patch=lambda: patch(import_call_sites=False),
    is_patched=is_patched,
)
patch_when_imported = _HOOK.patch_when_imported
ray_worker_setup = _HOOK.ray_worker_setup
with_worker_setup = _HOOK.with_worker_setup
ray_init_with_hook = _HOOK.ray_init_with_hook
