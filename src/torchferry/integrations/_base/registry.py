"""The one registry of the integrations: every ferry their helpers made, and each integration's patch state
([Note: unpatch() brings the state back] in ``docs/integrations.md``)."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

from torch import nn
from torch.optim import Optimizer

from ..._core._api.residency import Residency
from ..._public.ferry import Ferry
from ..._core._transfer.switch import whole_copies

__all__ = ["REGISTRY", "Held", "Registry", "away"]


class Held(NamedTuple):
    """One ferry an integration's replacements made, and what it is for messages (``"model Mixed (1200 bytes)"``)."""

    what: str
    ferry: Ferry


def away(ferry: Ferry) -> bool:
    """Whether some of ``ferry``'s state is in its pool: offloaded (in flight or done), or a layer-wise
    reload under way."""
    return ferry.residency in (Residency.D2H_IN_FLIGHT, Residency.HOST, Residency.PREFETCHING)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class Entry:
    """One key's ferry, the integration whose replacements last moved it (``None``: a helper called directly),
    what the ferry was made for, weakly (an engine's model and optimizer); ``held``: those, while offloaded."""

    __slots__ = ("ferry", "who", "_targets", "held")

    def __init__(self, ferry: Ferry, who: str | None, targets: Iterable[object | None] = ()) -> None:
        self.ferry, self.who = ferry, who
        self._targets = tuple(None if t is None else weakref.ref(t) for t in targets)
        self.held: tuple[object, ...] = ()

    def serves(self, *targets: object | None) -> bool:
        """Whether the ferry was made for exactly ``targets``."""
        mine = tuple(None if r is None else r() for r in self._targets)
        return len(mine) == len(targets) and all(a is b for a, b in zip(mine, targets, strict=True))


class Registry:
    """Every ferry the integrations made (weakly keyed: it goes with its model, optimizer or engine), each
    patched integration's state, and what a dock mode keeps across ``unpatch()`` (verl's docks, by budget)."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[object, Entry] = weakref.WeakKeyDictionary()
        self.patched: dict[str, Any] = {}  # integration -> its PatchState, between patch() and unpatch()
        self.kept: dict[tuple[str, str, object], Any] = {}  # (integration, kind, key) -> a router kept

    def entry(self, key: object) -> Entry | None:
        return self._entries.get(key)

    def ferry(self, key: object) -> Ferry | None:
        """``key``'s ferry (``None``: none was made)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.ferry

    def put(self, key: object, ferry: Ferry, who: str | None, targets: Iterable[object | None] = ()) -> None:
        self._entries[key] = Entry(ferry, who, targets)

    def moved_by(self, key: object, who: str | None) -> None:
        """Records that ``who``'s replacements moved ``key``'s ferry (a helper called directly records nothing)."""
        entry = self._entries.get(key)
        if entry is not None and who is not None:
            entry.who = who

    def of(self, who: str) -> list[tuple[object, Entry]]:
        """The keys and entries ``who``'s replacements moved."""
        return [(k, e) for k, e in list(self._entries.items()) if e.who == who]

    def forget(self, key: object) -> None:
        self._entries.pop(key, None)

    def kept_sets(self, who: str) -> dict[Ferry, str]:
        """The sets of every dock ``who`` kept (the one in use too), ferry -> name for messages; moves waited for."""
        out: dict[Ferry, str] = {}
        for router in [r for key, r in list(self.kept.items()) if key[0] == who]:
            if router.dock is not None:
                router.dock.wait()
            out.update({ferry: f"{router.label} set {name}" for name, ferry in router.sets.items()})
        return out

    def bring_back(self, who: str, names: Mapping[Ferry, str] | None = None) -> list[Held]:
        """Reloads every ferry of ``who`` that is :func:`away`, synchronously, all or nothing ([Note: unpatch()
        brings the state back]), and returns them in order; a ferry in ``names`` (a verl dock's set) is named so.

        Raises:
            RuntimeError: a reload failed (the message names it, the cause and everything that stays
                offloaded); the ferries brought back before it were offloaded again.
        """
        names = names or {}
        todo: list[Held] = []
        for key, entry in [(k, e) for k, e in self.of(who) if away(e.ferry)]:
            kind = "model" if isinstance(key, nn.Module) else "optimizer" if isinstance(key, Optimizer) else "engine"
            what = (f"{type(key).__name__} engine" if kind == "engine" else f"{kind} {type(key).__name__}")
            what = f"{what} ({entry.ferry.state_bytes} bytes)"
            todo.append(Held(f"{names[entry.ferry]} ({what})" if entry.ferry in names else what, entry.ferry))
        done: list[Held] = []
        for h in todo:
            try:
                with whole_copies():  # waited for at once: [Note: whole copies where the caller waits]
                    h.ferry.reload().wait()
            except BaseException as err:
                undo = _offload_again(done)
                if not isinstance(err, Exception):  # Ctrl-C: as it is, after the undo
                    raise
                left = [x.what for x in todo if away(x.ferry)]
                raise RuntimeError(
                    f"torchferry.integrations.{who}: unpatch() could not bring {h.what} back to "
                    f"{h.ferry.device} ({_first_line(err)}); nothing was unpatched: {', '.join(left)} stay offloaded "
                    f"in torchferry's pool, which the framework's own helpers cannot reload; free device memory and "
                    f"call unpatch() again{undo}"
                ) from err
            done.append(h)
        return done

    def drop(self, who: str, keep: Collection[Ferry] = ()) -> None:
        """``who``'s ferries closed (their pools returned) and forgotten, but those in ``keep`` (:meth:`kept_sets`).

        Raises:
            RuntimeError: one of them is offloaded (:meth:`bring_back` first).
        """
        for key, entry in self.of(who):
            if entry.ferry not in keep:
                entry.ferry.close()
                self._entries.pop(key, None)


def _offload_again(done: list[Held]) -> str:
    """Offloads ``done`` again (the undo of a failed bring-back); ``""``, or what could not be undone."""
    failed = []
    for h in reversed(done):
        try:
            with whole_copies():
                h.ferry.offload().wait()
        except Exception as err:  # noqa: BLE001  (the state is resident and intact: say so, go on)
            failed.append(f"{h.what} ({_first_line(err)})")
    if not failed:
        return ""
    return f" (offloading again what it had brought back failed for {', '.join(failed)}: they are on the device)"


REGISTRY = Registry()
"""The one registry: the only mutable object at module level in ``integrations``."""
