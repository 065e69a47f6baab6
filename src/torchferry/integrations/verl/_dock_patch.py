"""``patch(dock=...)``'s side in verl: verl's classes checked, the engine context and the worker's ``init_model``
replaced ([Note: verl under a Dock] in ``docs/integrations.md``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .._base import REGISTRY, HelperSet, Patcher, PatchState
from ._dock import VerlDock, dock_rollout, docked

__all__ = ["patch_dock", "unpatch_dock", "verl_targets"]


def verl_targets() -> type:
    """verl's ``FSDPEngine``, once what the dock mode replaces or reads in verl is checked.

    Raises:
        RuntimeError: verl is not 0.9.x, or one of these changed (nothing is replaced then).
    """
    try:
        import verl
        from verl.workers.engine.fsdp import transformer_impl
    except Exception as e:  # verl's modules or what they import are missing
        raise RuntimeError(f"torchferry: verl dock: verl's engine modules do not import: {e}") from e
    version = str(getattr(verl, "__version__", "?"))
    if not version.startswith("0.9."):
        raise RuntimeError(f"torchferry: verl dock: written for verl 0.9.x, this is verl {version}; "
                           "nothing was replaced (patch() without dock= still works where its helpers match)")
    ctx = Patcher(DOCK_SETS[0]).check()[1]
    Patcher(DOCK_SETS[1]).check()
    engine = getattr(transformer_impl, "FSDPEngine", None)
    if engine is None or tuple(inspect.signature(ctx.__init__).parameters)[:3] != ("self", "engine", "mode"):
        raise RuntimeError(f"torchferry: verl dock: FSDPEngine or BaseEngineCtx(engine, mode) changed in verl "
                           f"{version}; this verl is not supported by patch(dock=...) (nothing was replaced)")
    return engine


def _rollout_bytes(worker: Any) -> tuple[int, int]:
    """An estimate of the rollout's weights and KV cache bytes on one device: the actor's parameters in bf16 over
    the rollout's tensor parallel size, and ``gpu_memory_utilization`` of the device's memory less them."""
    cfg = worker.config.rollout
    tp = int(cfg.get("tensor_model_parallel_size", 1) or 1)
    util = float(cfg.get("gpu_memory_utilization", 0.5) or 0.5)
    module = worker.actor.engine.module
    weights = sum(p.numel() for p in module.parameters()) * 2 // tp
    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else 0
    return int(weights), int(max(0, util * total - weights))


def _ctx_replacements(module: Any, original: Any) -> dict[str, Callable]:
    engine_cls = verl_targets()
    enter, exit_ = original["__enter__"], original["__exit__"]

    def dockable(c) -> bool:
        eng = c.engine
        # every flag: what verl keeps resident is reserved ([Note: verl's offload flags under a Dock])
        return (docked() is not None and isinstance(eng, engine_cls) and not c.disable_auto_offload
                and not eng.engine_config.forward_only)

    def __enter__(c):
        if not dockable(c):
            return enter(c)
        state = REGISTRY.patched["verl"]  # its router: the dock, as docked() says
        state.router.enter(c.engine, c.mode, model=c.engine.is_param_offload_enabled,
                           optimizer=c.mode == "train" and c.engine.is_optimizer_offload_enabled, helpers=state.helpers)
        c._torchferry_dock = state.router  # its exit leaves this dock, also if patch(dock=...) changed it since
        c.engine.mode = c.mode  # after the dock took the phase: a refused phase leaves it as it was

    def __exit__(c, exc_type, exc_val, exc_tb):
        entered = c.__dict__.pop("_torchferry_dock", None)
        if entered is None and not dockable(c):
            return exit_(c, exc_type, exc_val, exc_tb)
        vd = entered if entered is not None else docked()  # not None: dockable(c)
        try:
            vd.leave(c.engine, c.mode, helpers=REGISTRY.patched["verl"].helpers)
        finally:
            c.engine.mode = None

    __enter__.__wrapped__, __exit__.__wrapped__ = enter, exit_  # type: ignore[attr-defined]
    return {"__enter__": __enter__, "__exit__": __exit__}


def _worker_replacements(module: Any, original: Any) -> dict[str, Callable]:
    init_model = original["init_model"]

    def init_model_docked(w, *args, **kwargs):
        out = init_model(w, *args, **kwargs)
        rollout = getattr(w, "rollout", None)
        if docked() is not None and rollout is not None and getattr(w, "actor", None) is not None:
            dock_rollout(rollout, *_rollout_bytes(w))
        return out

    init_model_docked.__wrapped__ = init_model  # type: ignore[attr-defined]
    return {"init_model": init_model_docked}


DOCK_SETS = (  # what patch(dock=...) replaces in verl, besides the helpers
    HelperSet(integration="verl", framework="verl", module="verl.workers.engine.base", package="verl",
              cls="BaseEngineCtx", replacements=_ctx_replacements,
              helpers={"__enter__": ("self",), "__exit__": ("self", "exc_type", "exc_val", "exc_tb")}),
    HelperSet(integration="verl", framework="verl", module="verl.workers.engine_workers", package="verl",
              cls="ActorRolloutRefWorker", helpers={"init_model": ("self",)}, replacements=_worker_replacements),
)


def patch_dock(state: PatchState, budget: int | float) -> None:
    """verl's engine context under the dock kept for ``budget``, else a new one (``unpatch()`` keeps each)."""
    for hs in DOCK_SETS:
        state.patch(hs)
    key = ("verl", type(budget).__name__, budget)  # 1 (a byte) and 1.0 (the device) are two budgets
    if key not in REGISTRY.kept:
        REGISTRY.kept[key] = VerlDock(budget)
    state.router = REGISTRY.kept[key]


def unpatch_dock(state: PatchState) -> None:
    """verl's own engine context again; the dock is kept as it is, the rollout's claimants too."""
    for hs in DOCK_SETS:
        patcher = state.patchers.pop(hs.key, None)
        if patcher is not None:
            patcher.unpatch()
    if state.router is not None:  # a phase still open now exits through verl's own code
        state.router.close_phases()
    state.router = None
