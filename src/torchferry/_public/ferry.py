"""``torchferry.Ferry``: the core's ``Ferry`` (``_core/_ferry/ferry.py``), with its settings read from the
environment at ``Ferry()`` when none are given (the core reads no environment: ``_core/_api/settings.py``)."""

from __future__ import annotations

import torch

from .._core._api.settings import CoreSettings
from .._core._ferry.ferry import Ferry as CoreFerry
from .env import core_settings

__all__ = ["Ferry"]


class Ferry(CoreFerry):
    __doc__ = CoreFerry.__doc__

    def __init__(self, *targets: object, device: torch.device | str | None = None,
                 max_pinned_bytes: int | None = None, host_budget_bytes: int | None = None,
                 pin_ahead: bool = True, skip_unchanged: bool = False, settings: CoreSettings | None = None) -> None:
        super().__init__(*targets, device=device, max_pinned_bytes=max_pinned_bytes,
                         host_budget_bytes=host_budget_bytes, pin_ahead=pin_ahead, skip_unchanged=skip_unchanged,
                         settings=core_settings() if settings is None else settings)
