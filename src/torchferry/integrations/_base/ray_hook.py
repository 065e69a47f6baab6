"""A Ray ``worker_process_setup_hook`` that patches a framework's helpers in every worker ([Note: the Ray hook
patches every worker] in ``docs/integrations.md``)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .helpers import patch_choices
from .settings import check_environment, forwarded_env, hook_env

__all__ = ["HookNames", "WorkerHook"]

logger = logging.getLogger("torchferry")


@dataclass(frozen=True, kw_only=True)
class HookNames:
    """The names one integration's hook goes by."""

    framework: str  # the framework as a user knows it (log messages)
    integration: str  # HelperSet.integration: whose patch() choices the hook forwards
    module: str  # the helper module whose import triggers the patch
    hook_path: str  # the import path of the hook function, as Ray's runtime_env takes it
    env_flag: str  # "1" from with_worker_setup(); off makes the hook do nothing, neither on nor off fails it
    next_hook_env: str  # names a hook of the user's own (module.function), run after torchferry's


class _PatchAfterExec(importlib.abc.Loader):
    """Wraps the helper module's loader: runs it, then the patch ([Note: a failed patch fails every import])."""

    def __init__(self, inner: importlib.abc.Loader, finder: _PatchOnImport) -> None:
        self._inner, self._finder = inner, finder

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._finder.remove()
        try:
            self._finder.on_import()
        except BaseException:
            self._finder.install()
            raise

    def __getattr__(self, name: str):  # get_source, is_package, ... of the real loader
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, on_import: Callable[[], object]) -> None:
        self.module, self.on_import = module, on_import

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
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

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


class WorkerHook:
    """The Ray worker hook of one integration: ``patch`` patches now, without importing call sites (modules
    imported later bind the replacements by their own ``from ... import``)."""

    def __init__(self, names: HookNames, patch: Callable[[], object], is_patched: Callable[[], bool],
                 check: Callable[[], object] = check_environment) -> None:
        self.names, self._patch, self._is_patched = names, patch, is_patched
        self._check = check  # reads the variables patch() reads: a bad value refused at the hook, before patching

    def patch_when_imported(self) -> None:
        """Patches now if the helper module is imported, else right after its import. Idempotent.

        Raises:
            RuntimeError: as the integration's ``patch()`` (the framework changed), at once or at that import.
        """
        if self._is_patched():
            return
        if self.names.module in sys.modules:
            self._patch()
        elif not any(isinstance(f, _PatchOnImport) and f.module == self.names.module for f in sys.meta_path):
            _PatchOnImport(self.names.module, self._patch).install()

    def ray_worker_setup(self) -> None:
        """The hook: :meth:`patch_when_imported` unless ``env_flag`` is off ([Note: one parser for the
        environment]), then the hook named in ``next_hook_env``.

        Raises:
            RuntimeError: as the integration's ``patch()``.
            ValueError: the ``env_flag`` variable is neither on nor off, the next hook's is not
                ``module.function``, or a setting's variable is malformed (read here, not at the framework's import).
        """
        on, nxt = hook_env(self.names.env_flag, self.names.next_hook_env)
        if on:
            self._check()
            self.patch_when_imported()
            logger.debug("torchferry: %s's offload helpers are routed through torchferry in pid %d",
                         self.names.framework, os.getpid())
        if nxt:
            module, _, name = nxt.rpartition(".")
            getattr(importlib.import_module(module), name)()

    def with_worker_setup(self, runtime_env: dict | None) -> dict:
        """A copy of a Ray ``runtime_env`` (a dict, or ``None``) whose workers run the hook, then a hook already
        there; its ``env_vars`` get ``<env_flag>=1`` and the settings ([Note: the Ray hook patches every worker])."""
        n = self.names
        env = dict(runtime_env or {})
        ours = {**forwarded_env(), **patch_choices(n.integration)}  # where the job's own env_vars do not set them
        env_vars = {**ours, **(env.get("env_vars") or {}), n.env_flag: "1"}
        theirs = env.get("worker_process_setup_hook")
        if theirs is None or isinstance(theirs, str):
            if theirs not in (None, n.hook_path):
                env_vars[n.next_hook_env] = theirs
            env["worker_process_setup_hook"] = n.hook_path
        else:
            def torchferry_then_user_hook() -> None:
                self.ray_worker_setup()
                theirs()

            env["worker_process_setup_hook"] = torchferry_then_user_hook
        env["env_vars"] = env_vars
        return env

    def launch(self, entry: str, argv: list[str], patch: Callable[[], object] | None = None) -> None:
        """Runs ``entry.main()`` (imported after ``patch``, default the hook's, so it binds torchferry's helpers) on
        ``argv`` (as ``sys.argv[1:]``), its ``ray.init`` given the hook (:meth:`ray_init_with_hook`).

        Raises:
            RuntimeError: as the integration's ``patch()`` (the framework is not importable or changed).
        """
        (patch or self._patch)()
        run = importlib.import_module(entry).main
        sys.argv = [sys.argv[0], *argv]
        with self.ray_init_with_hook():
            run()

    def run_as_main(self, launcher: Callable[[], None]) -> None:
        """``python -m <launcher's module>``: a bad setting exits with its one-line message, else ``launcher()``."""
        try:
            self._check()
        except ValueError as e:
            sys.exit(str(e))
        launcher()

    @contextlib.contextmanager
    def ray_init_with_hook(self) -> Iterator[None]:
        """Within this block, ``ray.init(...)`` gets :meth:`with_worker_setup` applied to its ``runtime_env``
        (code that calls it as ``ray.init``, as verl's ``run_ppo`` and SkyRL's ``initialize_ray`` do)."""
        import ray

        original = ray.init

        @functools.wraps(original)
        def init(*args, **kwargs):
            kwargs["runtime_env"] = self.with_worker_setup(kwargs.get("runtime_env"))
            return original(*args, **kwargs)

        ray.init = init
        try:
            yield
        finally:
            ray.init = original
