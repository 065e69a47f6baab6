"""verl's LoRA weight sync reading the adapters where they are: the base model stays on the host.

[Note: the LoRA weight sync reads the adapters where they are]
After its first weight sync verl sends the rollout only the LoRA adapters (``base_sync_done``), yet
``FSDPEngine.get_per_tensor_param`` (verl 0.9.1, ``verl/workers/engine/fsdp/transformer_impl.py``)
calls ``load_fsdp_model_to_gpu`` first and ``offload_fsdp_model_to_cpu`` after, and reads the adapters
through peft's ``get_peft_model_state_dict``, which takes the whole ``state_dict()`` (that completes a
layer-wise reload: [Note: the helpers' layer-wise reload] in ``docs/integrations.md``). So every step
the whole base came back to the device for a read of the adapters and was released again: in
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-lora-compute-rich_h100x1_2026-12-06_728fc68_micro-8-8.json``
the weight sync held 0.206 s of torchferry's 0.819 s of exposed time per step, 0.122 s of it after the
calls returned (``exposed.torchferry.exposed_s_per_phase`` against ``transfer_at_calls_s_per_phase``).

Under ``patch()``, when such a sync starts with the model offloaded by torchferry and verl would offload
it again at its end (FSDP2, ``param_offload`` on, peft adapters not merged, not layer-summoned, not held by
a dock), the load and the offload inside it leave the model where it is, and ``collect_lora_params``
reads each adapter from its offloaded parameter as verl's own code reads an FSDP2 ``CPUOffloadPolicy``
parameter: ``param.to(device).full_tensor()``, then a copy on the host as verl's ``.detach().cpu()``
makes (never a view of the pool). ``state_dict()`` while offloaded waits for the offload's copies
([Note: state_dict() waits for the offload] in ``src/torchferry/_core/_ferry/guards.py``) and returns the
pool's bytes, the ones the last offload copied, so the adapters sent are bit-identical to verl's
(``tests/cpu/test_integration_verl_actor.py::test_lora_adds_the_reference_phase_and_stays_bit_identical_through_the_weight_sync``).
Any other sync (the first one with the base, a merge, a model on the device, a model offloaded by hand
with ``param_offload`` off, which verl's sync loads and leaves loaded) runs verl's code unchanged.
The device holds only each adapter's copy while it is gathered, never more than verl's helpers need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType

from .._base import REGISTRY, HelperSet

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


@contextlib.contextmanager
def _reading(model: object) -> Iterator[None]:
    state = REGISTRY.patched.get("verl")
    if state is None or id(model) in state.left_in_place:  # unpatched meanwhile, or a sync inside a sync
        yield
        return
    state.left_in_place.add(id(model))
    try:
        yield
    finally:
        state.left_in_place.discard(id(model))


def _engine_replacements(module: ModuleType, original: Mapping[str, Callable]) -> dict[str, Callable]:
    verl_get = original["get_per_tensor_param"]
    from verl.utils.fsdp_utils import fsdp_version

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        if not _adapters_only(self, fsdp_version, layered_summon, base_sync_done):
            return verl_get(self, layered_summon=layered_summon, base_sync_done=base_sync_done, **kwargs)
        with _reading(self.module):
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


LORA_SYNC_SETS = (
    HelperSet(integration="verl", framework="verl", module=FSDP_ENGINE, package="verl", cls="FSDPEngine",
              helpers={"get_per_tensor_param": ("self", "layered_summon", "base_sync_done", "kwargs")},
              replacements=_engine_replacements),
    HelperSet(integration="verl", framework="verl", module="verl.utils.fsdp_utils", package="verl",
              helpers={"collect_lora_params": ("module", "layered_summon", "base_sync_done")},
              replacements=_collect_replacements, call_sites=(FSDP_ENGINE,)),
)
"""What [Note: the LoRA weight sync reads the adapters where they are] replaces: both or neither."""
