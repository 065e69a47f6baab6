"""torchferry: move PyTorch training state between GPU and a pinned host pool.

The public face: everything a user imports is named here (``__all__``); the engine below it lives
in ``torchferry._core``, one folder per layer (``docs/how-it-works.md``). Importing this package
imports neither torch nor the engine: the first public name used loads them all (so that
``torchferry --help`` answers at once); it never initialises CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._core._api.handle import TransferHandle
    from ._core._api.residency import Residency
    from ._core._api.settings import CoreSettings
    from ._core._api.stats import TransferStats
    from ._core._dock import Dock, DockStats, Move, Schedule
    from ._core._ferry.swap import swap
    from ._core._host.budget import HostBudgetError
    from ._core._schedules.prefetch import Prefetch
    from ._public.ferry import Ferry

__all__ = ["CoreSettings", "Dock", "DockStats", "Ferry", "HostBudgetError", "Move", "Prefetch", "Residency",
           "Schedule", "TransferHandle", "TransferStats", "swap"]
__version__ = "0.1.0"


def _load() -> None:
    """Imports the public names, shown and documented as ``torchferry.X`` (where users import them)."""
    from ._core._api.handle import TransferHandle
    from ._core._api.residency import Residency
    from ._core._api.settings import CoreSettings
    from ._core._api.stats import TransferStats
    from ._core._dock import Dock, DockStats, Move, Schedule
    from ._core._ferry.swap import swap
    from ._core._host.budget import HostBudgetError
    from ._core._schedules.prefetch import Prefetch
    from ._public.ferry import Ferry

    found = {"CoreSettings": CoreSettings, "TransferHandle": TransferHandle, "Residency": Residency,
             "TransferStats": TransferStats, "Dock": Dock, "DockStats": DockStats, "Move": Move, "Schedule": Schedule,
             "Ferry": Ferry, "swap": swap, "HostBudgetError": HostBudgetError, "Prefetch": Prefetch}
    for name in __all__:
        found[name].__module__ = __name__
        globals()[name] = found[name]


def __getattr__(name: str) -> object:
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'torchferry' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__", *(n for n in globals() if n.startswith("__") and n.endswith("__"))})
