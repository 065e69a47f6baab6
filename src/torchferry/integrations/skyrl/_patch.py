"""``patch()``: SkyRL 0.4.0's FSDP2 offload helpers (verl PR #7347's), replaced in its ``fsdp_utils`` and wherever
SkyRL modules bound them ([Note: what stays with SkyRL's own helpers] in ``docs/integrations.md``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import ModuleType

import torch
from torch import nn

from .._base import (REGISTRY, HelperSet, PatchState, Settings, check_bool, fsdp2_offloads_params,
                     offload_fsdp2_model_to_cpu, routed, seed_replacements, unpatch_integration)

__all__ = ["FSDP_UTILS", "HELPER_SET", "SWITCH_NAMES", "is_patched", "patch", "unpatch"]

FSDP_UTILS = "skyrl.backends.skyrl_train.distributed.fsdp_utils"
SWITCH_NAMES: tuple[str, ...] = ("skip_unchanged", "optimizer_at_step", "layerwise_reload")  # what patch() reads


def _materialise_meta_buffers(model: nn.Module) -> None:
    """SkyRL's first step of ``offload_fsdp2_model_to_cpu``: meta buffers become empty CPU buffers."""
    for module in model.modules():
        for key, buf in list(module.named_buffers(recurse=False)):
            if buf.device.type == "meta":
                setattr(module, key, torch.empty(buf.shape, dtype=buf.dtype, device="cpu"))  # stays a buffer


def _replacements(fsdp_utils: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    out = seed_replacements("skyrl", original)
    seed_offload = out["offload_fsdp2_model_to_cpu"]

    def offload(model, empty_cache: bool = True):  # [Note: what stays with SkyRL's own helpers]
        if fsdp2_offloads_params(model):
            return original["offload_fsdp2_model_to_cpu"](model, empty_cache)
        _materialise_meta_buffers(model)
        return seed_offload(model, empty_cache)

    return {**out, "offload_fsdp2_model_to_cpu": routed(offload_fsdp2_model_to_cpu, offload)}


HELPER_SET = HelperSet(
    integration="skyrl", framework="skyrl", module=FSDP_UTILS, package="skyrl", replacements=_replacements,
    helpers={"offload_fsdp2_model_to_cpu": ("model", "empty_cache"), "load_fsdp2_model_to_gpu": ("model",),
             "offload_fsdp_optimizer": ("optimizer",), "load_fsdp_optimizer": ("optimizer", "device_id")},
    call_sites=("skyrl.backends.skyrl_train.distributed.fsdp_strategy",),  # patched when importable (flash_attn)
    catch=(Exception,),  # SkyRL 0.4.0 on Python < 3.12 fails at import with a pydantic error, not an ImportError
)


def is_patched() -> bool:
    """True between :func:`patch` and :func:`unpatch`."""
    return "skyrl" in REGISTRY.patched


def patch(*, import_call_sites: bool = True, skip_unchanged: bool | None = None,
          optimizer_at_step: bool | None = None, layerwise_reload: bool | None = None) -> list[str]:
    """Routes SkyRL's FSDP2 model and optimizer offload helpers through torchferry ([Note: what stays with
    SkyRL's own helpers]). Idempotent.

    Args:
        import_call_sites: also import ``fsdp_strategy`` now (when its own imports, flash_attn among them, are
            there), so the names it bound by ``from ...fsdp_utils import ...`` are replaced too.
        skip_unchanged, optimizer_at_step, layerwise_reload: as :func:`torchferry.integrations.verl.patch`'s,
            SkyRL's own, only ``skip_unchanged`` on by default ([Note: each integration's settings]).

    Returns:
        The ``module.attribute`` names replaced.

    Raises:
        TypeError: ``import_call_sites`` is not a bool, or a switch neither ``None`` nor a bool.
        ValueError: a switch's environment variable is neither on nor off.
        RuntimeError: SkyRL's ``fsdp_utils`` is not importable (on Python < 3.12: SkyRL needs 3.12), or one of its
            helpers is missing or has other parameters (nothing is replaced then).
    """
    check_bool(import_call_sites, "patch(import_call_sites=...)")
    state = REGISTRY.patched.get("skyrl")
    given = (skip_unchanged, optimizer_at_step, layerwise_reload)
    args: dict[str, bool | None] = dict(zip(SWITCH_NAMES, given, strict=True))
    settings = Settings.read(args, earlier=state.settings if state else None)  # a bad value: nothing replaced
    state = state or PatchState(name="skyrl", settings=settings)
    try:
        names = state.patch(HELPER_SET, import_call_sites=import_call_sites)
    except RuntimeError as e:
        if sys.version_info < (3, 12) and "is not importable" in str(e):
            raise RuntimeError(f"{e}; SkyRL 0.4.0 needs Python >= 3.12 (this is "
                               f"{sys.version_info.major}.{sys.version_info.minor})") from e
        raise
    state.settings = settings
    REGISTRY.patched["skyrl"] = state
    return names


def unpatch() -> None:
    """Brings back what SkyRL's patched helpers hold offloaded ([Note: unpatch() brings the state back] in
    ``docs/integrations.md``), then SkyRL's own helpers again. Idempotent.

    Raises:
        RuntimeError: a reload failed (the device out of memory: the message names it and what stays
            offloaded); nothing is unpatched then.
    """
    unpatch_integration("skyrl", (HELPER_SET,))
