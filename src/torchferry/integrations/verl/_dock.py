"""verl's trainer under a :class:`~torchferry.Dock` (``patch(dock=budget)``), an adapter over the core's phase dock:
[Note: verl under a Dock] and [Note: verl's offload flags under a Dock] in ``docs/integrations.md``."""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any

import torch

from torchferry import Ferry

from .._base import REGISTRY, PhaseDock, SeedHelpers, has_state, helpers_of, local_of

__all__ = ["VerlDock", "dock_rollout", "docked", "docks"]

_TAGS = MappingProxyType({"weights": "rollout.weights", "kv_cache": "rollout.kv_cache"})


def dock_rollout(rollout: Any, weights_bytes: int, kv_cache_bytes: int) -> Any:
    """Makes a rollout's memory claimants of the process's verl dock ([Note: verl under a Dock]): ``resume(tags)``
    first makes room for ``rollout.weights`` / ``rollout.kv_cache``, ``release()`` marks both asleep. Applied by
    ``patch(dock=...)``; called again, it takes the new byte counts; a no-op without a dock. Returns ``rollout``,
    its ``resume`` / ``release`` wrapped on the instance.

    Args:
        rollout: an object with ``async resume(tags)`` (``tags``: a list of ``"weights"`` /
            ``"kv_cache"``) and ``async release()`` (verl's ``BaseRollout``).
        weights_bytes: bytes its weights take on this device (>= 0).
        kv_cache_bytes: bytes its KV cache takes (>= 0).

    Raises:
        ValueError: a byte count that is not an int >= 0.
        TypeError: ``rollout`` lacks ``resume`` or ``release``, or they are not ``async``; later, a
            ``resume(tags)`` whose ``tags`` is a str, not a list.
    """
    for what, n in (("weights_bytes", weights_bytes), ("kv_cache_bytes", kv_cache_bytes)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"torchferry: dock_rollout: {what} must be an int >= 0 (bytes), got {n!r}")
    if not callable(getattr(rollout, "resume", None)) or not callable(getattr(rollout, "release", None)):
        raise TypeError(f"torchferry: dock_rollout: {type(rollout).__name__} has no resume(tags) / release()")
    sizes = getattr(rollout, "_torchferry_dock_bytes", None)
    if sizes is not None:  # wrapped already: the new counts
        sizes.update(weights=weights_bytes, kv_cache=kv_cache_bytes)
        return rollout
    resume, release = rollout.resume, rollout.release
    if not (inspect.iscoroutinefunction(resume) and inspect.iscoroutinefunction(release)):
        raise TypeError(f"torchferry: dock_rollout: {type(rollout).__name__}.resume / release must be async "
                        "(verl's BaseRollout's are)")
    sizes = {"weights": weights_bytes, "kv_cache": kv_cache_bytes}

    async def resume_docked(tags, *args, **kwargs):
        if isinstance(tags, str):
            raise TypeError(f"torchferry: resume(tags={tags!r}): tags is a list of str, e.g. [{tags!r}]")
        mode = docked()
        if mode is not None:
            mode.rollout_wakes([t for t in tags if t in _TAGS], dict(sizes))
        return await resume(tags, *args, **kwargs)

    async def release_docked(*args, **kwargs):
        out = await release(*args, **kwargs)
        mode = docked()
        if mode is not None:  # its memory is free once release() returns
            mode.rollout_asleep()
        return out

    rollout.resume, rollout.release = resume_docked, release_docked
    rollout._torchferry_dock_bytes = sizes
    return rollout


def kept_on_device(engine: Any) -> tuple[list[object], str]:
    """What verl keeps on the device of ``engine`` and the flags why, for messages ([Note: verl's offload flags
    under a Dock]; an object without the flags offloads both)."""
    kept: list[object] = []
    why = []
    if not getattr(engine, "is_param_offload_enabled", True):
        kept.append(engine.module)
        why.append("param_offload=False: its parameters")
    if not getattr(engine, "is_optimizer_offload_enabled", True):
        why.append("optimizer_offload=False: its optimizer state")
        if engine.optimizer is not None:
            kept.append(engine.optimizer)
    return kept, "; ".join(why) or "nothing"


class VerlDock(PhaseDock):
    """The process's dock over verl's engine contexts and rollout, in the phase dock's terms."""

    def __init__(self, budget: int | float) -> None:
        super().__init__(budget, label="verl dock", hint="TORCHFERRY_VERL_DOCK / patch(dock=...)")

    def _set(self, obj: Any, helpers: SeedHelpers | None) -> Ferry:
        """``obj``'s ferry (made by verl's helpers); a dock of another budget (an earlier ``patch()``) lets it go."""
        ferry = (helpers or helpers_of("verl")).make(obj)
        for other in docks():
            if other is not self and other.holds(ferry):
                other.forget(ferry)
        return ferry

    def enter(self, engine: Any, mode: str, model: bool, optimizer: bool,  # type: ignore[override]
              helpers: SeedHelpers | None = None) -> None:
        """A train/eval context's entry ([Note: verl's offload flags under a Dock])."""
        opt = engine.optimizer
        kept, why = kept_on_device(engine)
        super().enter(engine, mode, device=_device_of(engine), kept=kept, kept_why=why,
                      params=self._set(engine.module, helpers) if model else None,
                      optimizer=self._set(opt, helpers) if optimizer and opt is not None and has_state(opt) else None,
                      first_step=opt if mode == "train" and opt is not None and not has_state(opt) else None)

    def leave(self, engine: Any, mode: str, helpers: SeedHelpers | None = None) -> None:  # type: ignore[override]
        """A train/eval context's exit: the optimizer state its first step made becomes a set."""
        opt = engine.optimizer
        if engine not in self.engines or mode not in self.engines[engine].open:
            return
        moved = opt is not None and has_state(opt) and getattr(engine, "is_optimizer_offload_enabled", True)
        super().leave(engine, mode, optimizer=self._set(opt, helpers) if moved else None,
                      kept=kept_on_device(engine)[0])

    def rollout_wakes(self, tags: list[str], nbytes: dict[str, int]) -> None:
        """``rollout.resume(tags)``: room made for each tag's claimant."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.wake({_TAGS[t]: nbytes[t] for t in tags}, device, "the rollout's")

    rollout_asleep = PhaseDock.asleep  # rollout.release(): the rollout's claimants asleep


def _device_of(engine: Any) -> torch.device:
    ferry = REGISTRY.ferry(engine.module)
    if ferry is not None:
        return ferry.device
    for p in engine.module.parameters():
        local = local_of(p)
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def docks() -> list[VerlDock]:
    """Every verl dock made in this process and kept, one per budget (``unpatch()`` keeps them)."""
    return [vd for key, vd in list(REGISTRY.kept.items()) if key[0] == "verl"]


def docked() -> VerlDock | None:
    """The process's verl dock while ``patch(dock=...)`` holds, else ``None``: its :class:`~torchferry.Dock`
    (``.dock``), the phases it saw (``.phase_log``) and :meth:`VerlDock.take_peak`."""
    state = REGISTRY.patched.get("verl")
    return None if state is None else state.router
