"""A stand-in for ``ray``, only for ``benchmarks/verl_actor.py`` where ray is not installed.

verl imports ray at module level (``verl/__init__.py`` -> ``verl.protocol``;
``@ray.remote`` decorators; ``ray.actor.ActorHandle`` in annotations), but the
actor code that benchmark runs (verl's ``TrainingWorker`` driven in one
``torchrun`` process group, as verl's own SFT trainer drives it) never talks to
a Ray cluster. ray's wheel is too large to carry to a machine without network,
so ``verl_actor.py`` puts this folder on ``sys.path`` only when
``importlib.util.find_spec("ray")`` finds nothing. It provides:

* ``ray.is_initialized()`` -> False (verl then takes its non-Ray paths, e.g. in
  ``set_numa_affinity``);
* ``ray.remote`` as a decorator that returns the class or function unchanged;
* any other attribute or submodule (``ray.util.placement_group``, ...):
  capitalised names are empty classes (usable in annotations, ``isinstance``
  and as base classes), other names are callables that raise if called, so a
  code path that really needs Ray fails loudly instead of doing nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUB = True  # verl_actor.py records whether this stand-in was used


class _NeedsRay:
    """A ray function: harmless to import and to use as a decorator argument, raises if called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _NeedsRay(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}() needs a real Ray installation (this is the stand-in of "
                           "benchmarks/verl_raystub, used where ray is not installed)")

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __getitem__(self, item):
        return self

    def __repr__(self) -> str:
        return f"<ray stand-in {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        value = type(key, (), {"__module__": self.__name__}) if key[:1].isupper() else _NeedsRay(f"{self.__name__}.{key}")
        setattr(self, key, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_Finder())  # after the real finders: only for what they do not find


def is_initialized() -> bool:
    return False


def remote(*args, **kwargs):
    """``@ray.remote`` and ``@ray.remote(num_cpus=...)``: the class or function, unchanged."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda obj: obj


def __getattr__(key: str):
    if key.startswith("__"):
        raise AttributeError(key)
    return _StubModule.__getattr__(sys.modules[__name__], key)
