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
from collections.abc import Collection, Mapping

import torch
from torch import nn

from .._core._ferry.ferry import Ferry
from .._core._api.handle import TransferHandle
from .._core._state.targets import inner_optimizers
from .._core._transfer.switch import whole_copies
from ._bring_back import Held, bring_back
from ._patching import ACTIVE
from ._settings import (  # noqa: F401  # the helpers' switches, re-exported
    _SETTINGS, CHOICES, LAYERWISE, LAYERWISE_ENV, OPTIMIZER_AT_STEP_ENV, SKIP_ENV, _at_step, _skip, apply_settings,
    check_settings, optimizer_at_step, patch_choices, reset_settings, set_optimizer_at_step, set_patched_defaults,
    set_skip_unchanged, settings_of, skip_unchanged,
)

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
