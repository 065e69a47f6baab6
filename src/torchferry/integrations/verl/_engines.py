"""verl's VeOmni and Automodel engines' offload helpers, replaced where those engines import ([Note: the VeOmni
and Automodel helpers] in ``docs/integrations.md``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import ModuleType

from .._base import REGISTRY, HelperSet, Patcher, helpers_of, idle_and_resharded, model_load

__all__ = ["ENGINE_SETS", "importable_sets"]


def _optimizers(optimizer) -> list:
    """VeOmni's ``MultiOptimizer`` holds one optimizer per parameter split; others are one."""
    if getattr(optimizer, "_is_multi_optimizer", False):
        return list(optimizer.optimizers_dict.values())
    return [optimizer]


def _replacements(engine: str) -> Callable[[ModuleType, Mapping[str, Callable]], dict[str, Callable]]:
    def build(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
        def offload_model(model, empty_cache: bool = True):
            idle_and_resharded(model)
            helpers_of("verl").offload_model(model, empty_cache)

        def offload_optimizer(optimizer):
            for opt in _optimizers(optimizer):
                helpers_of("verl").offload_optimizer(opt)

        def load_optimizer(optimizer, device_id):
            opts = _optimizers(optimizer)
            if any(o.state and REGISTRY.ferry(o) is None for o in opts):  # verl's own code moved them
                return original[f"load_{engine}_optimizer"](optimizer, device_id)
            for opt in opts:
                helpers_of("verl").load_optimizer(opt, device_id)

        load_model = model_load("verl", original[f"load_{engine}_model_to_gpu"])
        return {f"offload_{engine}_model_to_cpu": offload_model, f"load_{engine}_model_to_gpu": load_model,
                f"offload_{engine}_optimizer": offload_optimizer, f"load_{engine}_optimizer": load_optimizer}
    return build


def _helper_set(engine: str) -> HelperSet:
    package = f"verl.workers.engine.{engine}"
    return HelperSet(
        integration="verl", framework=f"verl's {engine} engine", module=f"{package}.utils", package=package,
        helpers={f"offload_{engine}_model_to_cpu": ("model", "empty_cache"), f"load_{engine}_model_to_gpu": ("model",),
                 f"offload_{engine}_optimizer": ("optimizer",), f"load_{engine}_optimizer": ("optimizer", "device_id")},
        replacements=_replacements(engine), call_sites=(f"{package}.transformer_impl",),
    )


ENGINE_SETS = tuple(_helper_set(engine) for engine in ("veomni", "automodel"))


def importable_sets() -> list[HelperSet]:
    """The engines whose helper module imports here, checked (``RuntimeError`` before anything is replaced)."""
    out = []
    for hs in ENGINE_SETS:
        try:
            importlib.import_module(hs.module)
        except Exception:  # the engine's framework is not installed (verl's engines say so too): skip
            continue
        Patcher(hs).check()
        out.append(hs)
    return out
