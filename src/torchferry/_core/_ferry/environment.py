"""The core's ``TORCHFERRY_*`` settings, all read at ``Ferry()`` ([Note: one parser for the environment]
in ``_api/env``): a bad value fails there, before anything moved, not half-way through a transfer."""

from __future__ import annotations

from .._host.budget import budget_from_env, reserve_from_env
from .._schedules.hash import hash_choice
from .._schedules.issuer import refill_bytes_from_env
from .._schedules.unchanged import verify_skips
from .._transfer.driver import enabled as driver_copies_enabled
from .._transfer.switch import switch_bytes_from_env
from .._api.env import ledger_dir, reload_arena

__all__ = ["check_environment"]


def check_environment(host_budget_bytes: int | None) -> int | None:
    """Reads every setting of the core from the environment, so that a bad one is refused now.

    Args:
        host_budget_bytes: ``Ferry(host_budget_bytes=...)``.

    Returns:
        ``host_budget_bytes``, else ``TORCHFERRY_HOST_BUDGET_BYTES`` (``None``: none).

    Raises:
        ValueError: a setting that its parser refuses, naming the variable and the value.
    """
    driver_copies_enabled()
    refill_bytes_from_env()
    switch_bytes_from_env()
    hash_choice()
    verify_skips()
    reload_arena()
    ledger_dir()
    reserve_from_env()
    budget = budget_from_env()
    return budget if host_budget_bytes is None else host_budget_bytes
