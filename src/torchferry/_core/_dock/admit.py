"""What a state set must be to join a :class:`~torchferry.Dock` (``Dock.add``'s checks, each a one-line error;
nothing changes in any dock when one fails)."""

from __future__ import annotations

from .._ferry.ferry import Ferry
from .engine import DockEngine
from .measure import counted_bytes, is_closed, targets_of, tensors_of
from .records import OverBudget, _fmt

__all__ = ["check_new_set"]


def check_new_set(e: DockEngine, name: str, ferry: Ferry) -> None:
    """Refuses a ferry already in this dock or another live one, on another device, closed, sharing a tensor
    object with a set of this dock (one tensor in two sets: each would move it behind the other's back; views of one
    storage in two sets are allowed, the storage is kept: [Note: kept storages count once]), or larger
    than the budget beside what is reserved (it could never be resident).

    Raises:
        ValueError, RuntimeError: as ``Dock.add`` documents.
    """
    for s in e.sets.values():
        if s.ferry is ferry:
            raise ValueError(f"torchferry: Dock.add: this ferry is already added as {s.name!r}")
    other = DockEngine.holder(ferry)
    if other is not None:
        held_as = next(s.name for s in other.sets.values() if s.ferry is ferry)
        raise RuntimeError(
            f"torchferry: Dock.add: cannot add {name!r}: its ferry is held by another dock ({other.label()}) "
            f"as {held_as!r}; a ferry belongs to one dock: remove it there first "
            f"(dock.remove({held_as!r}) or dock.close())"
        )
    dev = e.device
    if dev is not None and (ferry.device.type != dev.type
                            or (dev.index is not None and ferry.device.index != dev.index)):
        raise ValueError(f"torchferry: Dock.add: {name!r} is on {ferry.device} but the dock on {dev}")
    if is_closed(ferry):
        raise RuntimeError(f"torchferry: Dock.add: the ferry given for {name!r} is closed; make a new Ferry")
    mine = [*targets_of(ferry), *tensors_of(ferry)]  # held while compared: the ids stay unique
    ids = {id(t) for t in mine}  # a target too: an optimizer before its first step holds no tensor yet
    for s in e.sets.values():
        if any(id(t) in ids for t in (*targets_of(s.ferry), *tensors_of(s.ferry))):
            raise ValueError(f"torchferry: Dock.add: {name!r} shares tensors with the set {s.name!r} (a ferry "
                             "over a module and another over its submodule?): a tensor belongs to one set; nothing "
                             "was added")
    nbytes, fixed = counted_bytes(ferry), e.reserved()
    if nbytes + fixed > e.budget:
        beside = f" beside {_fmt(fixed)} reserved (Dock.reserve)" if fixed else ""
        raise OverBudget(
            f"torchferry: Dock.add: state set {name!r} is {_fmt(nbytes)}{beside} but the budget is "
            f"{_fmt(e.budget)}; it could never be resident: raise budget_bytes or split the set "
            "(e.g. parameters and optimizer state as two ferries)"
        )
