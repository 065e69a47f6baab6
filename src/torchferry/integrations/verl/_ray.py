"""torchferry in every Ray worker of a verl job: a ``worker_process_setup_hook``.

verl's FSDP workers are Ray actors, each its own process, so ``patch()`` in the
driver does not reach them. Ray runs a job's ``worker_process_setup_hook`` in
every worker process it starts for that job, before any task or actor method,
and actors inherit the job's ``runtime_env`` (verl's worker groups add their
own ``env_vars``, which Ray merges). :func:`ray_worker_setup` is that hook: it
patches verl's helpers in the worker as soon as the worker imports
``verl.utils.fsdp_utils`` (at once if it already has), so processes that never
import verl's FSDP code pay nothing. The machinery is :mod:`torchferry.integrations._ray_hook`.

Two ways to set it (both tested on the CPU with a real local Ray,
``tests/cpu/test_integration_verl_ray.py``):

* ``python -m torchferry.integrations.verl.main_ppo <verl's arguments>``: the
  launcher adds the hook to the ``runtime_env`` of verl's ``ray.init``;
* with verl's own entry point, a Hydra override:
  ``python -m verl.trainer.main_ppo ...
  +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=torchferry.integrations.verl.ray_worker_setup``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._ray_hook import HookNames, WorkerHook
from ._patch import _FSDP_UTILS, is_patched, patch

__all__ = ["HOOK_PATH", "ENV_FLAG", "ray_worker_setup", "patch_when_imported", "with_worker_setup",
           "ray_init_with_hook"]

HOOK_PATH = "torchferry.integrations.verl.ray_worker_setup"
"""The hook's import path, as Ray's ``runtime_env["worker_process_setup_hook"]`` takes it."""
ENV_FLAG = "TORCHFERRY_VERL"
"""Set to ``"1"`` in the job's ``env_vars`` by :func:`with_worker_setup`; off (``0``, ``false``, ...) does nothing."""

_hook = WorkerHook(
    HookNames(framework="verl", integration="verl", module=_FSDP_UTILS, hook_path=HOOK_PATH,
              env_flag=ENV_FLAG, next_hook_env="TORCHFERRY_VERL_NEXT_HOOK"),
    patch=patch,
    is_patched=is_patched,
)


def patch_when_imported() -> None:
    """Patches verl's helpers now if ``verl.utils.fsdp_utils`` is imported, else right after its import.

    Idempotent.

    Raises:
        RuntimeError: as :func:`patch` (verl changed), at once or at that import.
    """
    _hook.patch_when_imported()


def ray_worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: torchferry for verl's helpers in this worker process.

    Does nothing when the environment variable ``TORCHFERRY_VERL`` is off (``0``, ``false``, ``no``, ``off``).
    Then runs the hook named in ``TORCHFERRY_VERL_NEXT_HOOK``, if any (a hook of
    the user's own that :func:`with_worker_setup` found in the ``runtime_env``).

    Raises:
        RuntimeError: as :func:`patch`, when verl's helpers are not the ones
            this integration was written for.
    """
    _hook.ray_worker_setup()


def with_worker_setup(runtime_env: dict | None) -> dict:
    """A copy of a Ray ``runtime_env`` whose worker processes run :func:`ray_worker_setup`.

    Args:
        runtime_env: the ``runtime_env`` given to ``ray.init`` (a dict, or
            ``None``). A ``worker_process_setup_hook`` already there is kept
            and runs after torchferry's (a callable one is wrapped; a string
            one is passed on by name).

    Returns:
        The new ``runtime_env``, with ``TORCHFERRY_VERL=1`` in its ``env_vars`` and the driver's
        transfer settings it does not set (``_ray_hook.FORWARDED_SETTINGS``).
    """
    return _hook.with_worker_setup(runtime_env)


@contextlib.contextmanager
def ray_init_with_hook() -> Iterator[None]:
    """Within this block, ``ray.init(...)`` gets :func:`with_worker_setup` applied to its ``runtime_env``.

    verl's ``run_ppo`` calls ``ray.init`` through the ``ray`` module's
    attribute, so this reaches it without changing verl's configuration.
    """
    with _hook.ray_init_with_hook():
        yield
