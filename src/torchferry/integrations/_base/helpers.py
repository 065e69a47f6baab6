"""The four FSDP offload helpers verl and SkyRL share ("the seed", verl PR #7347's), backed by torchferry:
:class:`SeedHelpers` for one caller, the module-level functions for a user's own calls. The notes cited below are
in ``docs/integrations.md`` ("The seed helpers")."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..._public.ferry import Ferry
from ..._core._api.args import check_device
from ..._core._state.targets import inner_optimizers
from ..._core._transfer.switch import whole_copies
from .patcher import HelperSet, Patcher, routed
from .registry import REGISTRY, Registry
from .settings import SWITCHES, Settings, read_switch

__all__ = ["PatchState", "SeedHelpers", "ferry_for", "has_state", "helpers_of", "load_fsdp2_model_to_gpu",
           "load_fsdp_optimizer", "marked", "model_load", "offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer",
           "patch_choices", "seed_replacements", "settings_of", "unpatch_integration"]


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer, or one it wraps (``ZeroRedundancyOptimizer.optim``), holds state."""
    return any(o.state for _, o in inner_optimizers(optimizer))


def _checked(obj: Any, kind: type, what: str) -> Any:
    """``obj`` if it is a ``kind``; else a one-line ``TypeError`` (a model given to an optimizer helper, ...)."""
    if not isinstance(obj, kind):
        raise TypeError(f"torchferry: the {what} takes a torch {'nn.Module' if kind is nn.Module else 'Optimizer'}, "
                        f"got {type(obj).__name__}; nothing was moved")
    return obj


@dataclass(frozen=True)
class SeedHelpers:
    """The four helpers for one caller: an integration's replacements, or a user calling them directly."""

    registry: Registry  # where the ferries live (REGISTRY: one per process)
    integration: str | None = None  # whose replacements call (recorded on the ferries they move)
    settings: Settings | None = None  # None: each switch from the environment when it is needed
    router: Any = None  # a dock mode (verl's): a load of a ferry it holds makes its set resident, an offload nothing
    forward_follows: Collection[int] | None = None
    """``id`` of each model whose load a forward follows now (verl's train/eval context entry): only those reload
    layer-wise ([Note: the helpers' layer-wise reload]); ``None``: every load may."""

    def switch(self, name: str) -> bool:
        return read_switch(name) if self.settings is None else getattr(self.settings, name)

    def make(self, obj: nn.Module | torch.optim.Optimizer) -> Ferry:
        """``obj``'s ferry, made if it has none; recorded as moved by :attr:`integration`."""
        ferry = self.registry.ferry(obj)
        if ferry is None:  # see [Note: the helpers skip unchanged storages]
            core = None if self.settings is None else self.settings.core  # None: the environment's, now
            skip = isinstance(obj, nn.Module) and self.switch("skip_unchanged")
            ferry = Ferry(obj, skip_unchanged=skip, settings=core)
            self.registry.put(obj, ferry, self.integration)
        self.registry.moved_by(obj, self.integration)
        return ferry

    def _docked(self, ferry: Ferry | None) -> bool:
        return ferry is not None and self.router is not None and self.router.holds(ferry)

    def _offload(self, obj: nn.Module | torch.optim.Optimizer, empty_cache: bool) -> None:
        if self._docked(self.registry.ferry(obj)):
            return  # the dock evicts it when the room is needed
        ferry = self.make(obj)
        with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
            handle = ferry.offload()
        if handle.event is not None:  # see [Note: the verl helpers order the caller's stream]
            handle.wait_stream(torch.cuda.current_stream(ferry.device))
        if empty_cache:
            handle.wait()  # the handle offload() returned (also for a no-op offload: the last one)
            if ferry.device.type == "cuda":
                torch.cuda.empty_cache()

    def _load(self, ferry: Ferry, prefetch: str | None) -> None:
        """A docked set made resident, else ``ferry`` reloaded, beside the caller's compute with switch ``prefetch``
        on ([Note: the helpers' layer-wise reload], [Note: optimizer state waited for at step()]), else whole."""
        if self._docked(ferry):
            self.router.load(ferry, f"{self.integration}'s load")
        elif prefetch is not None and self.switch(prefetch):
            ferry.reload(prefetch=True)  # with switch points
        else:
            with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
                ferry.reload()

    @torch.no_grad()
    def offload_model(self, model: nn.Module, empty_cache: bool = True) -> None:
        self._offload(_checked(model, nn.Module, "model offload"), empty_cache)

    @torch.no_grad()
    def load_model(self, model: nn.Module) -> None:
        ferry = self.registry.ferry(_checked(model, nn.Module, "model load"))
        if ferry is not None:
            follows = self.forward_follows is None or id(model) in self.forward_follows
            self._load(ferry, "layerwise_reload" if follows else None)

    @torch.no_grad()
    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if has_state(_checked(optimizer, torch.optim.Optimizer, "optimizer offload")):
            self._offload(optimizer, empty_cache=False)

    @torch.no_grad()
    def load_optimizer(self, optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
        ferry = self.registry.ferry(_checked(optimizer, torch.optim.Optimizer, "optimizer load"))
        device = check_device(device_id, "load_fsdp_optimizer(device_id=...)", "a device index, 'cuda:N' or a device")
        if device is None:  # an int is the accelerator's device N (verl's get_device_id()), as for torch.device
            raise TypeError("torchferry: load_fsdp_optimizer(device_id=None): give the device to reload onto")
        if not has_state(optimizer) or ferry is None:
            return
        if device.type != ferry.device.type or device.index not in (None, ferry.device.index):
            raise ValueError(f"torchferry: load_fsdp_optimizer(device_id={device_id!r}) but the state "
                             f"was offloaded from {ferry.device}; it reloads where it came from")
        self._load(ferry, "optimizer_at_step")


@dataclass(eq=False, kw_only=True)
class PatchState:
    """One integration between its ``patch()`` and ``unpatch()``, held by the registry (``REGISTRY.patched``)."""

    name: str
    settings: Settings
    patchers: dict[str, Patcher] = field(default_factory=dict)  # HelperSet.key -> its patcher
    router: Any = None  # verl's dock mode while patch(dock=...) holds
    left_in_place: set[int] = field(default_factory=set)
    """``id`` of each model the loads and offloads leave where it is during the framework call running now
    (verl's: [Note: the LoRA weight sync reads the adapters where they are])."""
    forward_follows: set[int] | None = None  # SeedHelpers.forward_follows (verl's: a set; others: None)

    @property
    def helpers(self) -> SeedHelpers:
        """The helpers its replacements call: its settings, router and the loads a forward follows, as values."""
        return SeedHelpers(REGISTRY, self.name, self.settings, self.router, self.forward_follows)

    def patch(self, helper_set: HelperSet, *, import_call_sites: bool = True) -> list[str]:
        """Replaces ``helper_set``'s names (idempotent), its patcher kept here."""
        return self.patchers.setdefault(helper_set.key, Patcher(helper_set)).patch(import_call_sites=import_call_sites)


@contextlib.contextmanager
def marked(ids: set[int] | None, obj: object) -> Iterator[None]:
    """``id(obj)`` in ``ids`` for the block, for a framework call running now (nothing if ``ids`` is ``None`` or
    holds it already: a call inside a call leaves the mark to the outer one)."""
    if ids is None or id(obj) in ids:
        yield
        return
    ids.add(id(obj))
    try:
        yield
    finally:
        ids.discard(id(obj))


def unpatch_integration(name: str, helper_sets: Iterable[HelperSet], *,
                        keep_offloaded: bool = False) -> PatchState | None:
    """An integration's ``unpatch()`` ([Note: unpatch() brings the state back]): its names restored (unpatched:
    ``helper_sets``' in modules imported after ``patch()``); the state it ended returned.

    Raises:
        RuntimeError: a reload failed; nothing is unpatched then.
    """
    dock_sets = {} if keep_offloaded else REGISTRY.kept_sets(name)
    if not keep_offloaded:
        REGISTRY.bring_back(name, dock_sets)
    state = REGISTRY.patched.pop(name, None)
    for patcher in state.patchers.values() if state else map(Patcher, helper_sets):
        patcher.unpatch()
    if not keep_offloaded:
        REGISTRY.drop(name, keep=dock_sets)
    return state


def helpers_of(integration: str) -> SeedHelpers:
    """The helpers ``integration``'s replacements call now: its patch state's, else the environment's."""
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
    """The arguments given to ``integration``'s ``patch()`` in this process, as the environment variables its Ray
    hook passes on (``patch(layerwise_reload=False)``: ``TORCHFERRY_LAYERWISE_RELOAD=0``)."""
    state = REGISTRY.patched.get(integration)
    return {} if state is None else dict(state.settings.chosen)


_DIRECT = SeedHelpers(REGISTRY)  # a user's own calls: no integration, the environment's settings


def ferry_for(obj: nn.Module | torch.optim.Optimizer) -> Ferry | None:
    """The :class:`~torchferry.Ferry` the helpers keep for ``obj`` (``None``: never offloaded through them).

    Raises:
        TypeError: ``obj`` is neither a module nor an optimizer.
    """
    if not isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        raise TypeError(f"torchferry: ferry_for() takes the nn.Module or torch.optim.Optimizer given to the "
                        f"helpers, got {type(obj).__name__}")
    return REGISTRY.ferry(obj)


def offload_fsdp2_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Offloads the parameters, buffers and gradients of ``model`` (FSDP2 or plain, on one GPU) to pinned host
    memory, the current stream waiting for the copies ([Note: the verl helpers order the caller's stream]);
    with ``empty_cache``, waits for them and returns the released memory to the driver, as the seed does.

    Raises:
        RuntimeError: host memory could not be allocated or pinned (the model stays on the GPU, unchanged).
        ValueError: ``TORCHFERRY_SKIP_UNCHANGED`` is neither on nor off (read for a model's first offload).
    """
    _DIRECT.offload_model(model, empty_cache)


def load_fsdp2_model_to_gpu(model: nn.Module) -> None:
    """Reloads what :func:`offload_fsdp2_model_to_cpu` offloaded (a no-op for a model it never offloaded), the
    current stream waiting for the copies, or with ``layerwise_reload`` on each FSDP2 unit's forward for its
    own ([Note: the helpers' layer-wise reload])."""
    _DIRECT.load_model(model)


def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Offloads every device tensor in ``optimizer.state`` to pinned host memory (a no-op without state, as in
    the seed); returns with the copies in flight, the current stream waiting for them ([Note: the verl helpers
    order the caller's stream])."""
    _DIRECT.offload_optimizer(optimizer)


def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
    """Reloads what :func:`offload_fsdp_optimizer` offloaded, the current stream waiting for the copies, or with
    ``optimizer_at_step`` on only ``optimizer.step()`` ([Note: optimizer state waited for at step()]).

    Raises:
        ValueError: ``device_id`` is not the device the state was offloaded from (it reloads where it came from).
    """
    _DIRECT.load_optimizer(optimizer, device_id)


def model_load(integration: str, framework_load: Callable) -> Callable:
    """A model load of ``integration``'s replacements: :func:`helpers_of`'s, else (a model torchferry never moved)
    ``framework_load``."""

    def load_model(model):
        if REGISTRY.ferry(_checked(model, nn.Module, "model load")) is None:
            return framework_load(model)
        return helpers_of(integration).load_model(model)

    return load_model


def seed_replacements(integration: str, original: Mapping[str, Callable]) -> dict[str, Callable]:
    """The four seed helpers' replacements for ``integration`` (``__wrapped__``: the public helper), as
    :func:`model_load`."""

    def load_optimizer(optimizer, device_id):
        if REGISTRY.ferry(_checked(optimizer, torch.optim.Optimizer, "optimizer load")) is None:
            return original["load_fsdp_optimizer"](optimizer, device_id)
        return helpers_of(integration).load_optimizer(optimizer, device_id)

    def offload_model(model, empty_cache: bool = True):
        helpers_of(integration).offload_model(model, empty_cache)

    def offload_optimizer(optimizer):
        helpers_of(integration).offload_optimizer(optimizer)

    load_model = model_load(integration, original["load_fsdp2_model_to_gpu"])
    return {
        "offload_fsdp2_model_to_cpu": routed(offload_fsdp2_model_to_cpu, offload_model),
        "load_fsdp2_model_to_gpu": routed(load_fsdp2_model_to_gpu, load_model),
        "offload_fsdp_optimizer": routed(offload_fsdp_optimizer, offload_optimizer),
        "load_fsdp_optimizer": routed(load_fsdp_optimizer, load_optimizer),
    }
