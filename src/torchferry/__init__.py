"""torchferry: move PyTorch training state between GPU and a pinned host pool.

The public face: everything a user imports is named here (``__all__``); the engine below it lives
in ``torchferry._core``, one folder per layer (``docs/how-it-works.md``). Importing this package
does not initialise CUDA.
"""

from ._core._api.handle import TransferHandle
from ._core._api.residency import Residency
from ._core._api.stats import TransferStats
from ._core._dock import Dock, DockStats, Move, Schedule
from ._core._ferry.ferry import Ferry
from ._core._ferry.swap import swap
from ._core._host.budget import HostBudgetError
from ._core._schedules.prefetch import Prefetch

__all__ = ["Dock", "DockStats", "Ferry", "HostBudgetError", "Move", "Prefetch", "Residency", "Schedule",
           "TransferHandle", "TransferStats", "swap"]
__version__ = "0.1.0"

for _name in __all__:  # shown and documented as torchferry.X, where users import them from
    globals()[_name].__module__ = __name__
del _name
