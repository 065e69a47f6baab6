"""What host memory this process may still take: ``/proc/meminfo`` and its memory cgroup's limit.

[Note: the container's memory limit]
Inside a container (Kubernetes, Ray with memory limits, Slurm's cgroups) ``/proc/meminfo`` shows
the host, not the limit, and pinned memory is charged to the process's memory cgroup: past the
cgroup's limit the kernel's OOM killer (or Ray's memory monitor) ends the worker. So the host
budget (``_host/budget``) also takes the cgroup's limit less its current usage, the smallest over
the process's cgroup and its ancestors (a pod's limit sits above its containers'). The files, as
``Documentation/admin-guide/cgroup-v2.rst`` and ``Documentation/admin-guide/cgroup-v1/memory.rst``
of the Linux kernel describe them:

- cgroup v2 (a ``0::<path>`` line in ``/proc/self/cgroup``): ``memory.max`` (``max``: no limit)
  and ``memory.current`` under ``/sys/fs/cgroup/<path>``;
- cgroup v1 (a ``<n>:...memory...:<path>`` line): ``memory.limit_in_bytes`` (no limit reads as a
  huge number, ``PAGE_COUNTER_MAX`` pages: 9223372036854771712 with 4 KiB pages) and
  ``memory.usage_in_bytes`` under ``/sys/fs/cgroup/memory/<path>``. A host that mounts v1's
  memory controller beside a v2 tree (hybrid) lists both: v1 holds the memory limit then.

The usage counts the page cache too, which the kernel reclaims before it OOM-kills: a cgroup
whose files filled it with cache refused every pool. So, as the kubelet computes a container's
working set, the cache the kernel can drop first, ``inactive_file`` in ``memory.stat`` (v1:
``total_inactive_file``, which counts the cgroup's descendants too, as ``memory.usage_in_bytes``
does), is taken off the usage (:attr:`CgroupMemory.reclaimable`); an unreadable ``memory.stat``
takes nothing off.

A ``<path>`` that is not under the mount (a container without its own cgroup namespace sees its
host-side path, but has its own cgroup mounted at the root) is read at the mount's root. A file
that cannot be read or parsed counts as no limit at that level. The roots are
:data:`PROC_ROOT` and :data:`CGROUP_ROOT` (tests point them at a fake tree).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["CGROUP_ROOT", "PROC_ROOT", "CgroupMemory", "cgroup_memory", "meminfo"]

PROC_ROOT = "/proc"
"""Where ``meminfo`` and ``self/cgroup`` are read."""
CGROUP_ROOT = "/sys/fs/cgroup"
"""Where the cgroup hierarchies are mounted (v2 at the root, v1's memory controller in ``memory/``)."""
V1_NO_LIMIT = 1 << 62
"""A cgroup v1 limit at or above this many bytes is no limit (``PAGE_COUNTER_MAX`` pages, see the Note)."""

# version -> (the folder of its memory controller under CGROUP_ROOT, the limit's file, the usage's file)
_FILES = {2: ("", "memory.max", "memory.current"), 1: ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")}
# version -> the key of memory.stat that holds the reclaimable page cache (see the Note)
_INACTIVE_FILE = {2: "inactive_file", 1: "total_inactive_file"}


class CgroupMemory(NamedTuple):
    """The tightest memory limit of this process's cgroups."""

    headroom: int
    """``limit - (usage - reclaimable)``, bytes (negative when the cgroup is over its limit)."""
    limit: int
    """The limit, bytes (``memory.max`` / ``memory.limit_in_bytes``)."""
    usage: int
    """The usage when read, bytes (``memory.current`` / ``memory.usage_in_bytes``)."""
    limit_file: str
    """The file the limit was read from (for messages)."""
    usage_file: str
    """The file the usage was read from."""
    version: int
    """1 or 2."""
    reclaimable: int = 0
    """Page cache the kernel drops before it OOM-kills, bytes (``inactive_file`` of ``memory.stat``, v1:
    ``total_inactive_file``; at most ``usage``; 0 where unreadable): not counted as used (see the Note)."""


def _read(path: str) -> str | None:
    """The text of ``path``, ``None`` where it cannot be read. Bytes that are not UTF-8 are kept as
    surrogates (``os.fsdecode``'s way: a path still names its folder), so a garbled count is malformed,
    never a ``UnicodeDecodeError`` out of every offload."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return None


_COUNT_DIGITS = 20  # 10**20 bytes: more is no memory count (and int() refuses past 4,300 digits)


def _count(text: str) -> int | None:
    """``text`` as a count of at most 20 ASCII digits, ``None`` for anything else."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= _COUNT_DIGITS else None


def meminfo(proc_root: str | None = None) -> dict[str, int]:
    """``<proc_root>/meminfo`` (default :data:`PROC_ROOT`) in bytes (``{}`` where it cannot be read, e.g. not Linux);
    a line whose value is not a count of ASCII digits, in ``kB`` or without a unit, is left out."""
    out: dict[str, int] = {}
    for line in (_read(os.path.join(proc_root or PROC_ROOT, "meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        n = _count(parts[0]) if parts and parts[1:] in ([], ["kB"]) else None
        if n is not None:
            out[key] = n * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _own_cgroups(proc_root: str) -> dict[int, str]:
    """``{version: path}`` of this process's memory cgroups from ``self/cgroup`` (``{}``: unreadable)."""
    out: dict[int, str] = {}
    for line in (_read(os.path.join(proc_root, "self", "cgroup")) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            out[1] = path
        elif hierarchy == "0" and controllers == "":
            out[2] = path
    return out


def _levels(mount: str, path: str) -> Iterator[str]:
    """The folder of cgroup ``path`` under ``mount``, then each parent up to ``mount`` itself."""
    mount = os.path.normpath(mount)
    start = os.path.normpath(os.path.join(mount, path.lstrip("/")))
    if os.path.commonpath([mount, start]) != mount or not os.path.isdir(start):
        start = mount  # see the Note: a host-side path, read at the mount's root
    d = start
    while True:
        yield d
        if d == mount:
            return
        d = os.path.dirname(d)


def _read_bytes(path: str, version: int) -> int | None:
    """A byte count from a cgroup file; ``None`` for no limit, an unreadable or a malformed file."""
    n = _count((_read(path) or "").strip())  # None: "max" (v2: no limit), or not a count
    return None if n is None or version == 1 and n >= V1_NO_LIMIT else n


def _inactive_file(folder: str, version: int) -> int:
    """The reclaimable page cache of the cgroup in ``folder`` from its ``memory.stat``, bytes (0 where unreadable)."""
    key = _INACTIVE_FILE[version]
    for line in (_read(os.path.join(folder, "memory.stat")) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _count(value.strip()) or 0
    return 0


def cgroup_memory(proc_root: str | None = None, cgroup_root: str | None = None) -> CgroupMemory | None:
    """The memory limit of this process's cgroups that leaves the least room ([Note: the container's
    memory limit]), or ``None`` where none is set or none can be read.

    Args:
        proc_root: where ``self/cgroup`` is read (default :data:`PROC_ROOT`).
        cgroup_root: where the hierarchies are mounted (default :data:`CGROUP_ROOT`).
    """
    proc_root, cgroup_root = proc_root or PROC_ROOT, cgroup_root or CGROUP_ROOT
    own = _own_cgroups(proc_root)
    for version in (1, 2):  # a memory controller bound to v1 (hybrid) is absent from the v2 tree
        sub, limit_name, usage_name = _FILES[version]
        mount = os.path.join(cgroup_root, sub) if sub else cgroup_root
        if version not in own or not os.path.isdir(mount):
            continue
        best: CgroupMemory | None = None
        for d in _levels(mount, own[version]):
            limit_file, usage_file = os.path.join(d, limit_name), os.path.join(d, usage_name)
            limit = _read_bytes(limit_file, version)
            usage = _read_bytes(usage_file, version) if limit is not None else None
            if limit is None or usage is None:
                continue
            reclaimable = min(_inactive_file(d, version), usage)
            if best is None or limit - usage + reclaimable < best.headroom:
                best = CgroupMemory(limit - usage + reclaimable, limit, usage, limit_file, usage_file, version,
                                    reclaimable)
        return best
    return None
