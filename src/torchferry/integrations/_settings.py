"""The helpers' switches (``skip_unchanged``, ``optimizer_at_step``, ``layerwise_reload``), per
integration: what each integration's ``patch()`` chose, its own defaults, a value set for every
caller, and the environment ([Note: each integration's settings])."""

from __future__ import annotations

from collections.abc import Callable

from .._core._api.args import check_optional_bool
from .._core._api.env import env_flag
from ._patching import ACTIVE

__all__ = [
    "CHOICES", "LAYERWISE", "LAYERWISE_ENV", "OPTIMIZER_AT_STEP_ENV", "SKIP_ENV", "apply_settings", "check_settings",
    "optimizer_at_step", "patch_choices", "reset_settings", "set_optimizer_at_step", "set_patched_defaults",
    "set_skip_unchanged", "settings_of", "skip_unchanged",
]


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
