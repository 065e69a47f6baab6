"""Every ``TORCHFERRY_*`` environment variable is read through here, so each is parsed alike: the core's
settings are read here only (:func:`core_settings`, into the values ``CoreSettings`` (``_core/_api/settings.py``)
holds; no module of ``_core`` reads the environment), an integration's with the parsers below
(``integrations/_base/settings.py``); ``tests/cpu/test_layers.py`` checks both.

[Note: one parser for the environment]
A switch was read three ways: ``"1"``/``"0"`` only (a ``ValueError`` for ``"true"``), anything
but ``"0"`` as on (``TORCHFERRY_VERL=false`` installed the Ray hook's patch), anything but
``""``/``"0"`` as on (``TORCHFERRY_VERIFY_SKIPS=false`` turned verify mode on). Now a switch
(:func:`env_flag`) takes ``1, true, yes, on`` and ``0, false, no, off`` in any case with the
surrounding spaces ignored, the empty string or no variable means its default, and anything else
is a ``ValueError`` naming the variable and the value. Numbers (:func:`env_int`), byte counts
(:func:`env_bytes`, [Note: one parser for byte counts]) and names (:func:`env_choice`) are refused
the same way, and so is a ledger folder (:func:`ledger_dir`) the node's ranks could not share. Above the
core: imports its settings and the issue window only.
"""

from __future__ import annotations

import decimal
import os
import re
from collections.abc import Sequence
from typing import overload

from .._core._api.settings import HASH_CHOICES, CoreSettings, shared_folder
from .._core._schedules.issuer import ISSUE_WINDOW_BYTES

__all__ = ["ARENA_ENV", "BYTES_FORM", "CORE_ENV", "DRIVER_ENV", "HASH_CHOICES", "HASH_ENV", "HOST_BUDGET_ENV",
           "HOST_RESERVE_ENV", "LEDGER_DIR_ENV", "OFF", "ON", "REFILL_ENV", "SWITCH_ENV", "VERIFY_ENV",
           "allocator_conf", "core_settings", "env_bytes", "env_choice", "env_flag", "env_int", "is_bytes",
           "ledger_dir", "parse_bytes", "parse_flag", "positional"]

ON = ("1", "true", "yes", "on")
"""The spellings of on (lower case; compared after ``strip().lower()``)."""
OFF = ("0", "false", "no", "off")
"""The spellings of off."""


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def parse_flag(raw: str | None, name: str, default: bool) -> bool:
    """``raw`` (the value of the variable ``name``, ``None`` if unset) as a switch.

    Raises:
        ValueError: not one of :data:`ON` / :data:`OFF` (any case, spaces ignored) nor empty:
            ``"torchferry: {name} must be on (1, true, yes, on) or off (0, false, no, off), got {raw!r}"``.
    """
    text = (raw or "").strip().lower()
    if not text:
        return default
    if text in ON:
        return True
    if text in OFF:
        return False
    raise ValueError(f"torchferry: {name} must be on ({', '.join(ON)}) or off ({', '.join(OFF)}), got {raw!r}")


def env_flag(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a switch (:func:`parse_flag`), ``default`` if unset or empty.

    Raises:
        ValueError: as :func:`parse_flag`, naming the variable and the value.
    """
    return parse_flag(os.environ.get(name), name, default)


def env_int(name: str, default: int, *, hi: int | None = None, says: str) -> int:
    """The environment variable ``name`` as an integer in ``[0, hi]`` (no bound above if ``hi`` is
    ``None``) written in ASCII digits only, ``default`` if unset or empty.

    Raises:
        ValueError: not such an integer (a sign, ``_``, a non-ASCII digit included):
            ``"torchferry: {name} must be {says}, got {raw!r}"``.
    """
    raw = _raw(name)
    if not raw:
        return default
    value = int(raw) if _DIGITS.fullmatch(raw) else -1
    if value < 0 or (hi is not None and value > hi):
        raise ValueError(f"torchferry: {name} must be {says}, got {raw!r}")
    return value


# [Note: one parser for byte counts]
# Byte counts were read two ways: ``int()`` then ``float()`` for the host budget and reserve (so
# ``1e6`` passed), ``int()`` alone for the switch and refill sizes (``1e6`` refused), and ``int()``
# takes ``1_000``, ``-0``, ``+5`` and non-ASCII digits (``'\uff10'``, a full-width zero). Now every
# byte count is read by :func:`parse_bytes`: ASCII digits, or a mantissa of ASCII digits (with a
# fraction) and a two-digit exponent whose value is a whole number (``40e9``, ``1.5e9``); nothing
# else (no sign, underscore, space inside, ``inf``/``nan``).
# At most 30 digits (10**30 bytes): longer is no count, and ``int()`` refuses past 4,300 digits in a message
# that names neither torchferry nor the variable.
_DIGITS = re.compile(r"[0-9]{1,30}")
_EXPONENT = re.compile(r"[0-9]{1,30}(?:\.[0-9]{1,30})?[eE][0-9]{1,2}")
BYTES_FORM = ("ASCII digits (at most 30), e.g. 40000000000, or a whole number in exponent form, e.g. 40e9; no sign, "
              "no underscores")


def positional(x: int | float) -> str:
    """``x`` in ASCII digits with no exponent, exactly (``1e-05`` -> ``"0.00001"``): how a number goes to another
    process's environment so that this module reads it back."""
    return str(x) if isinstance(x, int) else format(decimal.Decimal(repr(x)), "f")


def is_bytes(text: str) -> bool:
    """Whether ``text`` has a byte count's form (:func:`parse_bytes` may still refuse a fraction such as
    ``1.55e1``, or a bound)."""
    return bool(_DIGITS.fullmatch(text) or _EXPONENT.fullmatch(text))


def parse_bytes(raw: str, name: str, *, hi: int | None = None) -> int:
    """``raw`` (the value of ``name``, spaces around it ignored) as a byte count in ``[0, hi]`` ([Note: one
    parser for byte counts]).

    Raises:
        ValueError: another form: ``"torchferry: {name}={raw!r} is not a number of bytes ({BYTES_FORM})"``;
            above ``hi``: ``"torchferry: {name}={raw!r} is not a number of bytes in [0, {hi}]"``.
    """
    text = raw.strip()
    n = -1
    if _DIGITS.fullmatch(text):
        n = int(text)
    elif _EXPONENT.fullmatch(text):
        exact = decimal.Decimal(text)
        if exact == exact.to_integral_value():
            n = int(exact)
    if n < 0:
        raise ValueError(f"torchferry: {name}={raw!r} is not a number of bytes ({BYTES_FORM})")
    if hi is not None and n > hi:
        raise ValueError(f"torchferry: {name}={raw!r} is not a number of bytes in [0, {hi}]")
    return n


@overload
def env_bytes(name: str, default: None = None, *, hi: int | None = None) -> int | None: ...
@overload
def env_bytes(name: str, default: int, *, hi: int | None = None) -> int: ...
def env_bytes(name: str, default: int | None = None, *, hi: int | None = None) -> int | None:
    """The environment variable ``name`` as a byte count (:func:`parse_bytes`), ``default`` if unset or empty.

    Raises:
        ValueError: as :func:`parse_bytes`, naming the variable and the value.
    """
    raw = _raw(name)
    return parse_bytes(raw, name, hi=hi) if raw else default


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """The environment variable ``name`` as one of ``choices`` (lower case; compared after
    ``strip().lower()``), ``default`` if unset or empty.

    Raises:
        ValueError: anything else: ``"torchferry: {name} must be one of {choices}, got {raw!r}"``.
    """
    text = _raw(name).lower()
    if not text:
        return default
    if text not in choices:
        raise ValueError(f"torchferry: {name} must be one of {', '.join(choices)} (or empty: {default}), "
                         f"got {os.environ.get(name)!r}")
    return text


# The core's settings: one variable each, read by :func:`core_settings`. Their meanings are documented where
# they act (the module named on each line; ``CoreSettings`` (``_core/_api/settings.py``) lists them).
HOST_BUDGET_ENV = "TORCHFERRY_HOST_BUDGET_BYTES"  # _host/budget: bytes all pools of the node may hold
HOST_RESERVE_ENV = "TORCHFERRY_HOST_RESERVE_BYTES"  # _host/budget: MemAvailable left to everything else
LEDGER_DIR_ENV = "TORCHFERRY_LEDGER_DIR"  # _host/budget: the node ledger's folder
REFILL_ENV = "TORCHFERRY_ISSUE_REFILL_BYTES"  # _schedules/issuer: a full issue window's refill mark
HASH_ENV = "TORCHFERRY_HASH"  # _schedules/hash: the unchanged-storage hash's implementation
VERIFY_ENV = "TORCHFERRY_VERIFY_SKIPS"  # _schedules/skip_check: compare every skipped storage (tests)
ARENA_ENV = "TORCHFERRY_RELOAD_ARENA"  # _transfer/arena: the reload arena, a switch
DRIVER_ENV = "TORCHFERRY_DRIVER_COPIES"  # _transfer/driver: copies queued by pointer, a switch
SWITCH_ENV = "TORCHFERRY_SWITCH_BYTES"  # _transfer/switch: bytes between switch points
CORE_ENV = (HOST_BUDGET_ENV, HOST_RESERVE_ENV, LEDGER_DIR_ENV, REFILL_ENV, HASH_ENV, VERIFY_ENV, ARENA_ENV,
            DRIVER_ENV, SWITCH_ENV)
"""Every ``TORCHFERRY_*`` variable the core's settings are read from."""


def ledger_dir() -> str | None:
    """``TORCHFERRY_LEDGER_DIR`` (spaces around it ignored), or ``None`` if unset or empty.

    Raises:
        ValueError: not an absolute path to a folder this process can write: the node's ranks would not
            share one ledger (a ledger that cannot be opened checks each process alone, silently), so a
            typo (``" /dev/shm"``, a relative path read from each rank's own working folder, a folder
            not made yet) would let them over-commit the node's memory together.
    """
    path = _raw(LEDGER_DIR_ENV)
    if not path:
        return None
    if not shared_folder(path):
        raise ValueError(f"torchferry: {LEDGER_DIR_ENV} must be an absolute path to a folder this process can "
                         "write (every rank of the node shares the ledger there), "
                         f"got {os.environ.get(LEDGER_DIR_ENV)!r}")
    return path


def allocator_conf() -> str:
    """PyTorch's caching-allocator settings, ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` joined
    by a comma, in lower case (``_core/_transfer/arena.py`` parses it, with the settings made at run time over
    it: [Note: allocator settings read now])."""
    return (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).lower()


def core_settings() -> CoreSettings:
    """The core's settings from the environment now: each of :data:`CORE_ENV` (unset or empty: the core's
    default) and :func:`allocator_conf`.

    Raises:
        ValueError: a variable its parser refuses, naming the variable and the value: a byte count
            (:func:`parse_bytes`; the refill mark in ``[0, ISSUE_WINDOW_BYTES]``), a switch (:func:`env_flag`),
            ``TORCHFERRY_HASH`` not one of :data:`HASH_CHOICES` (:func:`env_choice`), a ledger folder the
            node's ranks could not share (:func:`ledger_dir`).
    """
    return CoreSettings(
        driver_copies=env_flag(DRIVER_ENV, True),
        issue_refill_bytes=env_bytes(REFILL_ENV, hi=ISSUE_WINDOW_BYTES),
        switch_bytes=env_bytes(SWITCH_ENV),
        hash=env_choice(HASH_ENV, HASH_CHOICES, "auto"),
        verify_skips=env_flag(VERIFY_ENV, False),
        reload_arena=env_flag(ARENA_ENV, True),
        ledger_dir=ledger_dir(),
        host_reserve_bytes=env_bytes(HOST_RESERVE_ENV),
        host_budget_bytes=env_bytes(HOST_BUDGET_ENV),
        allocator_conf=allocator_conf(),
    )
