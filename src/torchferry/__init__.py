"""torchferry: move PyTorch training state between GPU and a pinned host pool.

Importing this package does not initialise CUDA.
"""

from ._dock import Dock
from ._ferry import Ferry
from ._handle import TransferHandle
from ._host_budget import HostBudgetError
from ._prefetch import Prefetch
from ._residency import Residency
from ._stats import TransferStats
from ._swap import swap

__all__ = ["Dock", "Ferry", "HostBudgetError", "Prefetch", "Residency", "TransferHandle", "TransferStats", "swap"]
__version__ = "0.1.0"
