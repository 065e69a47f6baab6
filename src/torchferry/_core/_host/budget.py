"""The node's host-memory budget for pinned pools, shared by every process on the node.

[Note: host budget]
Pinned memory cannot be swapped or reclaimed, so when the ranks of a node
together pin more than the node has, the kernel's OOM killer ends the job
(reported by OpenRLHF and ROLL users on 72B runs). Before a pool is allocated
we check what it needs against what the node can give, for all local ranks
together, and refuse with a clear error otherwise.

The ranks coordinate through a small ledger file in ``/dev/shm`` (node-local,
per user; ``TORCHFERRY_LEDGER_DIR`` overrides), read and written under an
exclusive ``fcntl.flock``: each process records the bytes of its pools,
``pending`` while they are being allocated (not yet visible in
``MemAvailable``) and ``held`` once allocated. Entries of processes that have
exited are dropped. A request is granted when

- ``held + pending`` of all processes plus the request stay within the node
  budget, if one is set (``TORCHFERRY_HOST_BUDGET_BYTES``, or
  ``Ferry(host_budget_bytes=)``), and
- the request fits in ``MemAvailable`` minus the other processes' pending
  bytes minus a reserve for everything else (``TORCHFERRY_HOST_RESERVE_BYTES``,
  default 5% of ``MemTotal``).

The lock is held only to check and record, not while pages are touched and
pinned, so ranks pin in parallel.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterator

from .._api.env import env_bytes

__all__ = ["HostBudgetError", "NodeLedger", "budget_from_env", "meminfo", "reserve_from_env"]

_RESERVE_FRACTION = 0.05

# In-process guard of the ledger file: ``flock`` locks belong to an open file
# description, so a second ``_locked`` in this process (a pool collected during
# a ledger operation) would wait on itself. _depth counts ledger operations in
# progress; give-backs arriving meanwhile wait in _deferred (bytes per ledger path).
_in_process = threading.RLock()
_depth = 0
_deferred: dict[str, int] = {}


class HostBudgetError(RuntimeError):
    """A host pool was refused: the node's budget or free memory cannot hold it.

    Attributes:
        needed: bytes the pool asked for.
        available: bytes the node could still give (the smaller of budget and memory).
    """

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{}`` where it cannot be read, e.g. not Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def budget_from_env() -> int | None:
    """``TORCHFERRY_HOST_BUDGET_BYTES`` (bytes all pools of the node may hold), or ``None``.

    Raises:
        ValueError: not a byte count (``_api/env.env_bytes``).
    """
    return env_bytes("TORCHFERRY_HOST_BUDGET_BYTES")


def reserve_from_env() -> int | None:
    """``TORCHFERRY_HOST_RESERVE_BYTES`` (bytes of ``MemAvailable`` left to everything else), or ``None``.

    Raises:
        ValueError: not a byte count (``_api/env.env_bytes``).
    """
    return env_bytes("TORCHFERRY_HOST_RESERVE_BYTES")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeLedger:
    """The node-wide record of pool bytes, one JSON file under an ``flock``.

    Args:
        path: the ledger file; default ``/dev/shm/torchferry-host-<uid>.json``
            (``TORCHFERRY_LEDGER_DIR`` replaces the folder).
    """

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            folder = os.environ.get("TORCHFERRY_LEDGER_DIR") or (
                "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            path = os.path.join(folder, f"torchferry-host-{os.getuid()}.json")
        self.path = path

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, int]]]:
        """The ledger's entries, under the in-process lock and the file's ``flock``; written back after."""
        global _depth
        with _in_process:
            _depth += 1
            try:
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                except OSError:  # no shared folder to write: check this process alone
                    yield {}
                    return
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    raw = b""
                    while chunk := os.read(fd, 1 << 16):
                        raw += chunk
                    try:
                        entries = json.loads(raw) if raw else {}
                    except ValueError:
                        entries = {}  # a torn file from a killed writer: start over
                    if not isinstance(entries, dict):
                        entries = {}  # not a ledger: start over
                    entries = {pid: e for pid, e in entries.items()
                               if pid.isdigit() and isinstance(e, dict) and _alive(int(pid))}
                    self._apply_deferred(entries)
                    yield entries
                    self._apply_deferred(entries)
                    data = json.dumps(entries).encode()
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.ftruncate(fd, 0)
                    os.write(fd, data)
                finally:
                    os.close(fd)  # also drops the lock
            finally:
                _depth -= 1

    def _apply_deferred(self, entries: dict[str, dict[str, int]]) -> None:
        freed = _deferred.pop(self.path, 0)
        e = entries.get(str(os.getpid()))
        if freed and e is not None:
            e["held"] = max(0, e.get("held", 0) - freed)
            if not e["held"] and not e.get("pending", 0):
                entries.pop(str(os.getpid()))

    def usage(self) -> dict[str, dict[str, int]]:
        """``{pid: {"held": bytes, "pending": bytes}}`` of the live processes."""
        with self._locked() as entries:
            return {pid: dict(e) for pid, e in entries.items()}

    def request(self, nbytes: int, *, budget: int | None, what: str) -> None:
        """Records ``nbytes`` as pending for this process, or refuses.

        Args:
            nbytes: bytes of host memory about to be allocated.
            budget: bytes all pools of the node may hold together, or ``None``.
            what: the allocation, for the error message.

        Raises:
            HostBudgetError: the budget or the node's free memory cannot hold
                ``nbytes``; nothing is recorded. The message names the bytes
                needed and available and how to lower the need.
        """
        info = meminfo()
        reserve = reserve_from_env()
        if reserve is None:
            reserve = int(_RESERVE_FRACTION * info.get("MemTotal", 0))
        me = str(os.getpid())
        with self._locked() as entries:
            others_pending = sum(e.get("pending", 0) for pid, e in entries.items() if pid != me)
            used = sum(e.get("held", 0) + e.get("pending", 0) for e in entries.values())
            limits = []
            if budget is not None:
                limits.append((budget - used, f"the node's host budget of {budget} bytes "
                               f"({used} already held or being allocated by {len(entries)} process(es) "
                               "of this node)"))
            if "MemAvailable" in info:
                free = info["MemAvailable"] - others_pending - reserve
                limits.append((free, f"the node's free memory (MemAvailable {info['MemAvailable']} bytes, "
                               f"less {others_pending} being allocated by other processes and a reserve "
                               f"of {reserve} bytes)"))
            for available, source in limits:
                if nbytes > available:
                    available = max(available, 0)
                    raise HostBudgetError(
                        f"torchferry: {what} needs {nbytes} bytes ({nbytes / 1e9:.2f} GB) of host memory, "
                        f"but only {available} bytes ({available / 1e9:.2f} GB) are available within "
                        f"{source}. Nothing was allocated and the state is where it was. Lower the need: "
                        "ferry.release_host() returns an idle ferry's pool, fewer or smaller ferries per "
                        "rank (e.g. keep the optimizer state resident); or raise the budget "
                        "(TORCHFERRY_HOST_BUDGET_BYTES, Ferry(host_budget_bytes=...)) or lower the reserve "
                        "(TORCHFERRY_HOST_RESERVE_BYTES) if the node really has the memory. "
                        "(Ferry(max_pinned_bytes=...) pins less, but the pool still needs the host memory.)",
                        needed=nbytes, available=available,
                    )
            e = entries.setdefault(me, {"held": 0, "pending": 0})
            e["pending"] = e.get("pending", 0) + nbytes

    def settle(self, nbytes: int, *, allocated: bool) -> None:
        """Moves ``nbytes`` of this process from pending to held (or drops them if not allocated)."""
        me = str(os.getpid())
        with self._locked() as entries:
            e = entries.setdefault(me, {"held": 0, "pending": 0})
            e["pending"] = max(0, e.get("pending", 0) - nbytes)
            if allocated:
                e["held"] = e.get("held", 0) + nbytes
            if not e["held"] and not e["pending"]:
                entries.pop(me)

    def give_back(self, nbytes: int) -> None:
        """Records that this process freed ``nbytes`` of held pool memory.

        Called when a pool's mapping is collected, which may happen inside
        another ledger operation of this thread (a garbage collection there):
        the ``flock`` is then already held through another descriptor and
        taking it again would deadlock, so the bytes are recorded by that
        operation instead.
        """
        with _in_process:
            if _depth:
                _deferred[self.path] = _deferred.get(self.path, 0) + nbytes
                return
        me = str(os.getpid())
        with self._locked() as entries:
            e = entries.get(me)
            if e is None:
                return
            e["held"] = max(0, e.get("held", 0) - nbytes)
            if not e["held"] and not e.get("pending", 0):
                entries.pop(me)
