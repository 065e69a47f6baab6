"""Every ``TORCHFERRY_*`` environment variable is read through here, so each is parsed alike.

[Note: one parser for the environment]
A switch was read three ways: ``"1"``/``"0"`` only (a ``ValueError`` for ``"true"``), anything
but ``"0"`` as on (``TORCHFERRY_VERL=false`` installed the Ray hook's patch), anything but
``""``/``"0"`` as on (``TORCHFERRY_VERIFY_SKIPS=false`` turned verify mode on). Now a switch
(:func:`env_flag`) takes ``1, true, yes, on`` and ``0, false, no, off`` in any case with the
surrounding spaces ignored, the empty string or no variable means its default, and anything else
is a ``ValueError`` naming the variable and the value. Numbers (:func:`env_int`), byte counts
(:func:`env_bytes`) and names (:func:`env_choice`) are refused the same way. Lowest layer: imports
nothing of torchferry.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

__all__ = ["OFF", "ON", "env_bytes", "env_choice", "env_flag", "env_int", "parse_flag"]

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
    ``None``), ``default`` if unset or empty.

    Raises:
        ValueError: not such an integer: ``"torchferry: {name} must be {says}, got {raw!r}"``.
    """
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0 or (hi is not None and value > hi):
        raise ValueError(f"torchferry: {name} must be {says}, got {raw!r}")
    return value


def env_bytes(name: str) -> int | None:
    """The environment variable ``name`` as a byte count >= 0 (an integer, or a whole number written as
    a float such as ``40e9``), ``None`` if unset or empty.

    Raises:
        ValueError: not a number (``"lots"``, ``"inf"``, ``"nan"``, ``"1.5"``):
            ``"torchferry: {name}={raw!r} is not a number of bytes ..."``; a negative one:
            ``"torchferry: {name}={raw!r} must be >= 0"``.
    """
    raw = _raw(name)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        try:
            x = float(raw)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and x.is_integer()):
            raise ValueError(f"torchferry: {name}={raw!r} is not a number of bytes "
                             "(an integer >= 0, e.g. 40000000000 or 40e9)") from None
        n = int(x)
    if n < 0:
        raise ValueError(f"torchferry: {name}={raw!r} must be >= 0")
    return n


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
