"""An integration's settings, read once by its ``patch()`` ([Note: each integration's settings] in
``docs/integrations.md``), the one module of ``integrations`` reading ``TORCHFERRY_*`` variables (via ``env``)."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..._core._api.args import check_optional_bool
from ..._core._api.settings import CoreSettings
from ..._public.env import OFF, core_settings, env_flag, is_bytes, parse_bytes, positional

__all__ = [
    "DOCK_ENV", "FORWARDED_SETTINGS", "FSDP1_ENV", "LAYERWISE_ENV", "OPTIMIZER_AT_STEP_ENV", "SKIP_ENV", "SWITCHES",
    "Settings", "check_environment", "dock_budget", "forwarded_env", "hook_env", "parse_budget", "read_switch",
]

SKIP_ENV = "TORCHFERRY_SKIP_UNCHANGED"
OPTIMIZER_AT_STEP_ENV = "TORCHFERRY_OPTIMIZER_AT_STEP"
LAYERWISE_ENV = "TORCHFERRY_LAYERWISE_RELOAD"
FSDP1_ENV = "TORCHFERRY_VERL_FSDP1"
DOCK_ENV = "TORCHFERRY_VERL_DOCK"
SWITCHES: Mapping[str, tuple[str, bool]] = MappingProxyType({  # switch -> (its variable, torchferry's default)
    "skip_unchanged": (SKIP_ENV, True), "optimizer_at_step": (OPTIMIZER_AT_STEP_ENV, False),
    "layerwise_reload": (LAYERWISE_ENV, False), "fsdp1": (FSDP1_ENV, True),
})
_WHAT = MappingProxyType({"fsdp1": "patch(fsdp1=...)"})  # an argument as a TypeError names it, if not by name

# The driver's settings a worker should see too (how state moves), not node-local ones, tests' or the bench's.
FORWARDED_SETTINGS = (SKIP_ENV, "TORCHFERRY_DRIVER_COPIES", "TORCHFERRY_SWITCH_BYTES", "TORCHFERRY_ISSUE_REFILL_BYTES",
                      "TORCHFERRY_HASH", "TORCHFERRY_RELOAD_ARENA", FSDP1_ENV, OPTIMIZER_AT_STEP_ENV, LAYERWISE_ENV,
                      DOCK_ENV)


def read_switch(name: str, default: bool | None = None) -> bool:
    """A switch as its environment variable says (on or off), else ``default`` (else torchferry's).

    Raises:
        ValueError: the variable is neither on nor off ([Note: one parser for the environment]).
    """
    env, ours = SWITCHES[name]
    return env_flag(env, ours if default is None else default)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one integration's replacements do, fixed by its ``patch()`` ([Note: each integration's settings])."""

    skip_unchanged: bool = True
    optimizer_at_step: bool = False
    layerwise_reload: bool = False
    fsdp1: bool = True
    dock: int | float | None = None  # verl's dock budget: bytes, a fraction of the device, or None (no dock)
    chosen: tuple[tuple[str, str], ...] = ()  # the patch() arguments so far, as the Ray hook passes them on
    core: CoreSettings = field(default_factory=CoreSettings)  # the integration's ferries' (Ferry(settings=...))

    def choice(self, name: str) -> bool | None:
        """What a ``patch()`` argument said of switch ``name`` (``None``: no argument did)."""
        value = dict(self.chosen).get(SWITCHES[name][0])
        return None if value is None else value == "1"

    @classmethod
    def read(cls, args: Mapping[str, bool | None], *, defaults: Mapping[str, bool] | None = None,
             earlier: Settings | None = None, with_dock: bool = False, dock: object = None) -> Settings:
        """One ``patch()``'s settings: each switch of ``args`` (``None``: not given) from its argument, else
        ``earlier``'s (a ``patch()`` in force), else the environment, else ``defaults`` (the integration's), else
        torchferry's; ``with_dock``: ``dock``'s budget, else ``earlier``'s, else the environment's; :attr:`core`: the
        environment's.

        Raises:
            TypeError: an argument is neither ``None`` nor a bool.
            ValueError: a variable it reads is neither on nor off, a malformed dock budget, or a core setting.
        """
        chosen = dict(earlier.chosen) if earlier is not None else {}
        values: dict[str, bool] = {}
        for name, value in args.items():
            check_optional_bool(value, _WHAT.get(name, name))
            env, _ = SWITCHES[name]
            if value is not None:
                chosen[env] = "1" if value else "0"
            values[name] = chosen[env] == "1" if env in chosen else read_switch(name, (defaults or {}).get(name))
        kept = with_dock and dock is None and earlier is not None and DOCK_ENV in chosen  # a patch(dock=...) in force
        budget = (earlier.dock if kept and earlier is not None else dock_budget(dock)) if with_dock else None
        if with_dock and dock is not None:  # the workers' form of it: a fraction in ASCII digits, not 1e-05
            chosen[DOCK_ENV] = "0" if budget is None else positional(budget)
        return cls(**values, dock=budget, chosen=tuple(sorted(chosen.items())), core=core_settings())


_FRACTION = re.compile(r"[0-9]*\.[0-9]+|[0-9]+\.")  # a str read as a fraction: ASCII digits and a point
MIN_BUDGET_BYTES = 1 << 20  # below this a byte count is a slip (TORCHFERRY_VERL_DOCK=1 read as "on"), not a budget


def parse_budget(value: object, where: str) -> int | float | None:
    """A dock budget: bytes (an integer >= :data:`MIN_BUDGET_BYTES`, or a whole float such as ``40e9``), a
    fraction of the device's memory (a float in (0, 1]), or ``None`` / ``0`` / ``""`` / an off spelling (no
    dock). A str is a byte count as every other (``_public/env.parse_bytes``) or a fraction in ASCII digits with a
    point (``0.6``); numpy numbers count as ints and floats.

    Raises:
        ValueError: anything else, naming ``where`` (a bool, a negative or non-finite number, a non-whole
            float above 1, fewer than :data:`MIN_BUDGET_BYTES` bytes).
    """
    hint = "give bytes (e.g. 40000000000 or 40e9) or a fraction of the device's memory (a float in (0, 1], e.g. 0.6)"
    if value is None:
        return None
    raw = value
    if isinstance(value, str):
        text = value.strip()
        if text == "" or text.lower() in OFF:  # the off spellings of every switch (_public/env.OFF)
            return None
        # a fraction, else a byte count as every other ([Note: one parser for byte counts]), else no budget
        value = float(text) if _FRACTION.fullmatch(text) else parse_bytes(text, where) if is_bytes(text) else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget: {hint}")
    if value == 0:
        return None
    if isinstance(value, numbers.Integral):
        n = int(value)
        if MIN_BUDGET_BYTES <= n < 10**30:  # at most 30 digits, as every byte count (_public/env)
            return n
        why = "1 is one byte, not 'on': 1.0 is the whole device" if n == 1 else f"{n} bytes is no GPU budget"
        raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget ({why}): {hint}")
    x = float(value)
    if math.isfinite(x) and 0.0 < x <= 1.0:
        return x
    if math.isfinite(x) and x >= MIN_BUDGET_BYTES and x.is_integer():
        return int(x)
    raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget: {hint}")


def dock_budget(choice: object) -> int | float | None:
    """``patch(dock=...)``'s choice, else ``TORCHFERRY_VERL_DOCK`` (``None``: no dock).

    Raises:
        ValueError: a malformed budget (see :func:`parse_budget`).
    """
    given = choice is not None
    return parse_budget(choice if given else os.environ.get(DOCK_ENV), "patch(dock=...)" if given else DOCK_ENV)


def check_environment(switches: Iterable[str] = tuple(SWITCHES), *, with_dock: bool = False) -> None:
    """Reads the variables of ``switches`` (default all) and, ``with_dock``, ``TORCHFERRY_VERL_DOCK``, as ``patch()``
    would: a Ray worker's hook or a launcher refuses a bad value before patching, not at the framework's import.

    Raises:
        ValueError: a variable is neither on nor off, or a malformed dock budget.
    """
    for name in switches:
        read_switch(name)
    if with_dock:
        dock_budget(None)


def forwarded_env() -> dict[str, str]:
    """The driver's :data:`FORWARDED_SETTINGS` that are set, for a Ray job's ``env_vars``."""
    return {k: os.environ[k] for k in FORWARDED_SETTINGS if k in os.environ}


def hook_env(flag: str, next_env: str) -> tuple[bool, str | None]:
    """A Ray hook's switch (``TORCHFERRY_VERL``: on unless off) and the user's own hook it runs after
    torchferry's (``module.function`` in ``next_env``), if any.

    Raises:
        ValueError: the switch is neither on nor off, or the hook is not ``module.function`` (spaces aside).
    """
    on, nxt = env_flag(flag, True), os.environ.get(next_env, "").strip()
    module, _, name = nxt.rpartition(".")
    if nxt and not (module and name.isidentifier()):
        raise ValueError(f"torchferry: {next_env} must name a function as module.function, "
                         f"got {os.environ.get(next_env)!r}")
    return on, nxt or None
