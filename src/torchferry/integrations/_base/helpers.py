"""The seed's FSDP offload helpers, backed by torchferry: one object shared by every integration.

verl's ``verl.utils.fsdp_utils`` (verl PR #7347) and SkyRL's ``skyrl.backends.skyrl_train.distributed.fsdp_utils``
(adapted from verl's) define the same four helpers under the same names and signatures, "the seed" below.
:class:`SeedHelpers` is their drop-in for one caller, everything it depends on received as values; the
module-level functions are the helpers a user imports (no integration, the environment's settings). Unlike
the seed's, the host copies live in one exact-size pinned pool made once per model/optimizer (not 1.90x the
state in power-of-two blocks, allocated on the fly), uneven FSDP2 shards stay pinned, and every parameter,
gradient and optimizer-state object keeps its identity; as with the seed, the offloaded tensors are CPU
tensors in pinned memory, and with ``empty_cache=True`` the offload has completed when the helper returns.

[Note: the verl helpers order the caller's stream]
The seed's ``.to("cpu", non_blocking=True)`` copies run on the caller's stream, so the framework's code may
read the host copies after a synchronisation of that stream (``.item()``, a blocking ``.cpu()``,
``torch.cuda.current_stream().synchronize()``). torchferry's run on its own D2H stream, which those do not
order: on one H200 (12 x 8192^2 AdamW, 6.4 GB of state) the last state tensor read on the host right after
verl's ``offload_fsdp_optimizer`` differed from the state in 3 of 3 trials. So each offload helper makes the
caller's current stream wait for the offload's D2H event (``handle.wait_stream``; no host sync). The cost, as
with the seed: work queued on that stream afterwards starts only once the D2H is done (6.4 GB: 0.12 s at the
53.8 GB/s offloads reach on an H200, README); a ``save_checkpoint`` right after ``update_actor`` first reloads
the model, whose H2D stream waits for the caller's stream, so it now starts after the optimizer's D2H.
(SkyRL's ``FSDPStrategy`` calls ``torch.cuda.synchronize()`` after the helpers.) Checkpoints do not depend on
this ordering: ``state_dict()`` waits for the copies by itself ([Note: state_dict() waits for the offload] in
``torchferry._core._ferry.guards``); other host reads need this ordering plus a synchronisation, or
``handle.wait()``.

[Note: optimizer state waited for at step()]
verl's ``FSDPEngine.to`` reloads the optimizer state right after the model, before update_actor's first
forward, and the seed's ``load_fsdp_optimizer`` makes the caller's stream wait for all of it (12.3 GB of AdamW
state at Qwen2.5-1.5B: 0.228 s on one H200, ``load_optimizer`` in
``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_dc0385b.json``; 30.5 GB at 7B), although only
``optimizer.step()`` reads it. With ``optimizer_at_step`` on, ``load_fsdp_optimizer`` reloads through
``ferry.reload(prefetch=True)``: the copies run on the H2D stream behind the caller's forward and backward
(with switch points: [Note: switch points]), and a step pre-hook completes them before ``optimizer.step()``
(``state_dict()`` too: [Note: prefetch reload] in ``torchferry._core._schedules.prefetch``). Until then the
state tensors are host tensors viewing the pinned pool, bit-identical to what comes back. verl 0.9.1's own
actor (``TrainingWorker``, FSDP2, param and optimizer offload) with it on stays bit-identical to verl's
unpatched run (``tests/cpu/test_integration_verl_actor.py``, on the CPU over gloo; on one H200 too,
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``). The caller's
code must read no optimizer state between the load and the step (verl's and SkyRL's do not).

[Note: the helpers' layer-wise reload]
With ``layerwise_reload`` on, ``load_fsdp2_model_to_gpu`` reloads through ``ferry.reload(prefetch=True)``: the
FSDP2 units come back in forward order on the H2D stream, each unit's forward waiting only for its own copies
([Note: prefetch reload] in ``torchferry._core._schedules.prefetch``), so the phase's first forward starts
after the first unit, not after the whole model (a reload before FSDP2's lazy init is whole: the units are
not known yet). Until its unit's forward a parameter is a host tensor viewing the pinned pool;
``state_dict()``, an offload and ``optimizer.step()`` complete the reload first. It fits phases that start
with a forward (verl's compute_log_prob and update_actor, whose parameters have no ``.grad`` then: a state
holding gradients is reloaded whole); code that reads parameters outside a forward right after the load sees
host tensors; a ``module.to(...)`` there is made good at the reload ([Note: FSDP2's shard buffer after a
move] in ``torchferry._core._state.fsdp``). An ``optimizer.load_state_dict()`` there places the loaded state
on the host: load the model's state first (verl's ``load_checkpoint`` does) or call
``ferry_for(model).reload()``. verl 0.9.1's own actor with it on stays bit-identical to verl's unpatched run,
LoRA and its weight sync included (same tests and figures as above).

Both switches are on under verl's ``patch()`` ([Note: verl's defaults] in ``integrations.verl._patch``), off
elsewhere; ``patch(...)`` of an integration or ``TORCHFERRY_OPTIMIZER_AT_STEP`` /
``TORCHFERRY_LAYERWISE_RELOAD`` (which the Ray hooks pass on) set them.

[Note: the helpers skip unchanged storages]
A model's ferry is made with ``skip_unchanged=True`` ([Note: unchanged storages] in
``torchferry._core._schedules.unchanged``): the frameworks offload after forward-only phases too (verl after
old_log_prob and the reference's forward, SkyRL whenever another role of the colocation group needs the GPU),
and after the first cycle such an offload copies nothing and only releases. A trained model's offload copies
everything without hashing; what it costs there is one hash of the model's storages after each reload.
Measured on one H200 (SkyRL's helpers, Qwen2.5-1.5B, ``benchmarks/frameworks.py``): a forward-only model's
offload took 0.021 s with nothing copied against 0.121 s copying 6.2 GB; a trained model's offload 0.127 s
against 0.119 s and its load 0.119 s against 0.116 s
(``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_424a4de.json`` against
``..._9365f08-models-plain.json``, separate runs). Optimizers' ferries are plain: their state changes at every
step. ``patch(skip_unchanged=False)`` or ``TORCHFERRY_SKIP_UNCHANGED=0`` (passed on by the Ray hooks) makes
plain ferries for the models offloaded after it is set (a ferry keeps its setting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..._core._api.handle import TransferHandle
from ..._core._ferry.ferry import Ferry
from ..._core._state.targets import inner_optimizers
from ..._core._transfer.switch import whole_copies
from .patcher import HelperSet, Patcher, routed
from .registry import REGISTRY, Registry
from .settings import SWITCHES, Settings, read_switch

__all__ = ["PatchState", "SeedHelpers", "ferry_for", "has_state", "helpers_of", "load_fsdp2_model_to_gpu",
           "load_fsdp_optimizer", "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer", "patch_choices",
           "seed_replacements", "settings_of", "unpatch_integration"]


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer, or one it wraps (``ZeroRedundancyOptimizer.optim``), holds state."""
    return any(o.state for _, o in inner_optimizers(optimizer))


@dataclass(frozen=True)
class SeedHelpers:
    """The four helpers for one caller: an integration's replacements, or a user calling them directly."""

    registry: Registry  # where the ferries live (REGISTRY: one per process)
    integration: str | None = None  # whose replacements call (recorded on the ferries they move)
    settings: Settings | None = None  # None: each switch from the environment when it is needed
    router: Any = None
    """A dock mode holding some ferries (verl's: [Note: verl under a Dock]): a load of one makes its set
    resident (``router.load``), an offload does nothing."""

    def switch(self, name: str) -> bool:
        return read_switch(name) if self.settings is None else getattr(self.settings, name)

    def make(self, obj: nn.Module | torch.optim.Optimizer) -> Ferry:
        """``obj``'s ferry, made if it has none; recorded as moved by :attr:`integration`."""
        ferry = self.registry.ferry(obj)
        if ferry is None:
            # See [Note: the helpers skip unchanged storages].
            model = isinstance(obj, nn.Module)
            ferry = Ferry(obj, skip_unchanged=self.switch("skip_unchanged")) if model else Ferry(obj)
            self.registry.put(obj, ferry, self.integration)
        self.registry.moved_by(obj, self.integration)
        return ferry

    def _docked(self, ferry: Ferry | None) -> bool:
        return ferry is not None and self.router is not None and self.router.holds(ferry)

    @torch.no_grad()
    def offload_model(self, model: nn.Module, empty_cache: bool = True) -> None:
        if self._docked(self.registry.ferry(model)):
            return  # the dock evicts it when the room is needed
        ferry = self.make(model)
        with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
            handle = ferry.offload()
        _finish_offload(ferry, handle, empty_cache)

    @torch.no_grad()
    def load_model(self, model: nn.Module) -> None:
        ferry = self.registry.ferry(model)
        if ferry is None:
            return
        if self._docked(ferry):
            self.router.load(ferry)
            return
        if self.switch("layerwise_reload"):  # see [Note: the helpers' layer-wise reload]
            ferry.reload(prefetch=True)  # beside the forward: with switch points
            return
        with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
            ferry.reload()

    @torch.no_grad()
    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not has_state(optimizer) or self._docked(self.registry.ferry(optimizer)):
            return
        ferry = self.make(optimizer)
        with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
            handle = ferry.offload()
        _finish_offload(ferry, handle, empty_cache=False)

    @torch.no_grad()
    def load_optimizer(self, optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
        ferry = self.registry.ferry(optimizer)
        if not has_state(optimizer) or ferry is None:
            return
        device = torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id)
        if device.type == ferry.device.type and device.index is None:
            device = ferry.device
        if device != ferry.device:
            raise ValueError(f"torchferry: load_fsdp_optimizer(device_id={device_id!r}) but the state "
                             f"was offloaded from {ferry.device}; it reloads where it came from")
        if self._docked(ferry):
            self.router.load(ferry)
            return
        if self.switch("optimizer_at_step"):  # see [Note: optimizer state waited for at step()]
            ferry.reload(prefetch=True)  # beside the caller's compute: with switch points
            return
        with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
            ferry.reload()


def _finish_offload(ferry: Ferry, handle: TransferHandle, empty_cache: bool) -> None:
    # See [Note: the verl helpers order the caller's stream].
    if handle.event is not None:
        handle.wait_stream(torch.cuda.current_stream(ferry.device))
    if empty_cache:
        handle.wait()  # the handle offload() returned (also for a no-op offload: the last one)
        if ferry.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(eq=False, kw_only=True)
class PatchState:
    """One integration between its ``patch()`` and ``unpatch()``, held by the registry (``REGISTRY.patched``):
    its settings, the patchers that replaced its framework's names, and its dock router (verl's)."""

    name: str
    settings: Settings
    patchers: dict[str, Patcher] = field(default_factory=dict)  # HelperSet.module (or .cls) -> its patcher
    router: Any = None  # verl's dock mode while patch(dock=...) holds

    @property
    def helpers(self) -> SeedHelpers:
        """The helpers its replacements call: its settings and router, as values."""
        return SeedHelpers(REGISTRY, self.name, self.settings, self.router)

    def patch(self, helper_set: HelperSet, *, import_call_sites: bool = True) -> list[str]:
        """Replaces ``helper_set``'s names (idempotent), its patcher kept here."""
        key = f"{helper_set.module}:{helper_set.cls}"
        return self.patchers.setdefault(key, Patcher(helper_set)).patch(import_call_sites=import_call_sites)


def unpatch_integration(name: str, helper_sets: Iterable[HelperSet], *, keep_offloaded: bool = False,
                        dock_sets: Mapping[Ferry, str] | None = None) -> PatchState | None:
    """An integration's ``unpatch()``: what its replacements hold offloaded brought back (all or nothing: [Note:
    unpatch() brings the state back]), its names restored (unpatched, ``helper_sets``' replacements that modules
    imported after ``patch()`` bound), its ferries closed but ``dock_sets`` (a verl dock's, named so in
    messages). ``keep_offloaded``: neither brought back nor closed.

    Returns:
        The patch state it ended (``None``: it was not patched).

    Raises:
        RuntimeError: a reload failed; nothing is unpatched then.
    """
    if not keep_offloaded:
        REGISTRY.bring_back(name, dock_sets)
    state = REGISTRY.patched.pop(name, None)
    for patcher in state.patchers.values() if state else map(Patcher, helper_sets):
        patcher.unpatch()
    if not keep_offloaded:
        REGISTRY.drop(name, keep=dock_sets or {})
    return state


def helpers_of(integration: str) -> SeedHelpers:
    """The helpers ``integration``'s replacements call now: its patch state's, or (unpatched, a replacement
    bound before ``unpatch()``) the environment's."""
    state = REGISTRY.patched.get(integration)
    return SeedHelpers(REGISTRY, integration) if state is None else state.helpers


def settings_of(integration: str) -> dict[str, bool]:
    """Each helper switch (``skip_unchanged``, ``optimizer_at_step``, ``layerwise_reload``) as ``integration``'s
    replacements read it now ([Note: each integration's settings]).

    Raises:
        ValueError: unpatched, an environment variable it reads is neither on nor off.
    """
    helpers = helpers_of(integration)
    return {name: helpers.switch(name) for name in SWITCHES if name != "fsdp1"}


def patch_choices(integration: str) -> dict[str, str]:
    """The arguments given to ``integration``'s ``patch()`` in this process, as the environment variables a
    worker reads (``"1"`` / ``"0"``, a dock budget): what its Ray hook passes on, so a driver's
    ``patch(layerwise_reload=False)`` reaches the workers as ``TORCHFERRY_LAYERWISE_RELOAD=0``."""
    state = REGISTRY.patched.get(integration)
    return {} if state is None else dict(state.settings.chosen)


_DIRECT = SeedHelpers(REGISTRY)  # a user's own calls: no integration, the environment's settings


def ferry_for(obj: nn.Module | torch.optim.Optimizer) -> Ferry | None:
    """The ferry the helpers keep for ``obj`` (a model or optimizer passed to one of them): its
    :class:`~torchferry.Ferry`, or ``None`` if it was never offloaded through these helpers."""
    return REGISTRY.ferry(obj)


def offload_fsdp2_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Offloads ``model``'s parameters, buffers and gradients to pinned host memory.

    The current stream waits for the D2H copies (no host sync), so a later synchronisation of it orders
    them, as after the seed's same-stream copy ([Note: the verl helpers order the caller's stream]).

    Args:
        model: an FSDP2 (``fully_shard``-ed) or plain module on one GPU.
        empty_cache: wait for the D2H copies, then ``torch.cuda.empty_cache()`` to return the released
            memory to the driver (the seed does the same, and its ``empty_cache`` synchronises too).

    Raises:
        RuntimeError: host memory could not be allocated or pinned (the model stays on the GPU, unchanged).
        ValueError: ``TORCHFERRY_SKIP_UNCHANGED`` is neither on nor off (read for a model's first offload).
    """
    _DIRECT.offload_model(model, empty_cache)


def load_fsdp2_model_to_gpu(model: nn.Module) -> None:
    """Reloads what :func:`offload_fsdp2_model_to_cpu` offloaded; a no-op for a model never offloaded through
    these helpers. The current stream waits for the H2D copies (as with the seed's same-stream
    ``model.to(device, non_blocking=True)``), or, with ``layerwise_reload`` on, each FSDP2 unit's forward for
    its own ([Note: the helpers' layer-wise reload])."""
    _DIRECT.load_model(model)


def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Offloads every device tensor in ``optimizer.state`` to pinned host memory; a no-op for an optimizer
    without state (before its first step), as in the seed. Returns with the D2H copies in flight, the current
    stream waiting for them (no host sync: [Note: the verl helpers order the caller's stream]);
    ``optimizer.state_dict()`` waits for them by itself."""
    _DIRECT.offload_optimizer(optimizer)


def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
    """Reloads what :func:`offload_fsdp_optimizer` offloaded onto ``device_id``, which must be the device the
    state came from (torchferry restores the original storages). The current stream waits for the copies, or,
    with ``optimizer_at_step`` on, only ``optimizer.step()`` does ([Note: optimizer state waited for at step()]).

    Raises:
        ValueError: ``device_id`` is not the device the state was offloaded from.
    """
    _DIRECT.load_optimizer(optimizer, device_id)


def seed_replacements(integration: str, original: Mapping[str, Callable]) -> dict[str, Callable]:
    """The four seed helpers' replacements for ``integration`` (each ``__wrapped__``: the public helper): each
    runs the integration's :func:`helpers_of` at its call; a load of an object torchferry never moved (the
    framework's own code offloaded it, before ``patch()`` or through a path ``patch()`` does not reach) goes
    to the framework's ``original``."""

    def load_model(model):
        if REGISTRY.ferry(model) is None:
            return original["load_fsdp2_model_to_gpu"](model)
        return helpers_of(integration).load_model(model)

    def load_optimizer(optimizer, device_id):
        if REGISTRY.ferry(optimizer) is None:
            return original["load_fsdp_optimizer"](optimizer, device_id)
        return helpers_of(integration).load_optimizer(optimizer, device_id)

    def offload_model(model, empty_cache: bool = True):
        helpers_of(integration).offload_model(model, empty_cache)

    def offload_optimizer(optimizer):
        helpers_of(integration).offload_optimizer(optimizer)

    return {
        "offload_fsdp2_model_to_cpu": routed(offload_fsdp2_model_to_cpu, offload_model),
        "load_fsdp2_model_to_gpu": routed(load_fsdp2_model_to_gpu, load_model),
        "offload_fsdp_optimizer": routed(offload_fsdp_optimizer, offload_optimizer),
        "load_fsdp_optimizer": routed(load_fsdp_optimizer, load_optimizer),
    }
