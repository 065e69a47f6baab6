"""The seed's FSDP offload helpers, backed by torchferry: shared by every integration.

verl's ``verl.utils.fsdp_utils`` (verl PR #7347) and SkyRL's
``skyrl.backends.skyrl_train.distributed.fsdp_utils`` (adapted from verl's)
define the same four helpers under the same names and signatures, called
"the seed" below; these are their torchferry-backed drop-ins. Users import
them from ``torchferry.integrations.verl`` (or ``.helpers``) or
``torchferry.integrations.skyrl``: the same function objects, one registry of
ferries. An integration's ``patch()`` routes its framework's calls here,
adding only what its framework's own helpers do besides moving state (verl's
FSDP1 dispatch, SkyRL's meta-buffer step: see each ``_patch.py``).

Differences from the seed, all in the caller's favour: the host copies live in
one exact-size pinned pool made once per model/optimizer (not 1.90x the state
in power-of-two blocks, allocated on the fly), uneven FSDP2 shards stay pinned,
and every parameter, gradient and optimizer-state object keeps its identity.
As with the seed, the offloaded tensors are CPU tensors in pinned memory; with
``empty_cache=True`` the offload has completed when the helper returns.

[Note: the verl helpers order the caller's stream]
The seed's ``.to("cpu", non_blocking=True)`` copies run on the caller's stream, so the framework's
code may read the host copies after a synchronisation of that stream (``.item()``, a blocking
``.cpu()``, ``torch.cuda.current_stream().synchronize()``). torchferry's copies run on its
own D2H stream, which those do not order: on one H200 (12 x 8192^2 AdamW, 6.4 GB of state)
the last state tensor read on the host right after verl's ``offload_fsdp_optimizer`` differed from
the state in 3 of 3 trials. So each offload helper makes the caller's current stream wait for
the offload's D2H event (``handle.wait_stream``; no host sync): what a later synchronisation of
that stream guaranteed after the seed's copy, it guarantees after torchferry's. The cost, as
with the seed: kernels and copies queued on that stream afterwards start only once the D2H is
done. Where verl queues
work within the D2H's time (6.4 GB: 0.12 s at the 53.8 GB/s offloads reach on an H200, README)
that work loses its overlap with it: a ``save_checkpoint`` right after ``update_actor`` first
reloads the model (``load_fsdp_model_to_gpu``, whose H2D stream waits for the caller's
stream), which now starts after the optimizer's D2H; the next step's reload for the rollout
comes after a Ray round trip and the driver's work, usually later than that. (SkyRL's
``FSDPStrategy.offload_to_cpu`` / ``backload_to_gpu`` call ``torch.cuda.synchronize()`` after
the helpers, so there the copies are done when they return.) Checkpoints do
not depend on this ordering: ``state_dict()`` waits for the copies by itself, whatever the
stream ([Note: state_dict() waits for the offload] in ``torchferry._core._ferry.guards``); other host
reads of the tensors need this ordering plus a synchronisation, or ``handle.wait()``.

[Note: optimizer state waited for at step()]
verl's ``FSDPEngine.to`` reloads the optimizer state right after the model, before
update_actor's first forward, and the seed's ``load_fsdp_optimizer`` makes the caller's stream
wait for all of it (12.3 GB of AdamW state at Qwen2.5-1.5B: 0.228 s on one H200,
``load_optimizer`` in ``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_dc0385b.json``;
30.5 GB at 7B), although only ``optimizer.step()`` reads it. With ``optimizer_at_step`` on
(``patch(optimizer_at_step=True)`` of an integration, or ``TORCHFERRY_OPTIMIZER_AT_STEP=1``,
which the Ray hooks pass on), ``load_fsdp_optimizer`` reloads through
``ferry.reload(prefetch=True)``: the state's copies run on the H2D stream behind the caller's
forward and backward (with switch points, so the compute stream's own small copies are not held
up: [Note: switch points]), and a step pre-hook completes them before ``optimizer.step()``
(``state_dict()`` too: [Note: prefetch reload] in ``torchferry._core._schedules.prefetch``).
Until then the state tensors are host tensors viewing the pinned pool, bit-identical to what
comes back. verl 0.9.1's own actor (``TrainingWorker``, FSDP2, param and optimizer offload) with
it on stays bit-identical to verl's unpatched run, and its ``FSDPEngine.to`` returns with the
state still to come (``tests/cpu/test_integration_verl_actor.py``, on the CPU over gloo; on one
H200 too, ``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``).
On under verl's ``patch()`` ([Note: verl's defaults] in ``integrations.verl._patch``), off
elsewhere; the caller's code must read no optimizer state between the load and the step (verl's
and SkyRL's do not: they run forward, backward, gradient clipping, then the step).

[Note: the helpers' layer-wise reload]
With ``layerwise_reload`` on (``patch(layerwise_reload=True)`` of an integration, or
``TORCHFERRY_LAYERWISE_RELOAD=1``, which the Ray hooks pass on), ``load_fsdp2_model_to_gpu``
reloads through ``ferry.reload(prefetch=True)``: the FSDP2 units come back in forward order on
the H2D stream, each unit's forward waiting only for its own copies ([Note: prefetch reload] in
``torchferry._core._schedules.prefetch``), so the phase's first forward starts after the first
unit, not after the whole model (a reload before FSDP2's lazy init, the model's first forward, is
whole: the units are not known yet). Until its unit's forward a parameter is a host tensor viewing the
pinned pool (its bytes exact); ``state_dict()``, an offload and ``optimizer.step()`` complete the
reload first. It fits phases that start with a forward (verl's compute_log_prob and update_actor,
whose parameters have no ``.grad`` then: a state holding gradients is reloaded whole); code that
reads parameters outside a forward right after the load (a ``param.device`` check) sees host
tensors; a ``module.to(...)`` there is made good at the reload ([Note: FSDP2's shard buffer after
a move] in ``torchferry._core._state.fsdp``). An ``optimizer.load_state_dict()`` there places the
loaded state on its parameters' device, the host while they wait: load the model's state first
(which completes its reload; verl's ``load_checkpoint`` does) or call ``ferry_for(model).reload()``.
verl 0.9.1's own actor with it on stays bit-identical to verl's unpatched run, LoRA and its weight
sync included (``tests/cpu/test_integration_verl_actor.py``,
on the CPU over gloo; full fine-tuning with the weight sync on one H200 too:
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``). On
under verl's ``patch()`` ([Note: verl's defaults] in ``integrations.verl._patch``), off elsewhere.

One :class:`~torchferry.Ferry` is kept per model and per optimizer, weakly
keyed, so it goes away with the object; :func:`ferry_for` returns it.

[Note: the helpers skip unchanged storages]
A model's ferry is made with ``skip_unchanged=True`` ([Note: unchanged
storages] in ``torchferry._core._schedules.unchanged``): the frameworks offload
after forward-only phases too (verl after old_log_prob and the reference's
forward, SkyRL whenever another role of the colocation group needs the GPU), and
those bytes did not change, so after the first cycle such an offload copies
nothing and only releases. A trained model's offload after ``optimizer.step()``
copies everything without hashing (a step is a cheap host check that sends every
parameter to the copy); what it costs there is one hash of the model's
storages after each reload, on the device. Measured on one H200 (SkyRL's
helpers, Qwen2.5-1.5B, ``benchmarks/frameworks.py``): a forward-only model's
offload took 0.021 s with nothing copied against 0.121 s copying 6.2 GB; a
trained model's offload 0.127 s against 0.119 s and its load 0.119 s against
0.116 s (``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_424a4de.json``
against ``..._9365f08-models-plain.json``, separate runs). Optimizers' ferries are plain: their
state changes at every step. ``patch(skip_unchanged=False)`` of an integration,
or ``TORCHFERRY_SKIP_UNCHANGED=0`` in the environment (the Ray hooks pass it on
to the workers), makes plain ferries for models too; it applies to the models
offloaded after it is set (a ferry keeps its setting).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn

from .._core._api.args import check_optional_bool
from .._core._api.env import env_flag
from .._core._ferry.ferry import Ferry
from .._core._api.handle import TransferHandle
from .._core._state.targets import inner_optimizers
from .._core._transfer.switch import whole_copies
from ._bring_back import Held, bring_back
from ._patching import ACTIVE

__all__ = [
    "SKIP_ENV",
    "bring_back_held",
    "drop_ferries",
    "ferry_for",
    "held_by",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_optimizer",
    "LAYERWISE",
    "LAYERWISE_ENV",
    "OPTIMIZER_AT_STEP_ENV",
    "CHOICES",
    "apply_settings",
    "check_settings",
    "optimizer_at_step",
    "patch_choices",
    "reset_settings",
    "set_optimizer_at_step",
    "set_patched_defaults",
    "set_skip_unchanged",
    "settings_of",
    "skip_unchanged",
]

_ferries: weakref.WeakKeyDictionary[object, Ferry] = weakref.WeakKeyDictionary()
# model / optimizer -> the integration whose replacements last moved it through its ferry (its unpatch()
# brings that ferry back: [Note: unpatch() brings the state back] in ``integrations._bring_back``); a
# helper called directly (no integration running) records nothing.
_moved_by: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()

# [Note: each integration's settings]
# verl's and SkyRL's replacements call these same helpers, but each integration's ``patch()``
# arguments and defaults are its own: verl's ``patch()`` turns ``layerwise_reload`` and
# ``optimizer_at_step`` on by default, SkyRL's leaves them off, and with both patched in one
# process neither may change what the other's helpers do, nor may one's ``unpatch()`` forget the
# other's choices. So a setting keeps, per integration, its ``patch()`` choice and its default,
# and every replacement a ``Patcher`` installs runs with ``_patching.ACTIVE`` naming its
# integration: the helper reads that integration's choice, else a value set for every caller
# (``set_optimizer_at_step(...)``, ``LAYERWISE.set(...)``), else the environment variable (one
# per process, shared) over that integration's default. A helper called directly
# (``torchferry.integrations.verl.offload_fsdp2_model_to_cpu``) runs outside any integration,
# so torchferry's default stands in for the integration's. An ``unpatch()`` forgets only its own
# integration's choices; each Ray hook forwards its own. ``tests/cpu/test_optimizer_at_step.py``
# patches both in one process.
class _Setting:
    """One of the helpers' switches, per integration ([Note: each integration's settings]): the
    running integration's ``patch()`` value, else a value set for every caller (``set()``), else
    the environment flag with the running integration's own default, else torchferry's."""

    def __init__(self, name: str, env: str, default: bool) -> None:
        self.name, self.env, self.default = name, env, default
        self.value: bool | None = None  # set(): for every caller (None: none)
        self.chosen: dict[str, bool] = {}  # an integration's patch(name=...)
        self.patched_defaults: dict[str, bool] = {}  # an integration's own defaults while it is patched

    def set(self, value: bool | None) -> bool | None:
        check_optional_bool(value, self.name)
        before, self.value = self.value, value
        return before

    def check(self, value: bool | None, integration: str) -> None:
        check_optional_bool(value, self.name)
        if value is None and self.value is None and integration not in self.chosen:
            env_flag(self.env, self.default)  # read by integration's helpers: a bad value fails here

    def choice(self, integration: str) -> bool | None:
        """What ``integration``'s ``patch()`` chose (``None``: it did not say)."""
        return self.chosen.get(integration)

    def get(self) -> bool:
        who = ACTIVE.get()
        if who is not None and who in self.chosen:
            return self.chosen[who]
        if self.value is not None:
            return self.value
        return env_flag(self.env, self.patched_defaults.get(who, self.default) if who is not None else self.default)


SKIP_ENV = "TORCHFERRY_SKIP_UNCHANGED"
OPTIMIZER_AT_STEP_ENV = "TORCHFERRY_OPTIMIZER_AT_STEP"
_skip = _Setting("skip_unchanged", SKIP_ENV, True)
_at_step = _Setting("optimizer_at_step", OPTIMIZER_AT_STEP_ENV, False)
LAYERWISE_ENV = "TORCHFERRY_LAYERWISE_RELOAD"
LAYERWISE = _Setting("layerwise_reload", LAYERWISE_ENV, False)
"""Whether :func:`load_fsdp2_model_to_gpu` reloads layer-wise ([Note: the helpers' layer-wise reload]):
``.set(value)`` (a value for every caller below an integration's own ``patch()`` choice; ``None``:
none), ``.get()`` (as the running integration reads it: [Note: each integration's settings]);
``TypeError`` / ``ValueError`` as for the other settings."""


def set_skip_unchanged(value: bool | None) -> bool | None:
    """What models' new ferries use ([Note: the helpers skip unchanged storages]), for every caller
    below an integration's own ``patch()`` choice ([Note: each integration's settings]); ``None``:
    no such value (the environment).

    Returns:
        The setting before.

    Raises:
        TypeError: ``value`` is neither ``None`` nor a bool.
    """
    return _skip.set(value)


def skip_unchanged() -> bool:
    """Whether a model's new ferry skips unchanged storages: the running integration's ``patch()``
    choice (inside its replacements), else :func:`set_skip_unchanged`'s value, else
    ``TORCHFERRY_SKIP_UNCHANGED`` (on, the default, or off).

    Raises:
        ValueError: ``TORCHFERRY_SKIP_UNCHANGED`` is neither on nor off.
    """
    return _skip.get()


def set_optimizer_at_step(value: bool | None) -> bool | None:
    """Whether :func:`load_fsdp_optimizer` leaves the state's copies to ``optimizer.step()``
    ([Note: optimizer state waited for at step()]), for every caller below an integration's own
    ``patch()`` choice ([Note: each integration's settings]); ``None``: no such value.

    Returns:
        The setting before.

    Raises:
        TypeError: ``value`` is neither ``None`` nor a bool.
    """
    return _at_step.set(value)


def optimizer_at_step() -> bool:
    """The running integration's ``patch(optimizer_at_step=...)`` choice (inside its replacements),
    else :func:`set_optimizer_at_step`'s value, else ``TORCHFERRY_OPTIMIZER_AT_STEP`` (on or
    off), else that integration's default (verl's: on), else off.

    Raises:
        ValueError: ``TORCHFERRY_OPTIMIZER_AT_STEP`` is neither on nor off.
    """
    return _at_step.get()


_SETTINGS = {"skip_unchanged": _skip, "optimizer_at_step": _at_step, "layerwise_reload": LAYERWISE}


def check_settings(integration: str, **values: bool | None) -> None:
    """Raises what setting each of ``values`` (``skip_unchanged``, ``optimizer_at_step``,
    ``layerwise_reload``) would, or for ``None`` what reading its environment variable would: an
    integration's ``patch()`` checks first, replacing nothing on an error.

    Raises:
        TypeError: a value is neither ``None`` nor a bool.
        ValueError: a value is ``None`` and its environment variable is neither on nor off.
    """
    for name, value in values.items():
        _SETTINGS[name].check(value, integration)


def settings_of(integration: str) -> dict[str, bool]:
    """Each setting (``skip_unchanged``, ``optimizer_at_step``, ``layerwise_reload``) as
    ``integration``'s replacements read it now ([Note: each integration's settings]).

    Raises:
        ValueError: an environment variable it reads is neither on nor off.
    """
    token = ACTIVE.set(integration)
    try:
        return {name: setting.get() for name, setting in _SETTINGS.items()}
    finally:
        ACTIVE.reset(token)


def apply_settings(integration: str, **values: bool | None) -> None:
    """``integration``'s ``patch()`` choices: sets each of ``values`` that is not ``None`` (``None``
    keeps an earlier ``patch()``'s choice) for its own replacements only ([Note: each
    integration's settings])."""
    for name, value in values.items():
        if value is not None:
            check_optional_bool(value, name)
            _SETTINGS[name].chosen[integration] = value


def set_patched_defaults(integration: str, **defaults: bool) -> None:
    """``integration``'s own defaults (``optimizer_at_step``, ``layerwise_reload``, ...), used by its
    replacements where neither its ``patch()`` argument nor the environment variable says (verl's:
    [Note: verl's defaults] in ``integrations.verl._patch``); reset by :func:`reset_settings`."""
    for name, value in defaults.items():
        check_optional_bool(value, name)
        _SETTINGS[name].patched_defaults[integration] = value


CHOICES: dict[str, tuple[str, Callable[[], bool | str | None]]] = {}
"""Environment variable -> (the integration, its own ``patch()`` choice that is not one of the
three settings: verl's ``fsdp1``), for :func:`patch_choices` of that integration."""


def patch_choices(integration: str) -> dict[str, str]:
    """The settings given to ``integration``'s ``patch()`` in this process (or set for every
    caller), as the environment variables a worker reads (``"1"`` / ``"0"``): what its Ray hook
    passes on, so a driver's ``patch(layerwise_reload=False)`` reaches the workers as
    ``TORCHFERRY_LAYERWISE_RELOAD=0``."""
    out = {}
    for setting in _SETTINGS.values():
        value = setting.choice(integration)
        value = setting.value if value is None else value
        if value is not None:
            out[setting.env] = "1" if value else "0"
    for env, (owner, choice) in CHOICES.items():
        if owner != integration:
            continue
        value = choice()
        if value is not None:
            out[env] = value if isinstance(value, str) else "1" if value else "0"
    return out


def reset_settings(integration: str) -> None:
    """``integration``'s choices and defaults forgotten (its ``unpatch()``); another integration's stay."""
    for setting in _SETTINGS.values():
        setting.chosen.pop(integration, None)
        setting.patched_defaults.pop(integration, None)


DOCK_ROUTER = None
"""verl's dock mode while patched (``integrations.verl._dock.VerlDock``): the helpers leave a ferry it
holds to it, a load making the set resident, an offload doing nothing ([Note: verl under a Dock])."""


def _docked(ferry: Ferry | None) -> bool:
    router = DOCK_ROUTER
    return ferry is not None and router is not None and router.holds(ferry)


def ferry_for(obj: nn.Module | torch.optim.Optimizer) -> Ferry | None:
    """The ferry the helpers keep for ``obj``.

    Args:
        obj: a model or optimizer passed to one of the helpers.

    Returns:
        Its :class:`~torchferry.Ferry`, or ``None`` if it was never offloaded
        through these helpers.
    """
    return _ferries.get(obj)


def _get_or_make(obj: nn.Module | torch.optim.Optimizer, integration: str | None = None) -> Ferry:
    """``obj``'s ferry, made if it has none; recorded as moved by ``integration`` (default: the
    integration whose replacement is running, if any)."""
    ferry = _ferries.get(obj)
    if ferry is None:
        # See [Note: the helpers skip unchanged storages].
        ferry = Ferry(obj, skip_unchanged=skip_unchanged()) if isinstance(obj, nn.Module) else Ferry(obj)
        _ferries[obj] = ferry
    who = integration if integration is not None else ACTIVE.get()
    if who is not None:
        _moved_by[obj] = who
    return ferry


def _describe(obj: object, ferry: Ferry) -> str:
    kind = "model" if isinstance(obj, nn.Module) else "optimizer"
    return f"{kind} {type(obj).__name__} ({ferry.state_bytes} bytes)"


def held_by(integration: str, names: Mapping[Ferry, str] | None = None) -> list[Held]:
    """The ferries ``integration``'s replacements moved state through, described for messages (a
    ferry in ``names`` under that name too: a verl dock's set)."""
    names = names or {}
    out = []
    for obj, who in list(_moved_by.items()):
        ferry = _ferries.get(obj)
        if who != integration or ferry is None:
            continue
        what = _describe(obj, ferry)
        out.append(Held(f"{names[ferry]} ({what})" if ferry in names else what, ferry))
    return out


def bring_back_held(integration: str, names: Mapping[Ferry, str] | None = None) -> None:
    """``integration``'s ``unpatch()``, first: every ferry its replacements made brought back to the
    device, synchronously, all or nothing ([Note: unpatch() brings the state back] in
    ``integrations._bring_back``).

    Raises:
        RuntimeError: a reload failed; every ferry is where it was (see ``_bring_back.bring_back``).
    """
    bring_back(integration, held_by(integration, names))


def drop_ferries(integration: str, keep: Collection[Ferry] = ()) -> None:
    """``integration``'s ``unpatch()``, last: the ferries its replacements made closed (their pools
    returned) and forgotten, but those in ``keep`` (a verl dock's sets, which the dock keeps).

    Raises:
        RuntimeError: one of them is offloaded (``bring_back_held`` first).
    """
    for obj, who in list(_moved_by.items()):
        if who != integration:
            continue
        ferry = _ferries.get(obj)
        if ferry is not None and ferry in keep:
            continue  # still this integration's: a later unpatch() brings it back
        if ferry is not None:
            ferry.close()
            del _ferries[obj]
        del _moved_by[obj]


def _finish_offload(ferry: Ferry, handle: TransferHandle, empty_cache: bool) -> None:
    # See [Note: the verl helpers order the caller's stream].
    if handle.event is not None:
        handle.wait_stream(torch.cuda.current_stream(ferry.device))
    if empty_cache:
        handle.wait()  # the handle offload() returned (also for a no-op offload: the last one)
        if ferry.device.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def offload_fsdp2_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Offloads ``model``'s parameters, buffers and gradients to pinned host memory.

    The current stream waits for the D2H copies (no host sync), so a later
    synchronisation of it orders them, as after the seed's same-stream copy;
    kernels queued on it afterwards start once the copies are done ([Note: the
    verl helpers order the caller's stream]).

    Args:
        model: an FSDP2 (``fully_shard``-ed) or plain module on one GPU.
        empty_cache: wait for the D2H copies, then ``torch.cuda.empty_cache()``
            to return the released memory to the driver (the seed does the
            same, and its ``empty_cache`` synchronises too).

    Raises:
        RuntimeError: host memory could not be allocated or pinned (the model
            stays on the GPU, unchanged).
    """
    if _docked(_ferries.get(model)):
        return  # the dock evicts it when the room is needed
    ferry = _get_or_make(model)
    with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
        handle = ferry.offload()
    _finish_offload(ferry, handle, empty_cache)


@torch.no_grad()
def load_fsdp2_model_to_gpu(model: nn.Module) -> None:
    """Reloads what :func:`offload_fsdp2_model_to_cpu` offloaded.

    With ``layerwise_reload`` on, the FSDP2 units come back in forward order, each forward
    waiting only for its own ([Note: the helpers' layer-wise reload]). Otherwise:
    the H2D copies are asynchronous; the current stream waits for them, so the
    next forward on that stream is ordered after them (as with the seed's
    same-stream ``model.to(device, non_blocking=True)``). A no-op for a model
    that was never offloaded through these helpers.
    """
    ferry = _ferries.get(model)
    if ferry is None:
        return
    if _docked(ferry):
        DOCK_ROUTER.load_docked(ferry)  # type: ignore[union-attr]
        return
    if LAYERWISE.get():  # see [Note: the helpers' layer-wise reload]
        ferry.reload(prefetch=True)  # beside the forward: with switch points
        return
    with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
        ferry.reload()


def _has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer, or one it wraps (``ZeroRedundancyOptimizer.optim``), holds state."""
    return any(o.state for _, o in inner_optimizers(optimizer))


@torch.no_grad()
def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Offloads every device tensor in ``optimizer.state`` to pinned host memory.

    Returns with the D2H copies in flight (as the seed's ``non_blocking`` copies),
    the current stream waiting for them (no host sync): a later ``.item()``,
    blocking ``.cpu()``, ``torch.cuda.current_stream().synchronize()`` or
    ``torch.cuda.synchronize()`` orders them, as after the seed's same-stream
    copy, and ``optimizer.state_dict()`` waits for them by itself. Kernels
    queued on the current stream afterwards start once the copies are done
    ([Note: the verl helpers order the caller's stream]). A no-op for an
    optimizer without state (before its first step), as in the seed.
    """
    if not _has_state(optimizer) or _docked(_ferries.get(optimizer)):
        return
    ferry = _get_or_make(optimizer)
    with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
        handle = ferry.offload()
    _finish_offload(ferry, handle, empty_cache=False)


@torch.no_grad()
def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device_id: int | str | torch.device) -> None:
    """Reloads what :func:`offload_fsdp_optimizer` offloaded.

    The current stream waits for the copies, or, with ``optimizer_at_step`` on, only
    ``optimizer.step()`` does ([Note: optimizer state waited for at step()]).

    Args:
        optimizer: the optimizer.
        device_id: the device to load onto; must be the device the state came
            from (torchferry restores the original storages).

    Raises:
        ValueError: ``device_id`` is not the device the state was offloaded from.
    """
    if not _has_state(optimizer):
        return
    ferry = _ferries.get(optimizer)
    if ferry is None:
        return
    device = torch.device(device_id) if not isinstance(device_id, int) else torch.device("cuda", device_id)
    if device.type == ferry.device.type and device.index is None:
        device = ferry.device
    if device != ferry.device:
        raise ValueError(
            f"torchferry: load_fsdp_optimizer(device_id={device_id!r}) but the state "
            f"was offloaded from {ferry.device}; it reloads where it came from"
        )
    if _docked(ferry):
        DOCK_ROUTER.load_docked(ferry)  # type: ignore[union-attr]
        return
    if optimizer_at_step():
        ferry.reload(prefetch=True)  # beside the caller's compute: with switch points
        return
    with whole_copies():  # the caller's stream waits: [Note: whole copies where the caller waits]
        ferry.reload()
