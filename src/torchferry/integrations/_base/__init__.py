"""What the framework folders (``verl/``, ``skyrl/``, ``areal/``) build on: the one face they import besides
``torchferry``'s public names (``tests/cpu/test_layers.py`` holds it).

* :mod:`.settings`: one frozen :class:`Settings` per ``patch()``, the only reader of ``TORCHFERRY_*``
  variables in ``integrations`` ([Note: each integration's settings]);
* :mod:`.registry`: the one :data:`REGISTRY` of ferries and patch states ([Note: unpatch() brings the
  state back]);
* :mod:`.patcher`: one :class:`Patcher` for a module's functions and a class's methods;
* :mod:`.helpers`: the seed's helpers as one :class:`SeedHelpers` value per caller, its dock router
  received as a value;
* :mod:`.ray_hook`: a Ray ``worker_process_setup_hook`` per integration;
* the few pieces of the core the framework folders need: the framework-neutral :class:`PhaseDock` (verl's
  dock mode adapts it), FSDP's internals (read in the core only).
"""

from ..._core._api.args import check_bool
from ..._core._dock.phase_dock import PhaseDock
from ..._core._state.fsdp import fsdp1_offloads_params, fsdp_modules, local_of, param_groups
from ..._core._transfer.switch import whole_copies
from .helpers import (
    DockRouter,
    PatchState,
    SeedHelpers,
    ferry_for,
    has_state,
    helpers_of,
    load_fsdp2_model_to_gpu,
    load_fsdp_optimizer,
    offload_fsdp2_model_to_cpu,
    offload_fsdp_optimizer,
    patch_choices,
    seed_replacements,
    settings_of,
)
from .patcher import HelperSet, Patcher, routed
from .ray_hook import HookNames, WorkerHook
from .registry import REGISTRY, Held, away
from .settings import (
    DOCK_ENV,
    FORWARDED_SETTINGS,
    FSDP1_ENV,
    LAYERWISE_ENV,
    OPTIMIZER_AT_STEP_ENV,
    SKIP_ENV,
    Settings,
    dock_budget,
    parse_budget,
    read_switch,
)

__all__ = [
    "DOCK_ENV", "FORWARDED_SETTINGS", "FSDP1_ENV", "LAYERWISE_ENV", "OPTIMIZER_AT_STEP_ENV", "REGISTRY", "SKIP_ENV",
    "DockRouter", "Held", "HelperSet", "HookNames", "PatchState", "Patcher", "PhaseDock", "SeedHelpers", "Settings",
    "WorkerHook", "away", "check_bool", "dock_budget", "ferry_for", "fsdp1_offloads_params", "fsdp_modules",
    "has_state", "helpers_of", "load_fsdp2_model_to_gpu", "load_fsdp_optimizer", "local_of",
    "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer", "param_groups", "parse_budget", "patch_choices",
    "read_switch", "routed", "seed_replacements", "settings_of", "whole_copies",
]
