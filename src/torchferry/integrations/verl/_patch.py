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
0.9.1 (the helpers of verl PR #7347). The machinery (signature check, replacing
every binding, exact restore) is :mod:`torchferry.integrations._patching`,
shared with the SkyRL integration; this module names what verl has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

from .. import _helpers as compat
from .._patching import HelperSet, Patcher

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


def _replacements(fsdp_utils: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    fsdp_version = fsdp_utils.fsdp_version

    def offload_fsdp_model_to_cpu(model, empty_cache: bool = True):
        if fsdp_version(model) == 1:  # FSDP1: verl's own code
            return original["offload_fsdp_model_to_cpu"](model, empty_cache)
        return compat.offload_fsdp2_model_to_cpu(model, empty_cache)

    def load_fsdp_model_to_gpu(model):
        if fsdp_version(model) == 1:
            return original["load_fsdp_model_to_gpu"](model)
        return compat.load_fsdp2_model_to_gpu(model)

    return {
        "offload_fsdp_model_to_cpu": offload_fsdp_model_to_cpu,
        "load_fsdp_model_to_gpu": load_fsdp_model_to_gpu,
        "offload_fsdp2_model_to_cpu": compat.offload_fsdp2_model_to_cpu,
        "load_fsdp2_model_to_gpu": compat.load_fsdp2_model_to_gpu,
        "offload_fsdp_optimizer": compat.offload_fsdp_optimizer,
        "load_fsdp_optimizer": compat.load_fsdp_optimizer,
    }


HELPER_SET = HelperSet(
    integration="verl", framework="verl", module=_FSDP_UTILS, package="verl", helpers=_HELPERS,
    replacements=_replacements, call_sites=_ENGINE_MODULES, requires=("fsdp_version",),
)
"""What this integration replaces in verl."""
_patcher = Patcher(HELPER_SET)


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return _patcher.is_patched()


def patch(*, import_engines: bool = True, skip_unchanged: bool | None = None) -> list[str]:
    """Routes verl's FSDP2 model and optimizer offload helpers through torchferry.

    Idempotent.

    Args:
        import_engines: also import verl's FSDP engine modules now, so the names
            they bound by ``from verl.utils.fsdp_utils import ...`` are replaced
            too. Without it, only modules already imported are patched; modules
            imported later bind the replaced helpers anyway (the Ray worker hook
            patches right after ``verl.utils.fsdp_utils`` is imported).
        skip_unchanged: whether models' ferries skip unchanged storages, so that
            an offload after a forward-only phase copies nothing ([Note: the
            helpers skip unchanged storages] in ``integrations._helpers``);
            ``None`` (default): an earlier ``patch()``'s choice, else
            ``TORCHFERRY_SKIP_UNCHANGED``, on unless ``0``. One setting for the
            verl and SkyRL integrations (their helpers are the same), reset by
            ``unpatch()``.

    Returns:
        The ``module.attribute`` names replaced.

    Raises:
        TypeError: ``skip_unchanged`` is neither ``None`` nor a bool.
        ValueError: ``TORCHFERRY_SKIP_UNCHANGED`` is neither ``0`` nor ``1``.
        RuntimeError: verl is not importable, or one of its helpers is missing
            or has other parameters than this integration was written for
            (nothing is replaced then).
    """
    compat.check_skip_setting(skip_unchanged)  # a bad value or environment: nothing replaced
    names = _patcher.patch(import_call_sites=import_engines)
    if skip_unchanged is not None:  # None leaves an earlier patch()'s choice (or the environment)
        compat.set_skip_unchanged(skip_unchanged)
    return names


def unpatch() -> None:
    """Puts verl's own helpers back, also in verl modules imported after :func:`patch`. Idempotent."""
    if is_patched():
        compat.set_skip_unchanged(None)
    _patcher.unpatch()
