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
- the request fits in ``MemAvailable`` minus the pending bytes of every
  process, this one's included, minus a reserve for everything else
  (``TORCHFERRY_HOST_RESERVE_BYTES``, default 5% of ``MemTotal``), and
- the request fits in the memory cgroup's limit less its usage (page cache
  the kernel reclaims first not counted), minus the pending bytes of every
  process, minus the same reserve (``TORCHFERRY_HOST_RESERVE_BYTES``, default
  5% of the limit) ([Note: the container's memory limit] in
  ``_host/node_memory``: inside a container ``/proc/meminfo`` shows the host).

The smallest of these is the one a refusal names. Pending bytes are not yet
allocated, so neither ``MemAvailable`` nor the cgroup's usage counts them, and
held ones are in both already (so they are not subtracted again). This
process's own pending bytes count too: two requests of one process (the pin-ahead
threads of two ferries) were each checked against the same free memory and
both granted past it. While a pool's pages are being touched, the part touched
is counted in both (the pending bytes whole, and in the usage): a transient
over-count of at most that pool, on the safe side.

[Note: a ledger entry expires]
A process that died between ``request`` and ``settle`` left ``pending`` bytes
that blocked every pool (and a corrupt or forged entry such as
``{"1": {"pending": 10**15}}``, pid 1 being alive, did the same for good). So
an entry records its process's start time (``start``: field 22 of
``/proc/<pid>/stat``, clock ticks since boot), and its pending bytes the time
of their last request or settle (``since``, seconds since the epoch). An entry
whose pid now has another start time (the pid was reused) is dropped; pending
bytes without ``since``, or with a ``since`` more than
:data:`PENDING_EXPIRE_S` away from now, are dropped (held ones stay). Pids are
canonical ASCII decimals in ``[1, 2^22]`` (``"0001"``, ``"\uff11"`` are
corrupt), and byte counts ints >= 0.

The lock is held only to check and record, not while pages are touched and
pinned, so ranks pin in parallel.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator

from .node_memory import cgroup_memory, meminfo

__all__ = ["HostBudgetError", "NodeLedger", "meminfo"]

logger = logging.getLogger("torchferry")

# A ledger entry's pid above this is corrupt: Linux's pid_max is at most 2^22 (PID_MAX_LIMIT, proc(5)
# on /proc/sys/kernel/pid_max); os.kill() of a larger number raised OverflowError on every offload.
_PID_MAX = 1 << 22
_SINCE_MAX = 1e18  # a ledger time (seconds since the epoch) beyond this is corrupt
_CANONICAL_PID = re.compile(r"[1-9][0-9]*")  # ASCII, no leading zero: one key per process

_RESERVE_FRACTION = 0.05

PENDING_EXPIRE_S = 1800.0
"""Pending bytes last requested or settled longer ago than this (seconds) are dropped ([Note: a ledger
entry expires]); a pool of 1 TB is touched and pinned in minutes (about 200 s at 5 GB/s)."""

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22), ``None`` if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[19])  # fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def _valid(pid: object, entry: object) -> bool:
    """Whether a ledger entry is one this module writes: a canonical ASCII decimal pid in ``[1, _PID_MAX]``
    mapped to a dict whose ``held``, ``pending`` and ``start`` (when there) are ints >= 0 and whose
    ``since`` (when there) is a number ([Note: a ledger entry expires])."""
    if not (isinstance(pid, str) and _CANONICAL_PID.fullmatch(pid) and int(pid) <= _PID_MAX
            and isinstance(entry, dict)):
        return False
    since = entry.get("since", 0)
    return (all(type(entry.get(k, 0)) is int and entry.get(k, 0) >= 0 for k in ("held", "pending", "start"))
            and type(since) in (int, float) and -_SINCE_MAX < since < _SINCE_MAX)  # NaN, inf and 10**400 too


def _expire(pid: str, e: dict, now: float) -> bool:
    """Drops ``e``'s pending bytes if expired; whether the entry is still its process's (and not empty)."""
    start = e.get("start")
    if start is not None and _start_time(int(pid)) not in (None, start):
        return False  # the pid now names another process
    if e.get("pending", 0) and ("since" not in e or abs(now - e["since"]) > PENDING_EXPIRE_S):
        logger.warning("torchferry: dropped %d pending bytes of pid %s from the host ledger (recorded %s; "
                       "pending entries expire after %.0f s)", e["pending"], pid,
                       "without a time" if "since" not in e else f"{now - e['since']:.0f} s ago", PENDING_EXPIRE_S)
        e["pending"] = 0
        e.pop("since", None)
    return bool(e.get("held", 0) or e.get("pending", 0))


def _live_entries(raw: bytes, path: str) -> dict[str, dict[str, int]]:
    """The ledger's entries of live processes; a corrupt file or entry is skipped with a warning (and
    dropped when the ledger is written back), a dead process's entry silently."""
    try:
        entries = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):  # a torn file from a killed writer; nested past the parser's depth
        logger.warning("torchferry: the host ledger %s is not JSON (a writer killed mid-write?); starting it over",
                       path)
        return {}
    if not isinstance(entries, dict):
        logger.warning("torchferry: the host ledger %s holds a %s, not a ledger; starting it over",
                       path, type(entries).__name__)
        return {}
    out = {}
    now = time.time()
    for pid, e in entries.items():
        if not _valid(pid, e):
            logger.warning("torchferry: skipped a corrupt entry of the host ledger %s: %.200r: %.200r (a pid in "
                           "[1, %d] mapping to byte counts 'held' and 'pending' >= 0 expected); it is dropped",
                           path, pid, e, _PID_MAX)
        elif _alive(int(pid)) and _expire(pid, e, now):
            out[pid] = e
    return out


class NodeLedger:
    """The node-wide record of pool bytes, one JSON file under an ``flock``.

    Args:
        path: the ledger file; default ``<folder>/torchferry-host-<uid>.json``.
        folder: the ledger's folder when ``path`` is ``None`` (``CoreSettings.ledger_dir``, from
            ``TORCHFERRY_LEDGER_DIR``); default ``/dev/shm``, else the temporary folder.
        reserve: bytes of the node's free memory and of the memory cgroup's room left to everything else
            (``CoreSettings.host_reserve_bytes``, from ``TORCHFERRY_HOST_RESERVE_BYTES``); default 5% of
            each.
    """

    def __init__(self, path: str | None = None, *, folder: str | None = None, reserve: int | None = None) -> None:
        if path is None:
            folder = folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            path = os.path.join(folder, f"torchferry-host-{os.getuid()}.json")
        self.path = path
        self.reserve = reserve

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
                    entries = _live_entries(raw, self.path)
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
            return {pid: {"held": e.get("held", 0), "pending": e.get("pending", 0)} for pid, e in entries.items()}

    @staticmethod
    def _own(entries: dict[str, dict[str, int]]) -> dict:
        """This process's entry (made if absent), its start time recorded ([Note: a ledger entry expires])."""
        me = os.getpid()
        e = entries.setdefault(str(me), {"held": 0, "pending": 0})
        start = _start_time(me)
        if start is not None:
            e["start"] = start
        return e

    def request(self, nbytes: int, *, budget: int | None, what: str) -> None:
        """Records ``nbytes`` as pending for this process, or refuses.

        Args:
            nbytes: bytes of host memory about to be allocated.
            budget: bytes all pools of the node may hold together, or ``None``.
            what: the allocation, for the error message.

        Raises:
            HostBudgetError: the smallest of the budget, the node's free memory and the memory
                cgroup's room cannot hold ``nbytes``; nothing is recorded. The message names that
                limit, the bytes needed and available and how to lower the need.
        """
        info = meminfo()
        cgroup = cgroup_memory()
        given = self.reserve
        reserve = int(_RESERVE_FRACTION * info.get("MemTotal", 0)) if given is None else given
        with self._locked() as entries:
            pending = sum(e.get("pending", 0) for e in entries.values())  # this process's too: see the Note
            used = sum(e.get("held", 0) + e.get("pending", 0) for e in entries.values())
            limits = []  # (bytes available, the limit as a message names it, how to raise it)
            if budget is not None:
                limits.append((budget - used, f"the node's host budget of {budget} bytes "
                               f"({used} already held or being allocated by {len(entries)} process(es) "
                               "of this node)", "raise the budget (TORCHFERRY_HOST_BUDGET_BYTES, "
                               "Ferry(host_budget_bytes=...)) if the node really has the memory"))
            if "MemAvailable" in info:
                free = info["MemAvailable"] - pending - reserve
                limits.append((free, f"the node's free memory (MemAvailable {info['MemAvailable']} bytes, "
                               f"less {pending} being allocated by processes of this node and a reserve "
                               f"of {reserve} bytes)", "lower the reserve (TORCHFERRY_HOST_RESERVE_BYTES) "
                               "if the node really has the memory"))
            if cgroup is not None:
                cg_reserve = int(_RESERVE_FRACTION * cgroup.limit) if given is None else given
                limits.append((cgroup.headroom - pending - cg_reserve,
                               f"the container's memory limit (cgroup v{cgroup.version} {cgroup.limit_file} "
                               f"{cgroup.limit} bytes, less {cgroup.usage} bytes in use in "
                               f"{cgroup.usage_file} ({cgroup.reclaimable} of them reclaimable page cache, not "
                               f"counted), {pending} being allocated by processes of this node and a reserve "
                               f"of {cg_reserve} bytes; past it the kernel's OOM killer ends the process)",
                               "raise the container's memory limit (the pod's, Ray's or Slurm's)"))
            if limits:
                available, source, hint = min(limits, key=lambda limit: limit[0])
                if nbytes > available:
                    available = max(available, 0)
                    raise HostBudgetError(
                        f"torchferry: {what} needs {nbytes} bytes ({nbytes / 1e9:.2f} GB) of host memory, "
                        f"but only {available} bytes ({available / 1e9:.2f} GB) are available within "
                        f"{source}. Nothing was allocated and the state is where it was. Lower the need: "
                        "ferry.release_host() returns an idle ferry's pool, fewer or smaller ferries per "
                        f"rank (e.g. keep the optimizer state resident); or {hint}. "
                        "(Ferry(max_pinned_bytes=...) pins less, but the pool still needs the host memory.)",
                        needed=nbytes, available=available,
                    )
            e = self._own(entries)
            e["pending"], e["since"] = e.get("pending", 0) + nbytes, time.time()

    def settle(self, nbytes: int, *, allocated: bool) -> None:
        """Moves ``nbytes`` of this process from pending to held (or drops them if not allocated)."""
        with self._locked() as entries:
            e = self._own(entries)
            e["pending"] = max(0, e.get("pending", 0) - nbytes)
            if e["pending"]:
                e["since"] = time.time()
            else:
                e.pop("since", None)
            if allocated:
                e["held"] = e.get("held", 0) + nbytes
            if not e["held"] and not e["pending"]:
                entries.pop(str(os.getpid()))

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
