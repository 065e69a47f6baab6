"""``patch()``: verl's FSDP2 offload helpers, replaced by torchferry's in one line.

    import torchferry.integrations.verl as tf_verl
    tf_verl.patch()     # before (or after) verl builds its workers
    ...
    tf_verl.unpatch()   # verl's own helpers again

Replaced in ``verl.utils.fsdp_utils`` and wherever verl modules imported them
by name (``from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu`` in
the FSDP engine): ``offload_fsdp_model_to_cpu``, ``load_fsdp_model_to_gpu``
(FSDP2 and plain modules go to torchferry; FSDP1 models still to verl's own
code), ``offload_fsdp2_model_to_cpu``, ``load_fsdp2_model_to_gpu``,
``offload_fsdp_optimizer``, ``load_fsdp_optimizer``. Written against verl
0.9.1 (the helpers of verl PR #7347).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable

from . import helpers as compat

__all__ = ["is_patched", "patch", "unpatch"]

_FSDP_UTILS = "verl.utils.fsdp_utils"
# Modules that import the helpers by name; patched when importable.
_ENGINE_MODULES = ("verl.workers.engine.fsdp.transformer_impl", "verl.workers.fsdp_workers")
# name -> the parameter names verl's helper must have for the replacement to fit.
_HELPERS: dict[str, tuple[str, ...]] = {
    "offload_fsdp_model_to_cpu": ("model", "empty_cache"),
    "load_fsdp_model_to_gpu": ("model",),
    "offload_fsdp2_model_to_cpu": ("model", "empty_cache"),
    "load_fsdp2_model_to_gpu": ("model",),
    "offload_fsdp_optimizer": ("optimizer",),
    "load_fsdp_optimizer": ("optimizer", "device_id"),
}

# (module name, attribute, original) for every attribute patch() replaced.
_patched: list[tuple[str, str, object]] = []


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return bool(_patched)


def _replacements(fsdp_utils) -> dict[str, Callable]:
    original = {name: getattr(fsdp_utils, name) for name in _HELPERS}
    fsdp_version = fsdp_utils.fsdp_version

    def offload_fsdp_model_to_cpu(model, empty_cache: bool = True):
        if fsdp_version(model) == 1:  # FSDP1: verl's own code
            return original["offload_fsdp_model_to_cpu"](model, empty_cache)
        return compat.offload_fsdp2_model_to_cpu(model, empty_cache)

    def load_fsdp_model_to_gpu(model):
        if fsdp_version(model) == 1:
            return original["load_fsdp_model_to_gpu"](model)
        return compat.load_fsdp2_model_to_gpu(model)

    out = {
        "offload_fsdp_model_to_cpu": offload_fsdp_model_to_cpu,
        "load_fsdp_model_to_gpu": load_fsdp_model_to_gpu,
        "offload_fsdp2_model_to_cpu": compat.offload_fsdp2_model_to_cpu,
        "load_fsdp2_model_to_gpu": compat.load_fsdp2_model_to_gpu,
        "offload_fsdp_optimizer": compat.offload_fsdp_optimizer,
        "load_fsdp_optimizer": compat.load_fsdp_optimizer,
    }
    return {name: _tagged(fn, original[name]) for name, fn in out.items()}


def _tagged(fn: Callable, original: Callable) -> Callable:
    """A wrapper of ``fn`` that remembers verl's ``original`` (for :func:`unpatch`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper.__torchferry_original__ = original  # type: ignore[attr-defined]
    return wrapper


def patch(*, import_engines: bool = True) -> list[str]:
    """Routes verl's FSDP2 model and optimizer offload helpers through torchferry.

    Idempotent.

    Args:
        import_engines: also import verl's FSDP engine modules now, so the names
            they bound by ``from verl.utils.fsdp_utils import ...`` are replaced
            too. Without it, only modules already imported are patched; modules
            imported later bind the replaced helpers anyway (the Ray worker hook
            patches right after ``verl.utils.fsdp_utils`` is imported).

    Returns:
        The ``module.attribute`` names replaced.

    Raises:
        RuntimeError: verl is not importable, or one of its helpers is missing
            or has other parameters than this integration was written for
            (nothing is replaced then).
    """
    if _patched:
        return [f"{m}.{a}" for m, a, _ in _patched]
    try:
        fsdp_utils = importlib.import_module(_FSDP_UTILS)
    except ImportError as e:
        raise RuntimeError(f"torchferry.integrations.verl: verl is not importable ({e})") from e
    for name, params in _HELPERS.items():
        fn = getattr(fsdp_utils, name, None)
        if fn is None:
            raise RuntimeError(f"torchferry.integrations.verl: {_FSDP_UTILS}.{name} is missing; verl changed")
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            raise RuntimeError(
                f"torchferry.integrations.verl: {_FSDP_UTILS}.{name}{got} does not have the parameters "
                f"{params} this integration was written for; verl changed"
            )
    if not hasattr(fsdp_utils, "fsdp_version"):
        raise RuntimeError(f"torchferry.integrations.verl: {_FSDP_UTILS}.fsdp_version is missing; verl changed")
    new = _replacements(fsdp_utils)
    originals = {name: getattr(fsdp_utils, name) for name in _HELPERS}
    for mod_name in _ENGINE_MODULES if import_engines else ():
        try:
            importlib.import_module(mod_name)
        except Exception:  # an optional engine whose own dependencies are missing
            pass
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for name, orig in originals.items():
            if getattr(module, name, None) is orig:
                setattr(module, name, new[name])
                _patched.append((mod_name, name, orig))
    return [f"{m}.{a}" for m, a, _ in _patched]


def unpatch() -> None:
    """Puts verl's own helpers back, also in verl modules imported after :func:`patch`. Idempotent."""
    while _patched:
        mod_name, name, orig = _patched.pop()
        module = sys.modules.get(mod_name)
        if module is not None:
            setattr(module, name, orig)
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for name in _HELPERS:
            fn = getattr(module, name, None)
            original = getattr(fn, "__torchferry_original__", None)
            if original is not None:
                setattr(module, name, original)
