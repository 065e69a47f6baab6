"""The one face the framework folders import besides ``torchferry``'s public names (``tests/cpu/test_layers.py``)."""

from ..._core._api.args import check_bool
from ..._core._dock.phase_dock import PhaseDock
from ..._core._state.fsdp import fsdp2_offloads_params, idle_and_resharded, local_of
from ..._core._state.fsdp1 import fsdp1_offloads_params
from ..._core._transfer.signals import deferred
from ..._core._transfer.switch import whole_copies
from .helpers import (PatchState, SeedHelpers, ferry_for, has_state, helpers_of, load_fsdp2_model_to_gpu,
                      load_fsdp_optimizer, marked, model_load, offload_fsdp2_model_to_cpu, offload_fsdp_optimizer,
                      patch_choices, seed_replacements, settings_of, unpatch_integration)
from .patcher import HelperSet, Patcher, routed
from .ray_hook import HookNames, WorkerHook
from .registry import REGISTRY, away
from .settings import (DOCK_ENV, FORWARDED_SETTINGS, FSDP1_ENV, LAYERWISE_ENV, OPTIMIZER_AT_STEP_ENV, SKIP_ENV,
                       Settings, check_environment, dock_budget, parse_budget, read_switch)

__all__ = [
    "DOCK_ENV", "FORWARDED_SETTINGS", "FSDP1_ENV", "LAYERWISE_ENV", "OPTIMIZER_AT_STEP_ENV", "REGISTRY", "SKIP_ENV",
    "HelperSet", "HookNames", "PatchState", "Patcher", "PhaseDock", "SeedHelpers", "Settings", "WorkerHook", "away",
    "check_bool", "check_environment", "deferred", "dock_budget", "ferry_for", "fsdp1_offloads_params",
    "fsdp2_offloads_params", "has_state", "helpers_of", "idle_and_resharded", "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer", "local_of", "marked", "model_load", "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer",
    "parse_budget", "patch_choices", "read_switch", "routed", "seed_replacements", "settings_of", "unpatch_integration",
    "whole_copies",
]
