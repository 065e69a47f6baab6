"""verl's LoRA weight sync reading the adapters where they are, the base model left on the host ([Note: the LoRA
weight sync reads the adapters where they are] in ``docs/integrations.md``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType

from .._base import REGISTRY, HelperSet, marked

__all__ = ["LORA_SYNC_SETS", "reads_adapters_only"]

FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"


def reads_adapters_only(model: object) -> bool:
    """Whether ``model``'s weight sync runs now and reads its adapters where they are (the load and the
    offload inside it leave the model offloaded: ``PatchState.left_in_place``)."""
    state = REGISTRY.patched.get("verl")
    return state is not None and id(model) in state.left_in_place


def _offloaded_here(model: object) -> bool:
    """``model`` is offloaded by torchferry (its copies may still run: ``state_dict()`` waits for them), whole,
    and no dock holds it."""
    ferry = REGISTRY.ferry(model)
    if ferry is None or not ferry.residency.on_host:
        return False
    state = REGISTRY.patched.get("verl")
    router = state.router if state is not None else None
    return router is None or not router.holds(ferry)


def _adapters_only(engine: object, fsdp_version: Callable, layered_summon: bool, base_sync_done: bool) -> bool:
    """Whether this ``get_per_tensor_param`` call reads only adapters, from a model offloaded here."""
    module = getattr(engine, "module", None)
    if module is None or not base_sync_done or layered_summon or fsdp_version(module) != 2:
        return False
    if not hasattr(getattr(module, "_fsdp_wrapped_module", module), "peft_config"):
        return False
    lora = getattr(getattr(engine, "model_config", None), "lora", None)
    if not hasattr(lora, "get") or lora.get("merge", False):
        return False
    if getattr(engine, "_uses_fsdp2_cpu_offload_policy", False):
        return False
    if getattr(engine, "_is_offload_param", False) is not True:  # verl loads it and leaves it loaded
        return False
    return _offloaded_here(module)


def _engine_replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    verl_get = original["get_per_tensor_param"]
    from verl.utils.fsdp_utils import fsdp_version

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        state = REGISTRY.patched.get("verl")  # None: unpatched meanwhile
        here = state is not None and _adapters_only(self, fsdp_version, layered_summon, base_sync_done)
        with marked(state.left_in_place if here else None, getattr(self, "module", None)):
            return verl_get(self, layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs)

    return {"get_per_tensor_param": get_per_tensor_param}


def _full(param, device):
    """One adapter as verl's ``collect_lora_params`` returns it (``full_tensor().detach().cpu()``), gathered
    from where it is now: a tensor of its own (``.cpu()`` of a tensor on the host would return the pool's)."""
    if hasattr(param, "full_tensor"):
        param = param.to(device).full_tensor()
    return param.detach().to("cpu", copy=True)


def _collect_replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    verl_collect = original["collect_lora_params"]

    def collect_lora_params(module, layered_summon, base_sync_done):
        ferry = REGISTRY.ferry(module)
        if not reads_adapters_only(module) or ferry is None or not ferry.residency.on_host:
            return verl_collect(module, layered_summon, base_sync_done)
        from peft.utils.save_and_load import get_peft_model_state_dict

        adapters = get_peft_model_state_dict(getattr(module, "_fsdp_wrapped_module", module))
        return {name: _full(p, ferry.device) for name, p in adapters.items()}

    return {"collect_lora_params": collect_lora_params}


LORA_SYNC_SETS = (  # what the LoRA weight sync's note replaces: both or neither
    HelperSet(integration="verl", framework="verl", module=FSDP_ENGINE, package="verl", cls="FSDPEngine",
              helpers={"get_per_tensor_param": ("self", "layered_summon", "base_sync_done", "kwargs")},
              replacements=_engine_replacements),
    HelperSet(integration="verl", framework="verl", module="verl.utils.fsdp_utils", package="verl",
              helpers={"collect_lora_params": ("module", "layered_summon", "base_sync_done")},
              replacements=_collect_replacements, call_sites=(FSDP_ENGINE,)),
)
