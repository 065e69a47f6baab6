"""``patch()``: AReaL 1.0.4's ``FSDPEngine.offload`` / ``onload`` through torchferry ferries, in place of
torch_memory_saver's pause and resume ([Note: the patched offload() keeps AReaL's contract], [Note: what
torch_memory_saver released that a ferry does not], [Note: AReaL's clear_memory() beside the copies] and [Note:
which engines skip unchanged storages] in ``docs/integrations.md``)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from types import ModuleType

import torch

from torchferry import Ferry

from .._base import REGISTRY, HelperSet, PatchState, Settings, away, deferred, unpatch_integration, whole_copies

__all__ = ["ferry_for", "is_patched", "patch", "unpatch"]

def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return "areal" in REGISTRY.patched


def ferry_for(engine: object) -> Ferry | None:
    """The :class:`~torchferry.Ferry` the patched methods keep for ``engine`` (an ``FSDPEngine``), over its
    current model and optimizer, or ``None`` if none was made for them yet."""
    entry = REGISTRY.entry(engine)
    if entry is None or not entry.serves(getattr(engine, "model", None), getattr(engine, "optimizer", None)):
        return None
    return entry.ferry


def _ferry_of(engine: object) -> Ferry:
    """The engine's ferry, made at its first offload (and again for a new model or optimizer, after ``_settle``)."""
    model = getattr(engine, "model", None)
    if model is None:
        raise RuntimeError(HELPER_SET.error("offload() of an FSDPEngine without a model (before initialize() or "
                                            "after destroy()); nothing was moved"))
    optimizer = getattr(engine, "optimizer", None)
    ferry = ferry_for(engine)
    if ferry is not None:
        return ferry
    targets = (model,) if optimizer is None else (model, optimizer)
    state = REGISTRY.patched.get("areal")
    skip = state.settings.choice("skip_unchanged") if state is not None else None  # None: not forced by patch()
    if skip is None:  # see [Note: which engines skip unchanged storages]
        skip = optimizer is None or bool(getattr(getattr(engine, "config", None), "use_lora", False))
    # The engine's device, not the tensors': with CPUOffloadPolicy or per_layer_optim_step, state on the CPU stays out
    ferry = Ferry(*targets, device=getattr(engine, "device", None), skip_unchanged=skip,
                  settings=state.settings.core if state is not None else None)  # None: the environment's, now
    REGISTRY.put(engine, ferry, "areal", (model, optimizer))
    return ferry


def _settle(engine: object) -> None:
    """Brings back and closes the ferry of an engine whose model or optimizer was replaced since it was made
    ([Note: a model or optimizer replaced while offloaded] in ``docs/integrations.md``); a no-op otherwise."""
    entry = REGISTRY.entry(engine)
    if entry is None or entry.serves(getattr(engine, "model", None), getattr(engine, "optimizer", None)):
        return
    if entry.ferry.residency.on_host:
        with whole_copies():  # waited for by close()
            entry.ferry.reload()
    entry.ferry.close()
    REGISTRY.forget(engine)


def _clears_as_areal_cuda(platform: object) -> bool:
    """Whether ``platform.clear_memory`` is AReaL's own CUDA one ([Note: AReaL's clear_memory() beside the copies])."""
    try:
        from areal.infra.platforms.cuda import CudaPlatform  # pyright: ignore[reportMissingImports]
    except Exception:  # noqa: BLE001  (AReaL moved it: call clear_memory() as AReaL does)
        return False
    return getattr(getattr(platform, "clear_memory", None), "__func__", None) is CudaPlatform.clear_memory


def _replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    """``FSDPEngine.offload`` and ``onload``, reading ``module.current_platform`` and ``module.dist`` at each call."""

    def offload(self) -> None:
        """Offloads the engine's model (parameters, buffers, ``.grad``s) and optimizer state to the host through
        its ferry (nothing when already offloaded); returns once the copies are done and the memory released, after
        a barrier of the engine's ranks, ``is_offload`` True ([Note: the patched offload() keeps AReaL's contract]).

        Raises:
            RuntimeError: no model (before ``initialize()``, after ``destroy()``), or host memory could not be
                allocated or pinned (``torchferry.HostBudgetError``); the state stays, ``is_offload`` unchanged.
        """
        self.get_device_stats().log("before offload model")
        _settle(self)
        ferry = _ferry_of(self)
        beside = ferry.device.type == "cuda" and _clears_as_areal_cuda(module.current_platform)
        if beside:  # see [Note: AReaL's clear_memory() beside the copies]
            module.current_platform.synchronize()  # as clear_memory() before its collection
        with deferred(), whole_copies():  # it waits for them below: [Note: whole copies where the caller waits]
            handle = ferry.offload()
            self.is_offload = True  # with the move: a Ctrl-C held during it is raised after this
        if beside:
            gc.collect()
            handle.wait()
            module.current_platform.synchronize()
            torch.cuda.empty_cache()
        else:
            handle.wait()
            module.current_platform.clear_memory()
        REGISTRY.entry(self).held = tuple(  # type: ignore[union-attr]
            t for t in (self.model, getattr(self, "optimizer", None)) if t is not None)
        module.current_platform.synchronize()
        module.dist.barrier(group=self.cpu_group)
        self.get_device_stats().log("after offload model")

    def onload(self) -> None:
        """Reloads what :meth:`offload` moved (nothing for an engine resident or never offloaded through
        torchferry); returns with the state on the device (synchronized), after a barrier of the engine's ranks,
        ``is_offload`` False ([Note: a model or optimizer replaced while offloaded]).

        Raises:
            RuntimeError: the device ran out of memory (the message names the bytes needed; the state stays on
                the host, ``is_offload`` unchanged).
        """
        _settle(self)
        ferry = ferry_for(self)
        with deferred(), whole_copies():  # synchronised below: [Note: whole copies where the caller waits]
            if ferry is not None:
                ferry.reload()
                REGISTRY.entry(self).held = ()  # type: ignore[union-attr]
            self.is_offload = False  # with the move, as in offload()
        module.current_platform.synchronize()
        module.dist.barrier(group=self.cpu_group)
        self.get_device_stats().log("after onload model")

    for name, fn in (("offload", offload), ("onload", onload)):
        fn.__qualname__ = f"FSDPEngine.{name}"
    return {"offload": offload, "onload": onload}


HELPER_SET = HelperSet(
    integration="areal", framework="AReaL", module="areal.engine.fsdp_engine", package="areal", cls="FSDPEngine",
    helpers={"offload": ("self",), "onload": ("self",)}, replacements=_replacements,
    # The callers that give is_offload its meaning, and the engine module's globals the replacements use.
    requires=("FSDPEngine._offload_aware_context", "FSDPEngine._ensure_ready", "current_platform", "dist"),
    catch=(Exception,),  # ImportError, or what areal's own imports raise without an optional package
)


def patch(*, skip_unchanged: bool | None = None) -> list[str]:
    """Routes AReaL's ``FSDPEngine.offload`` / ``onload`` through torchferry ferries, in this process (engines
    made before too). Idempotent: a second call changes nothing, its arguments included.

    Args:
        skip_unchanged: ``None`` (default): on for engines without an optimizer and LoRA engines, off for the
            others ([Note: which engines skip unchanged storages]); a bool: that for every engine.

    Returns:
        The ``module.Class.method`` names replaced.

    Raises:
        TypeError: ``skip_unchanged`` is neither ``None`` nor a bool.
        RuntimeError: areal is not importable, or ``FSDPEngine`` or one of the methods, callers or module globals
            the replacements rely on is missing or has other parameters (nothing is replaced then).
    """
    state = REGISTRY.patched.get("areal")
    if state is not None:
        return next(iter(state.patchers.values())).names()
    if skip_unchanged is not None and not isinstance(skip_unchanged, bool):
        raise TypeError(HELPER_SET.error(f"patch(skip_unchanged=...) takes None or a bool, not {skip_unchanged!r}"))
    state = PatchState(name="areal", settings=Settings.read({} if skip_unchanged is None else
                                                            {"skip_unchanged": skip_unchanged}))
    names = state.patch(HELPER_SET)
    REGISTRY.patched["areal"] = state
    return names


def unpatch() -> None:
    """Brings back the state of every engine offloaded through torchferry (as the patched ``onload()`` without
    its barrier and logs: [Note: unpatch() brings the state back] in ``docs/integrations.md``), then AReaL's own
    ``offload`` / ``onload`` again; the ferries closed. Idempotent.

    Raises:
        RuntimeError: a reload failed (the device out of memory: the message names the engine and what stays
            offloaded); nothing is unpatched then.
    """
    offloaded = [engine for engine, entry in REGISTRY.of("areal") if away(entry.ferry)]
    unpatch_integration("areal", ())
    for engine in offloaded:  # as the patched onload() leaves it
        engine.is_offload = False  # type: ignore[attr-defined]
