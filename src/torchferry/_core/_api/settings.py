"""The core's settings: values, read from nowhere. Lowest layer: imports its argument checks only.

No module of ``_core`` reads the environment (``tests/cpu/test_layers.py`` checks it): a ``Ferry`` is handed
a :class:`CoreSettings` and passes its values down its call paths. ``torchferry.Ferry`` (``_public/ferry``)
builds one from the ``TORCHFERRY_*`` variables at ``Ferry()`` (``_public/env.core_settings``), and an
integration's ``patch()`` builds one once, at ``patch()`` (``integrations/_base/settings.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .args import check_bool, check_bytes, shown

__all__ = ["HASH_CHOICES", "CoreSettings", "shared_folder"]


def shared_folder(path: object) -> bool:
    """Whether ``path`` is an absolute path to a folder this process can write (a node ledger's folder: one that
    cannot be opened would leave each rank checking alone, silently)."""
    return (isinstance(path, str) and "\0" not in path and os.path.isabs(path) and os.path.isdir(path)
            and os.access(path, os.W_OK | os.X_OK))


@dataclass(frozen=True, kw_only=True)
class CoreSettings:
    """What the core's modules do where a setting chooses; each default is the core's own (what an unset
    variable means). Byte counts are bytes.

    Raises:
        ValueError: a byte count not an int >= 0 or ``None``, ``hash`` not ``"auto"``, ``"triton"`` or
            ``"torch"``, a ``ledger_dir`` that is not an absolute path to a folder this process can write.
        TypeError: a switch not a bool, ``allocator_conf`` not a str.

    Attributes:
        host_budget_bytes: bytes all pools of the node may hold together, ``None``: no budget
            (``_host/budget``, [Note: host budget]); ``Ferry(host_budget_bytes=...)`` overrides it.
            ``TORCHFERRY_HOST_BUDGET_BYTES``.
        host_reserve_bytes: bytes of the node's free memory (and of the memory cgroup's room) left to everything
            else, ``None``: a share of the memory (``_host/budget``). ``TORCHFERRY_HOST_RESERVE_BYTES``.
        ledger_dir: the folder of the node ledger shared by the node's ranks, ``None``: ``/dev/shm`` (else the
            temporary folder) (``_host/budget.NodeLedger``). ``TORCHFERRY_LEDGER_DIR``.
        issue_refill_bytes: a full issue window of a layer-wise reload is waited for until this many bytes
            of its copies are queued, ``None``: the whole window, ``ISSUE_WINDOW_BYTES``
            (``_schedules/issuer``). ``TORCHFERRY_ISSUE_REFILL_BYTES``.
        hash: the implementation of the unchanged-storage hash: ``"auto"`` (Triton on a GPU where it
            runs), ``"triton"`` or ``"torch"`` (``_schedules/hash``). ``TORCHFERRY_HASH``.
        verify_skips: compare every storage judged unchanged with its pool slot (tests;
            ``_schedules/skip_check``). ``TORCHFERRY_VERIFY_SKIPS``.
        reload_arena: seed one segment for a reload's large storages where the allocator allows
            (``_transfer/arena``). ``TORCHFERRY_RELOAD_ARENA``.
        driver_copies: a layer-wise reload's issuer thread queues its copies by pointer through the driver
            (``_transfer/driver``). ``TORCHFERRY_DRIVER_COPIES``.
        switch_bytes: bytes between two switch points of a copy stream (``0``: none), ``None``: the measured
            interval of each direction (``_transfer/switch``). ``TORCHFERRY_SWITCH_BYTES``.
        allocator_conf: PyTorch's caching-allocator settings from the environment, ``PYTORCH_CUDA_ALLOC_CONF``
            and ``PYTORCH_ALLOC_CONF`` joined by a comma, in lower case; the settings made at run time are
            read over them at each reload (``_transfer/arena``, [Note: allocator settings read now]).
    """

    host_budget_bytes: int | None = None
    host_reserve_bytes: int | None = None
    ledger_dir: str | None = None
    issue_refill_bytes: int | None = None
    hash: str = "auto"
    verify_skips: bool = False
    reload_arena: bool = True
    driver_copies: bool = True
    switch_bytes: int | None = None
    allocator_conf: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, what = getattr(self, f.name), f"CoreSettings({f.name}=...)"
            if f.name.endswith("_bytes"):
                check_bytes(value, what)
            elif f.type == "bool":
                check_bool(value, what)
        if self.hash not in HASH_CHOICES:
            raise ValueError(f"torchferry: CoreSettings(hash=...) must be one of {', '.join(HASH_CHOICES)}, "
                             f"got {shown(self.hash)}")
        if self.ledger_dir is not None and not shared_folder(self.ledger_dir):
            raise ValueError("torchferry: CoreSettings(ledger_dir=...) must be None or an absolute path to a folder "
                             "this process can write (every rank of the node shares the ledger there), "
                             f"got {shown(self.ledger_dir)}")
        if not isinstance(self.allocator_conf, str):
            raise TypeError("torchferry: CoreSettings(allocator_conf=...) must be a str, "
                            f"got {shown(self.allocator_conf)}")


HASH_CHOICES = ("auto", "triton", "torch")
"""The implementations of the unchanged-storage hash (``CoreSettings.hash``)."""
