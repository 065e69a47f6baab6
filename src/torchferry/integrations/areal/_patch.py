"""``patch()``: AReaL's ``FSDPEngine.offload`` / ``onload`` through torchferry ferries.

Replaced on ``areal.engine.fsdp_engine.FSDPEngine``, and so on every subclass that does not define its own
(``FSDPPPOActor``, ``FSDPPPOCritic``, ``FSDPLMEngine``, ``FSDPRWEngine``, ``FSDPDPOEngine``). Written against
AReaL 1.0.4.

AReaL's own ``offload()`` (``areal/engine/fsdp_engine.py``) raises ``RuntimeError`` unless torch_memory_saver
is enabled (``TMS_INIT_ENABLE=1``, which AReaL's launchers and schedulers set, with the ``LD_PRELOAD`` hook,
when ``enable_offload=True``), logs the device memory, runs ``current_platform.clear_memory()``,
``torch_memory_saver.pause()``, synchronizes, waits at a barrier of the engine's gloo group (``cpu_group``),
logs again and sets ``is_offload = True``; ``onload()`` resumes, synchronizes, waits at the barrier, logs and
sets ``is_offload = False``. The replacements keep that sequence and those flags and move the engine's state
with one :class:`~torchferry.Ferry` per engine over ``engine.model`` and ``engine.optimizer`` (the model alone
for an engine without an optimizer, a reference or teacher), on ``engine.device``; no torch_memory_saver is
needed, and a second ``offload()`` moves nothing (a second TMS pause ends the process). AReaL's callers keep
their meaning: ``_offload_aware_context()`` (around ``update_weights``, ``save``, ``load``, ``export_stats``)
onloads an offloaded engine for the outermost context and offloads it again at its end; ``_ensure_ready()``
(``train_batch``, ``eval_batch``, ``forward_batch``) onloads it. While offloaded the engine's parameters,
``.grad``s and optimizer state are CPU tensors viewing the ferry's pool, each the same Python object as
before; a forward through the model raises ``RuntimeError`` naming ``reload()``.

[Note: what torch_memory_saver released that a ferry does not]
With ``LD_PRELOAD`` and ``TMS_INIT_ENABLE=1`` from process start, every ``cudaMalloc`` of every thread of the
engine's process goes through torch_memory_saver (``csrc/entrypoint.cpp``), and ``pause()`` with no tag unmaps
all of them (``TorchMemorySaver::pause`` in ``csrc/core.cpp``), each first copied to a host backup with a
blocking ``cudaMemcpy`` (``TMS_INIT_ENABLE_CPU_BACKUP=1``). So it released, besides the model and optimizer
state, everything else PyTorch's caching allocator had reserved in that process after AReaL's
``empty_cache()``: live tensors that are not model state (cached activations, FSDP2's communication buffers
alive at that moment, other engines' tensors in the same process), the free blocks of segments that are
partly in use, cuBLAS workspaces, and whatever else the process allocated through ``cudaMalloc`` (NCCL's
buffers where NCCL allocates them that way, Triton's or a library's scratch memory). A ferry releases exactly
the storages of the engine's parameters, buffers, ``.grad``s and optimizer state (FSDP2 resharded first), and
``clear_memory()`` returns to the driver the segments that leaves entirely free: the rest stays on the device,
as do the CUDA context and memory mapped through the driver's ``cuMem*`` API. What torch_memory_saver did that
a ferry does not need: it kept every virtual address (CUDA graphs and raw pointers stayed valid; a ferry's
reload gives new addresses), and paid for that with a host copy of every reserved byte, free blocks included,
into backups it allocated with ``cudaMallocHost`` at each pause and freed at each resume; a ferry's pool is
the state's exact size, pinned once and kept.

[Note: AReaL's clear_memory() beside the copies]
AReaL's CUDA ``clear_memory()`` is ``torch.cuda.synchronize()``, ``gc.collect()``, ``torch.cuda.empty_cache()``
(``areal/infra/platforms/cuda.py``). With the synchronize, barrier and logs after it, that took 0.37-0.43 s per
offload of a 1.5B engine against 0.45 s of copies (one H200, ``overhead_s_all`` in
``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_424a4de.json``), most of it the collection:
host work. Under ``whole_copies()`` ([Note: whole copies where the caller waits] in
``torchferry._core._transfer.switch``) a ferry's ``offload()`` returns once all its D2H copies are queued, some
20 ms into 0.45 s of copies for 24.7 GB; so on a CUDA device the replacement synchronizes first (whatever the
collection frees is used by no pending kernel), queues the copies, collects while they run, waits for them,
synchronizes and empties the cache: the same three steps, the collection moved under the DMA. It frees
nothing the copies read (the ferry holds their sources until their event); ``empty_cache()`` still comes
last, as in AReaL. Where ``current_platform.clear_memory`` is not AReaL's CUDA one (another platform, an
override), the replacement waits for the copies and calls it as AReaL does. Measured at dc0385b (one H200,
``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_dc0385b.json``): the actor's offload took
0.619 s, its copies 0.448 s of it, against 0.858 s at 424a4de; ``clear_memory()`` with the logs and barrier
took 0.48-0.60 s alone in that process, so the method is now AReaL's own host work with the copies inside it.

[Note: which engines skip unchanged storages]
An engine without an optimizer (reference, teacher: forward-only) never writes its weights, so its ferry has
``skip_unchanged=True``: after the first cycle an offload copies nothing and only releases (a 128-bit hash of
each storage at reload and at offload decides; ``docs/ferry.md``). So does a LoRA engine (``config.use_lora``):
its frozen base is most of the bytes. A full-parameter engine with an optimizer writes every weight each step,
so its ferry copies everything without hashing. ``patch(skip_unchanged=...)`` forces one choice for every
engine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from types import ModuleType

import torch

from torchferry import Ferry

from .._base import REGISTRY, HelperSet, PatchState, Settings, away, unpatch_integration, whole_copies

__all__ = ["ferry_for", "is_patched", "patch", "unpatch"]

_PREFIX = "torchferry.integrations.areal"


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


def _skip_unchanged(engine: object, optimizer: object | None) -> bool:
    """See [Note: which engines skip unchanged storages]."""
    state = REGISTRY.patched.get("areal")
    forced = state.settings.choice("skip_unchanged") if state is not None else None
    if forced is not None:
        return forced
    if optimizer is None:
        return True
    return bool(getattr(getattr(engine, "config", None), "use_lora", False))


def _ferry_of(engine: object) -> Ferry:
    """The engine's ferry, made at its first offload (and again if its model or optimizer was
    replaced since: a new ``initialize()``; the old one goes with its entry)."""
    model = getattr(engine, "model", None)
    if model is None:
        raise RuntimeError(
            f"{_PREFIX}: offload() of an FSDPEngine without a model (before initialize() or after "
            "destroy()); nothing was moved"
        )
    optimizer = getattr(engine, "optimizer", None)
    ferry = ferry_for(engine)
    if ferry is not None:
        return ferry
    targets = (model,) if optimizer is None else (model, optimizer)
    # The engine's device, not one inferred from the tensors: with FSDP's CPUOffloadPolicy
    # (fsdp.offload_params) or per_layer_optim_step the state already on the CPU stays out.
    ferry = Ferry(*targets, device=getattr(engine, "device", None),
                  skip_unchanged=_skip_unchanged(engine, optimizer))
    REGISTRY.put(engine, ferry, "areal", (model, optimizer))
    return ferry


# [Note: a model or optimizer replaced while offloaded]
# AReaL's ``engine.offload(); engine.optimizer = AdamW(...); engine.onload()`` left the model on the host: the
# onload found no ferry serving the new optimizer, moved nothing and set ``is_offload`` False; a retried
# ``offload()`` made a ferry for the new pair and was refused, the model being "already offloaded by another
# Ferry". So the entry holds its model and optimizer strongly while offloaded, and ``onload()`` / ``offload()``
# of an engine whose model or optimizer was replaced first bring back what the old ferry holds and close it:
# the next ``offload()`` makes a ferry for the new pair.
def _settle(engine: object) -> None:
    """Brings back and closes the ferry of an engine whose model or optimizer was replaced since it was made;
    a no-op otherwise."""
    entry = REGISTRY.entry(engine)
    if entry is None or entry.serves(getattr(engine, "model", None), getattr(engine, "optimizer", None)):
        return
    if entry.ferry.residency.on_host:
        with whole_copies():  # waited for by close()
            entry.ferry.reload()
    entry.ferry.close()
    REGISTRY.forget(engine)


def _clears_as_areal_cuda(platform: object) -> bool:
    """Whether ``platform.clear_memory`` is AReaL's own CUDA one, which the patched ``offload()`` may run around
    its copies ([Note: AReaL's clear_memory() beside the copies])."""
    try:
        from areal.infra.platforms.cuda import CudaPlatform  # pyright: ignore[reportMissingImports]
    except Exception:  # noqa: BLE001  (AReaL moved it: call clear_memory() as AReaL does)
        return False
    return getattr(getattr(platform, "clear_memory", None), "__func__", None) is CudaPlatform.clear_memory


def _replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    """``offload`` and ``onload`` for ``module.FSDPEngine``; they read ``module.current_platform`` and
    ``module.dist`` at each call, as AReaL's methods do."""

    def offload(self) -> None:
        """Offloads the engine's model (parameters, buffers, ``.grad``s) and optimizer state to the host
        through its torchferry ferry; returns once the copies are done and the released memory went back to
        the driver, after a barrier of the engine's ranks, ``is_offload`` True. Moves nothing when already
        offloaded.

        Raises:
            RuntimeError: the engine has no model (before ``initialize()``, after ``destroy()``), or host
                memory could not be allocated or pinned (``torchferry.HostBudgetError`` among them); the state
                stays on the device, ``is_offload`` unchanged.
        """
        self.get_device_stats().log("before offload model")
        _settle(self)
        ferry = _ferry_of(self)
        beside = ferry.device.type == "cuda" and _clears_as_areal_cuda(module.current_platform)
        if beside:  # see [Note: AReaL's clear_memory() beside the copies]
            module.current_platform.synchronize()  # as clear_memory() before its collection
        with whole_copies():  # it waits for them below: [Note: whole copies where the caller waits]
            handle = ferry.offload()
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
        self.is_offload = True

    def onload(self) -> None:
        """Reloads what :meth:`offload` moved; returns with the state on the device (synchronized), after a
        barrier of the engine's ranks, ``is_offload`` False. Moves nothing for an engine that is resident or
        was never offloaded through torchferry. A model or optimizer replaced since the offload: the state
        offloaded comes back, the new ones move at the next offload.

        Raises:
            RuntimeError: the device ran out of memory (the message names the bytes needed; the state stays on
                the host, ``is_offload`` unchanged).
        """
        _settle(self)  # see [Note: a model or optimizer replaced while offloaded]
        ferry = ferry_for(self)
        if ferry is not None:
            with whole_copies():  # synchronised below: [Note: whole copies where the caller waits]
                ferry.reload()
            REGISTRY.entry(self).held = ()  # type: ignore[union-attr]
        module.current_platform.synchronize()
        module.dist.barrier(group=self.cpu_group)
        self.get_device_stats().log("after onload model")
        self.is_offload = False

    for name, fn in (("offload", offload), ("onload", onload)):
        fn.__module__ = __name__
        fn.__qualname__ = f"FSDPEngine.{name}"
    return {"offload": offload, "onload": onload}


HELPER_SET = HelperSet(
    integration="areal", framework="AReaL", module="areal.engine.fsdp_engine", package="areal", cls="FSDPEngine",
    helpers={"offload": ("self",), "onload": ("self",)}, replacements=_replacements,
    # The callers that give is_offload its meaning (if they are gone, AReaL's protocol changed), and what the
    # replacements use of the engine module's globals, as AReaL's methods do.
    requires=("FSDPEngine._offload_aware_context", "FSDPEngine._ensure_ready", "current_platform", "dist"),
    catch=(Exception,),  # ImportError, or what areal's own imports raise without an optional package
)


def patch(*, skip_unchanged: bool | None = None) -> list[str]:
    """Routes AReaL's ``FSDPEngine.offload`` / ``onload`` through torchferry ferries.

    Idempotent: a second call changes nothing (its arguments included) and returns the same
    names; :func:`unpatch` first to change them. Engines made before the call are covered too
    (the methods are replaced on the class). Patches this process only: call it in every
    process that runs an engine.

    Args:
        skip_unchanged: ``None`` (default): ``skip_unchanged=True`` for engines without an
            optimizer and LoRA engines, off for the others ([Note: which engines skip
            unchanged storages]); a bool: that for every engine.

    Returns:
        The ``module.Class.method`` names replaced.

    Raises:
        TypeError: ``skip_unchanged`` is neither ``None`` nor a bool.
        RuntimeError: areal is not importable, or ``FSDPEngine`` or one of the methods, callers
            or module globals the replacements rely on is missing or has other parameters than
            this integration was written for (nothing is replaced then).
    """
    state = REGISTRY.patched.get("areal")
    if state is not None:
        return next(iter(state.patchers.values())).names()
    if skip_unchanged is not None and not isinstance(skip_unchanged, bool):
        raise TypeError(f"{_PREFIX}: patch(skip_unchanged=...) takes None or a bool, not {skip_unchanged!r}")
    state = PatchState(name="areal", settings=Settings.read({} if skip_unchanged is None else
                                                            {"skip_unchanged": skip_unchanged}))
    names = state.patch(HELPER_SET)
    REGISTRY.patched["areal"] = state
    return names


def unpatch() -> None:
    """Brings back the state of every engine offloaded through torchferry (synchronously, as the patched
    ``onload()`` without its barrier and logs; its ``is_offload`` False: [Note: unpatch() brings the state
    back] in ``integrations._base.registry``), then puts AReaL's own ``offload`` / ``onload`` back on
    ``FSDPEngine`` and closes the ferries. Idempotent.

    Raises:
        RuntimeError: a reload failed (e.g. the device is out of memory; the message names the engine and
            what stays offloaded). Nothing is unpatched then and every engine is as it was; free memory and
            call it again.
    """
    offloaded = [engine for engine, entry in REGISTRY.of("areal") if away(entry.ferry)]
    unpatch_integration("areal", ())
    for engine in offloaded:  # as the patched onload() leaves it
        engine.is_offload = False  # type: ignore[attr-defined]
