"""torchferry in every Ray worker of a verl job: a ``worker_process_setup_hook``.

verl's FSDP workers are Ray actors, each its own process, so ``patch()`` in the
driver does not reach them. Ray runs a job's ``worker_process_setup_hook`` in
every worker process it starts for that job, before any task or actor method,
and actors inherit the job's ``runtime_env`` (verl's worker groups add their
own ``env_vars``, which Ray merges). :func:`ray_worker_setup` is that hook: it
patches verl's helpers in the worker as soon as the worker imports
``verl.utils.fsdp_utils`` (at once if it already has), so processes that never
import verl's FSDP code pay nothing.

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
import functools
import importlib
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable, Iterator

from ._patch import _FSDP_UTILS, is_patched, patch

__all__ = ["HOOK_PATH", "ENV_FLAG", "ray_worker_setup", "patch_when_imported", "with_worker_setup",
           "ray_init_with_hook"]

logger = logging.getLogger("torchferry")

HOOK_PATH = "torchferry.integrations.verl.ray_worker_setup"
"""The hook's import path, as Ray's ``runtime_env["worker_process_setup_hook"]`` takes it."""
ENV_FLAG = "TORCHFERRY_VERL"
"""Set to ``"1"`` in the job's ``env_vars`` by :func:`with_worker_setup`; ``"0"`` makes the hook do nothing."""
_NEXT_HOOK = "TORCHFERRY_VERL_NEXT_HOOK"  # a hook of the user's own, run after ours


class _PatchAfterExec(importlib.abc.Loader):
    """Wraps the loader of ``verl.utils.fsdp_utils``: runs it, then ``patch()`` (once)."""

    def __init__(self, inner: importlib.abc.Loader, finder: _PatchOnImport) -> None:
        self._inner, self._finder = inner, finder

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._finder.remove()
        # Engine modules imported later bind the patched names by their own `from ... import`.
        patch(import_engines=False)

    def __getattr__(self, name: str):  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _FSDP_UTILS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterExec(spec.loader, self)
                return spec
        return None

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


def patch_when_imported() -> None:
    """Patches verl's helpers now if ``verl.utils.fsdp_utils`` is imported, else right after its import.

    Idempotent.

    Raises:
        RuntimeError: as :func:`patch` (verl changed), at once or at that import.
    """
    if is_patched():
        return
    if _FSDP_UTILS in sys.modules:
        patch()
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def ray_worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: torchferry for verl's helpers in this worker process.

    Does nothing when the environment variable ``TORCHFERRY_VERL`` is ``"0"``.
    Then runs the hook named in ``TORCHFERRY_VERL_NEXT_HOOK``, if any (a hook of
    the user's own that :func:`with_worker_setup` found in the ``runtime_env``).

    Raises:
        RuntimeError: as :func:`patch`, when verl's helpers are not the ones
            this integration was written for.
    """
    if os.environ.get(ENV_FLAG, "1") != "0":
        patch_when_imported()
        logger.debug("torchferry: verl's offload helpers are routed through torchferry in pid %d", os.getpid())
    nxt = os.environ.get(_NEXT_HOOK)
    if nxt:
        module, _, name = nxt.rpartition(".")
        getattr(importlib.import_module(module), name)()


def with_worker_setup(runtime_env: dict | None) -> dict:
    """A copy of a Ray ``runtime_env`` whose worker processes run :func:`ray_worker_setup`.

    Args:
        runtime_env: the ``runtime_env`` given to ``ray.init`` (a dict, or
            ``None``). A ``worker_process_setup_hook`` already there is kept
            and runs after torchferry's (a callable one is wrapped; a string
            one is passed on by name).

    Returns:
        The new ``runtime_env``, with ``TORCHFERRY_VERL=1`` in its ``env_vars``.
    """
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars[ENV_FLAG] = "1"
    theirs = env.get("worker_process_setup_hook")
    if theirs is None or theirs == HOOK_PATH:
        env["worker_process_setup_hook"] = HOOK_PATH
    elif isinstance(theirs, str):
        env_vars[_NEXT_HOOK] = theirs
        env["worker_process_setup_hook"] = HOOK_PATH
    else:
        env["worker_process_setup_hook"] = _chain(theirs)
    env["env_vars"] = env_vars
    return env


def _chain(theirs: Callable[[], None]) -> Callable[[], None]:
    def torchferry_then_user_hook() -> None:
        ray_worker_setup()
        theirs()

    return torchferry_then_user_hook


@contextlib.contextmanager
def ray_init_with_hook() -> Iterator[None]:
    """Within this block, ``ray.init(...)`` gets :func:`with_worker_setup` applied to its ``runtime_env``.

    verl's ``run_ppo`` calls ``ray.init`` through the ``ray`` module's
    attribute, so this reaches it without changing verl's configuration.
    """
    import ray

    original = ray.init

    @functools.wraps(original)
    def init(*args, **kwargs):
        kwargs["runtime_env"] = with_worker_setup(kwargs.get("runtime_env"))
        return original(*args, **kwargs)

    ray.init = init
    try:
        yield
    finally:
        ray.init = original
