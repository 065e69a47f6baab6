"""One verl engine in the dock: its names, what verl offloads of it (state sets) and what verl keeps on the
device (reserved bytes), and the first training step's check ([Note: verl's offload flags under a Dock]).

[Note: verl's offload flags under a Dock]
verl's ``BaseEngineCtx`` moves an engine's parameters only with ``param_offload`` and its optimizer
state only with ``optimizer_offload`` (``verl/workers/engine/base.py``, ``_context_switch``); what
it does not move stays on the device for the whole run. So under a dock only what verl offloads
is a state set (``engine<N>.params``, ``engine<N>.optimizer``) that the dock may evict, and what
verl keeps resident is reserved (``Dock.reserve``) as ``engine<N>.resident``: counted against the
budget at every decision, never evicted, measured again at each phase entry and exit and at each
rollout wake (the optimizer's first step, a checkpoint load or gradients kept make it grow). Before,
with ``param_offload=True, optimizer_offload=False`` the optimizer became a set after its first step
and was evicted, and the second update raised "AdamW.step() while its state is offloaded"; with
``param_offload=False`` the resident parameters were not counted (8.41 MB held against a 6.37 MB
budget). An engine with neither flag is in the dock too (its state reserved, its
phases' workspaces counted); one whose resident state alone exceeds the budget is refused at its
first phase, naming the flags.
"""

from __future__ import annotations

from typing import Any

import torch

from torchferry import Dock

from .._base import first_step_bytes, objects_bytes

__all__ = ["EngineNames", "check_first_step", "kept_on_device"]


class EngineNames:
    """One FSDP engine's names in the dock."""

    def __init__(self, index: int) -> None:
        self.tag = tag = f"engine{index}"
        self.params, self.optimizer = f"{tag}.params", f"{tag}.optimizer"
        self.resident = f"{tag}.resident"  # what verl keeps on the device: [Note: verl's offload flags under a Dock]
        self.workspace = {"eval": f"{tag}.workspace.eval", "train": f"{tag}.workspace.train"}
        self.measured: dict[str, int] = {}  # mode -> largest workspace seen, bytes
        self.open: dict[str, Any] = {}  # while in a phase: the names held, the start
        self.depth: dict[str, int] = {}  # mode -> contexts of it entered inside the open one

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the engine may hold in the dock."""
        return (self.params, self.optimizer, self.resident, *self.workspace.values())


def offloads(engine: Any) -> tuple[bool, bool]:
    """verl's ``(param_offload, optimizer_offload)`` of ``engine`` now (both on for an object without them)."""
    return (bool(getattr(engine, "is_param_offload_enabled", True)),
            bool(getattr(engine, "is_optimizer_offload_enabled", True)))


def kept_on_device(engine: Any) -> list[object]:
    """What verl keeps on the device of ``engine``: its module without ``param_offload``, its optimizer
    without ``optimizer_offload`` ([Note: verl's offload flags under a Dock])."""
    params, optimizer = offloads(engine)
    out: list[object] = [] if params else [engine.module]
    if not optimizer and engine.optimizer is not None:
        out.append(engine.optimizer)
    return out


def resident_bytes(engine: Any, device: torch.device) -> int:
    """Bytes on ``device`` of what verl keeps there of ``engine``."""
    kept = kept_on_device(engine)
    return objects_bytes(kept, device) if kept else 0


def why_kept(engine: Any) -> str:
    """The flags that keep ``engine``'s state on the device, for messages."""
    params, optimizer = offloads(engine)
    parts = ([] if params else ["param_offload=False: its parameters"]) + \
        ([] if optimizer else ["optimizer_offload=False: its optimizer state"])
    return "; ".join(parts) or "nothing"


def check_first_step(dock: Dock, e: EngineNames, optimizer: torch.optim.Optimizer, device: torch.device,
                     held: int) -> None:
    """Refuses a first train phase whose optimizer state ([Note: first-step state] in
    ``torchferry._core._dock.first_step``) would not fit the budget beside ``held`` bytes (the
    phase's sets and every reserved byte): better before verl's step than after it. An optimizer
    whose layout is not known is measured after its step instead.

    Raises:
        ValueError: it would not fit (one line).
    """
    made = first_step_bytes(optimizer, device)
    if made is None or held + made <= dock.budget_bytes:
        return
    raise ValueError(f"{e.optimizer} would hold about {made} bytes after the first step ({type(optimizer).__name__}'s "
                     f"state as its first step makes it) beside {held} bytes held, more than the budget of "
                     f"{dock.budget_bytes} bytes; raise TORCHFERRY_VERL_DOCK / patch(dock=...)")
