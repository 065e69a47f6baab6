"""``patch()``: verl's FSDP2 offload helpers, replaced by torchferry's in one line.

Replaced in ``verl.utils.fsdp_utils`` and wherever verl modules imported them by name (the names of
:data:`HELPER_SET`: FSDP2, FSDP1 and plain modules go to torchferry), and the VeOmni and Automodel engines' own
helpers where those engines import ([Note: the VeOmni and Automodel helpers] in ``._engines``). Written
against verl 0.9.1 (the helpers of verl PR #7347).

[Note: FSDP1 models through torchferry]
verl's default actor strategy is FSDP1 (``strategy: fsdp``). verl's own FSDP1 helper moves each flat
parameter with ``handle.flat_param_to("cpu", non_blocking=True)`` into pageable memory and re-points
``_local_shard`` (``verl/utils/fsdp_utils.py``). A ferry moves an FSDP1 model as any module: its flat
parameters (``use_orig_params=False``), or the original parameters and the flat ones they view (``True``),
their ``.grad``s and buffers, storage by storage, into its pinned pool; ``_local_shard`` and the original
parameters' views share the flat parameter's storage, which a reload gives back. A model whose units keep
their flat parameters on the host themselves (``CPUOffload(offload_params=True)``) stays with verl's code,
as do all FSDP1 models with ``patch(fsdp1=False)`` or ``TORCHFERRY_VERL_FSDP1=0``. On by default: verl's
default strategy would otherwise get nothing; tested on the CPU (gloo, both ``use_orig_params``) and on a GPU
(NCCL, both, against the same training without offload: ``tests/gpu/test_fsdp1_verl_cuda.py``).

[Note: verl's defaults]
Under verl's ``patch()`` (the ``main_ppo`` wrapper and the Ray hook call it in every worker) three settings
are on unless switched off by their ``patch()`` argument or environment variable (which the Ray hooks pass to
the workers): ``skip_unchanged``, ``layerwise_reload`` and ``optimizer_at_step``. verl's phases start with a
forward after ``FSDPEngine.to`` loads the model (compute_log_prob, the reference, update_actor), with no
``.grad`` (verl zero-grads with ``set_to_none`` on leaving train mode), and read the optimizer state only in
``optimizer.step()``: so the units come back behind the forward and the state behind forward and backward.
Where verl touches the model between the load and a forward (its LoRA weight sync calls ``model.to("cpu")``
and reads the adapters), the reload is completed first or stays exact ([Note: FSDP2's shard buffer after a
move] in ``torchferry._core._state.fsdp``). Measured through verl 0.9.1's own FSDP2 actor
(``benchmarks/verl_actor.sh``, Qwen2.5-1.5B, 16,384 tokens per phase, weight sync on, one H200, strategies
interleaved in one process), per step: the seconds verl's ``FSDPEngine.to`` calls held the step were 0.487 s
with these defaults against 0.951 s with the two off and 1.389 s for verl's own helpers; every run
bit-identical to verl's (losses, log-probs, parameters, optimizer state, weight-sync buffers:
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``). FSDP1 models
have no FSDP2 units: their reload stays whole. SkyRL's integration keeps torchferry's own defaults (both off).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

from torchferry import Ferry

from .._base import (REGISTRY, HelperSet, PatchState, Settings, check_bool, fsdp1_offloads_params, helpers_of,
                     seed_replacements, unpatch_integration)
from ._dock import docks
from ._dock_patch import DOCK_SETS, patch_dock, unpatch_dock, verl_targets
from ._engines import ENGINE_SETS, importable_sets

__all__ = ["FSDP_UTILS", "is_patched", "patch", "unpatch"]

FSDP_UTILS = "verl.utils.fsdp_utils"
VERL_DEFAULTS = {"optimizer_at_step": True, "layerwise_reload": True}  # see [Note: verl's defaults]


def fsdp1_through_torchferry() -> bool:
    """Whether FSDP1 models go through torchferry ([Note: FSDP1 models through torchferry]): ``patch(fsdp1=...)``,
    else ``TORCHFERRY_VERL_FSDP1`` (on, the default, or off).

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

    # A model torchferry never moved is loaded by verl's own code (seed_replacements).
    def load_fsdp_model_to_gpu(model):
        if REGISTRY.ferry(model) is None:
            return original["load_fsdp_model_to_gpu"](model)
        return seed["load_fsdp2_model_to_gpu"](model)

    return {**seed, "offload_fsdp_model_to_cpu": offload_fsdp_model_to_cpu,
            "load_fsdp_model_to_gpu": load_fsdp_model_to_gpu}


HELPER_SET = HelperSet(
    integration="verl", framework="verl", module=FSDP_UTILS, package="verl", replacements=_replacements,
    helpers={"offload_fsdp_model_to_cpu": ("model", "empty_cache"), "load_fsdp_model_to_gpu": ("model",),
             "offload_fsdp2_model_to_cpu": ("model", "empty_cache"), "load_fsdp2_model_to_gpu": ("model",),
             "offload_fsdp_optimizer": ("optimizer",), "load_fsdp_optimizer": ("optimizer", "device_id")},
    call_sites=("verl.workers.engine.fsdp.transformer_impl", "verl.workers.fsdp_workers"), requires=("fsdp_version",),
)


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return "verl" in REGISTRY.patched


def patch(*, import_engines: bool = True, skip_unchanged: bool | None = None,
          fsdp1: bool | None = None, optimizer_at_step: bool | None = None,
          layerwise_reload: bool | None = None, dock: int | float | str | None = None) -> list[str]:
    """Routes verl's FSDP2 model and optimizer offload helpers through torchferry. Idempotent.

    Each switch left ``None`` is an earlier ``patch()``'s choice, else its environment variable, else its
    default; verl's own ([Note: each integration's settings] in ``integrations._base.settings``), forgotten by
    ``unpatch()``.

    Args:
        import_engines: also import verl's FSDP engine modules now, so the names they bound by ``from
            verl.utils.fsdp_utils import ...`` are replaced too (modules imported later bind the replaced
            helpers anyway).
        skip_unchanged: models' ferries skip unchanged storages ([Note: the helpers skip unchanged storages]
            in ``integrations._base.helpers``); ``TORCHFERRY_SKIP_UNCHANGED``, on by default.
        fsdp1: FSDP1 models go through torchferry too ([Note: FSDP1 models through torchferry]);
            ``TORCHFERRY_VERL_FSDP1``, on by default.
        optimizer_at_step: ``load_fsdp_optimizer`` leaves the state's copies to ``optimizer.step()`` ([Note:
            optimizer state waited for at step()]); ``TORCHFERRY_OPTIMIZER_AT_STEP``, on by default ([Note:
            verl's defaults]).
        layerwise_reload: ``load_fsdp2_model_to_gpu`` reloads the FSDP2 units in forward order ([Note: the
            helpers' layer-wise reload]); ``TORCHFERRY_LAYERWISE_RELOAD``, on by default.
        dock: a GPU budget for verl's trainer under a :class:`~torchferry.Dock` ([Note: verl under a Dock] in
            ``integrations.verl._dock``): bytes (at least 1 MiB; ``40e9`` too) or a float in (0, 1] (a fraction
            of the device's memory); ``0``: no dock (one made by an earlier ``patch()`` is switched off);
            ``None``: ``TORCHFERRY_VERL_DOCK`` (the same, as text; unset or ``0``: no dock), else an earlier
            ``patch()``'s dock. The budget must hold the rollout's memory (vLLM's ``gpu_memory_utilization``
            of the device) and what a phase needs besides it.

    Returns:
        The ``module.attribute`` names replaced.

    Raises:
        TypeError: a switch is neither ``None`` nor a bool.
        ValueError: ``dock`` or ``TORCHFERRY_VERL_DOCK`` is not a budget (``_base.settings.parse_budget``), or
            a switch's environment variable is neither on nor off.
        RuntimeError: verl is not importable, or one of its helpers is missing or has other parameters than
            this integration was written for (nothing is replaced then); with a dock, verl is not 0.9.x or
            the engine context, the worker or the engine it replaces changed.
    """
    state = REGISTRY.patched.get("verl")
    args = {"skip_unchanged": skip_unchanged, "optimizer_at_step": optimizer_at_step,
            "layerwise_reload": layerwise_reload, "fsdp1": fsdp1}
    settings = Settings.read(args, defaults=VERL_DEFAULTS, earlier=state.settings if state else None,
                             with_dock=True, dock=dock)  # a bad value, environment or budget: nothing replaced
    if settings.dock is not None:
        verl_targets()  # checked before anything is replaced
    engines = importable_sets()  # checked before anything is replaced
    state = state or PatchState(name="verl", settings=settings)
    for helper_set in (HELPER_SET, *engines):  # see [Note: the VeOmni and Automodel helpers] in ._engines
        state.patch(helper_set, import_call_sites=import_engines)
    state.settings = settings
    REGISTRY.patched["verl"] = state
    if settings.dock is not None:
        patch_dock(state, settings.dock)
    elif dock is not None:  # patch(dock=0): no dock from now on, in the Ray workers too
        unpatch_dock(state)
    return [name for patcher in state.patchers.values() for name in patcher.names()]


def _dock_sets() -> dict[Ferry, str]:
    """Every verl dock's state sets (the active dock's and those kept for their budgets): ferry -> its
    name, e.g. ``"verl dock set engine0.params"``; their moves in flight waited for."""
    out = {}
    for vd in docks():
        if vd.dock is not None:
            vd.dock.wait()
        out.update({ferry: f"verl dock set {name}" for name, ferry in vd.sets.items()})
    return out


def unpatch(*, keep_offloaded: bool = False) -> None:
    """What the patched helpers and the dock hold offloaded back on the device (not with ``keep_offloaded``),
    then verl's own helpers again ([Note: unpatch() brings the state back] in ``integrations._base.registry``)."""
    check_bool(keep_offloaded, "unpatch(keep_offloaded=...)")
    dock_sets = {} if keep_offloaded else _dock_sets()
    state = unpatch_integration("verl", (HELPER_SET, *ENGINE_SETS, *DOCK_SETS), keep_offloaded=keep_offloaded,
                                dock_sets=dock_sets)
    if state is not None and state.router is not None:  # a phase still open now exits through verl's own code
        state.router.close_phases()
