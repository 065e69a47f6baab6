"""``patch()``: verl 0.9.1's FSDP offload helpers (verl PR #7347's) and its VeOmni and Automodel engines' replaced
by torchferry's ([Note: FSDP1 models through torchferry], [Note: verl's defaults] and [Note: the VeOmni and
Automodel helpers] in ``docs/integrations.md``)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType, ModuleType

from .._base import (REGISTRY, HelperSet, PatchState, Patcher, Settings, check_bool, fsdp1_offloads_params,
                     helpers_of, idle_and_resharded, marked, model_load, seed_replacements, unpatch_integration)
from ._dock_patch import DOCK_SETS, patch_dock, unpatch_dock, verl_targets
from ._lora_sync import LORA_SYNC_SETS, reads_adapters_only

__all__ = ["FSDP_UTILS", "is_patched", "patch", "unpatch"]

FSDP_UTILS = "verl.utils.fsdp_utils"
VERL_DEFAULTS = MappingProxyType({"optimizer_at_step": True, "layerwise_reload": True})  # [Note: verl's defaults]


def fsdp1_through_torchferry() -> bool:
    """Whether FSDP1 models go through torchferry ([Note: FSDP1 models through torchferry]).

    Raises:
        ValueError: unpatched, ``TORCHFERRY_VERL_FSDP1`` is neither on nor off.
    """
    return helpers_of("verl").switch("fsdp1")


def _replacements(fsdp_utils: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    fsdp_version = fsdp_utils.fsdp_version
    seed = seed_replacements("verl", original)

    def offload_fsdp_model_to_cpu(model, empty_cache: bool = True):
        if fsdp_version(model) == 1 and (not fsdp1_through_torchferry() or fsdp1_offloads_params(model)):
            return original["offload_fsdp_model_to_cpu"](model, empty_cache)  # verl's own code
        return seed["offload_fsdp2_model_to_cpu"](model, empty_cache)

    load = model_load("verl", original["load_fsdp_model_to_gpu"])

    def load_fsdp_model_to_gpu(model):
        if not reads_adapters_only(model):  # [Note: the LoRA weight sync reads the adapters where they are]
            load(model)

    return {**seed, "offload_fsdp_model_to_cpu": offload_fsdp_model_to_cpu,
            "load_fsdp_model_to_gpu": load_fsdp_model_to_gpu}


HELPER_SET = HelperSet(
    integration="verl", framework="verl", module=FSDP_UTILS, package="verl", replacements=_replacements,
    helpers={"offload_fsdp_model_to_cpu": ("model", "empty_cache"), "load_fsdp_model_to_gpu": ("model",),
             "offload_fsdp2_model_to_cpu": ("model", "empty_cache"), "load_fsdp2_model_to_gpu": ("model",),
             "offload_fsdp_optimizer": ("optimizer",), "load_fsdp_optimizer": ("optimizer", "device_id")},
    call_sites=("verl.workers.engine.fsdp.transformer_impl", "verl.workers.fsdp_workers"), requires=("fsdp_version",),
)


def _context_replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    switch = original["_context_switch"]

    def _context_switch(self, device):  # a train/eval context's entry (its load) or exit (an offload)
        state = REGISTRY.patched.get("verl")
        model = getattr(self.engine, "module", None)
        follows = None if state is None or model is None else state.forward_follows
        with marked(follows, model):
            return switch(self, device)

    return {"_context_switch": _context_switch}


CONTEXT_SET = HelperSet(integration="verl", framework="verl", module="verl.workers.engine.base", package="verl",
                        cls="BaseEngineCtx", helpers={"_context_switch": ("self", "device")},
                        replacements=_context_replacements)
"""Where verl's loads are followed by a forward: only there the reload is layer-wise ([Note: verl's defaults])."""


# verl's VeOmni and Automodel engines' helpers, where they import: [Note: the VeOmni and Automodel helpers]
def _optimizers(optimizer) -> list:
    """VeOmni's ``MultiOptimizer`` holds one optimizer per parameter split; others are one."""
    if getattr(optimizer, "_is_multi_optimizer", False):
        return list(optimizer.optimizers_dict.values())
    return [optimizer]


def _engine_replacements(engine: str, module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
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


def _engine_set(engine: str) -> HelperSet:
    package = f"verl.workers.engine.{engine}"
    return HelperSet(
        integration="verl", framework=f"verl's {engine} engine", module=f"{package}.utils", package=package,
        helpers={f"offload_{engine}_model_to_cpu": ("model", "empty_cache"), f"load_{engine}_model_to_gpu": ("model",),
                 f"offload_{engine}_optimizer": ("optimizer",), f"load_{engine}_optimizer": ("optimizer", "device_id")},
        replacements=functools.partial(_engine_replacements, engine), call_sites=(f"{package}.transformer_impl",),
    )


ENGINE_SETS = tuple(_engine_set(engine) for engine in ("veomni", "automodel"))


def importable_sets() -> list[HelperSet]:
    """The engine sets whose module imports here, checked (``RuntimeError`` before anything is replaced), and the
    LoRA weight sync's and the train/eval context's groups where all their names import and fit (else verl's own
    code runs there: [Note: the LoRA weight sync reads the adapters where they are], [Note: verl's defaults])."""
    out = []
    for hs in ENGINE_SETS:
        try:
            importlib.import_module(hs.module)
        except Exception:  # the engine's framework is not installed (verl's engines say so too): skip
            continue
        Patcher(hs).check()
        out.append(hs)
    for group in (LORA_SYNC_SETS, (CONTEXT_SET,)):
        try:
            for hs in group:
                Patcher(hs).check()  # imports the module
        except Exception:  # the module does not import here, or verl changed these names
            continue
        out.extend(group)
    return out


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return "verl" in REGISTRY.patched


def patch(*, import_engines: bool = True, skip_unchanged: bool | None = None,
          fsdp1: bool | None = None, optimizer_at_step: bool | None = None,
          layerwise_reload: bool | None = None, dock: int | float | str | None = None) -> list[str]:
    """Routes verl's FSDP model and optimizer offload helpers through torchferry. Idempotent.

    A switch left ``None`` is an earlier ``patch()``'s choice, else its environment variable, else on ([Note:
    verl's defaults], [Note: each integration's settings] in ``docs/integrations.md``).

    Args:
        import_engines: also import verl's FSDP engine modules now, so the names they bound by ``from
            verl.utils.fsdp_utils import ...`` are replaced too.
        skip_unchanged: models' ferries skip unchanged storages (``TORCHFERRY_SKIP_UNCHANGED``; [Note: the
            helpers skip unchanged storages]).
        fsdp1: FSDP1 models go through torchferry (``TORCHFERRY_VERL_FSDP1``; [Note: FSDP1 models through torchferry]).
        optimizer_at_step: ``load_fsdp_optimizer`` leaves the state's copies to ``optimizer.step()``
            (``TORCHFERRY_OPTIMIZER_AT_STEP``; [Note: optimizer state waited for at step()]).
        layerwise_reload: ``load_fsdp2_model_to_gpu`` reloads the FSDP2 units in forward order
            (``TORCHFERRY_LAYERWISE_RELOAD``; [Note: the helpers' layer-wise reload]).
        dock: a GPU budget for verl's trainer under a :class:`~torchferry.Dock` ([Note: verl under a Dock]): bytes
            (at least 1 MiB; ``40e9`` too) or a float in (0, 1] (a fraction of the device's memory), the rollout's
            memory included; ``0``: no dock (an earlier one switched off); ``None``: ``TORCHFERRY_VERL_DOCK`` (the
            same, as text), else an earlier ``patch()``'s.

    Returns:
        The ``module.attribute`` names replaced.

    Raises:
        TypeError: a switch is neither ``None`` nor a bool.
        ValueError: ``dock`` or ``TORCHFERRY_VERL_DOCK`` is not a budget, or a switch's variable is neither on nor off.
        RuntimeError: verl is not importable, or one of its helpers is missing or has other parameters (nothing is
            replaced then); with a dock, verl is not 0.9.x or the engine context, worker or engine changed.
    """
    state = REGISTRY.patched.get("verl")
    args = {"skip_unchanged": skip_unchanged, "optimizer_at_step": optimizer_at_step,
            "layerwise_reload": layerwise_reload, "fsdp1": fsdp1}
    settings = Settings.read(args, defaults=VERL_DEFAULTS, earlier=state.settings if state else None,
                             with_dock=True, dock=dock)  # a bad value, environment or budget: nothing replaced
    if settings.dock is not None:
        verl_targets()  # checked before anything is replaced
    engines = importable_sets()  # checked before anything is replaced
    state = state or PatchState(name="verl", settings=settings, forward_follows=set())
    for helper_set in (HELPER_SET, *engines):
        state.patch(helper_set, import_call_sites=import_engines)
    state.settings = settings
    REGISTRY.patched["verl"] = state
    if settings.dock is not None:
        patch_dock(state, settings.dock)
    elif dock is not None:  # patch(dock=0): no dock from now on, in the Ray workers too
        unpatch_dock(state)
    return [name for patcher in state.patchers.values() for name in patcher.names()]


def unpatch(*, keep_offloaded: bool = False) -> None:
    """What the patched helpers and the dock hold offloaded back on the device (not with ``keep_offloaded``),
    then verl's own helpers again ([Note: unpatch() brings the state back] in ``docs/integrations.md``)."""
    check_bool(keep_offloaded, "unpatch(keep_offloaded=...)")
    state = unpatch_integration("verl", (HELPER_SET, *ENGINE_SETS, *LORA_SYNC_SETS, CONTEXT_SET, *DOCK_SETS),
                                keep_offloaded=keep_offloaded)
    if state is not None and state.router is not None:  # a phase still open now exits through verl's own code
        state.router.close_phases()
