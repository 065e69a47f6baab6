"""How the torchferry pools of this process are backed by pages, read from ``/proc`` (for the ``env``
of a results JSON).

The DMA engine translates every page of a pinned range; whether a pool is
covered by transparent huge pages (2 MiB) or by 4 KiB pages is the first thing
to check when a pool copies below a ``torch`` pinned buffer on the same host.
A pool's memory is an anonymous mapping advised ``MADV_HUGEPAGE``, which
``/proc/self/smaps`` marks with the ``hg`` flag in ``VmFlags``; the report sums
``AnonHugePages`` over the mappings so marked (other memory of the process
advised the same way would count too: PyTorch's CPU allocator does so only
with ``THP_MEM_ALLOC_ENABLE=1``). The pools' size comes from the ferries'
public ``host_bytes``.
"""

from __future__ import annotations

__all__ = ["host_page_report"]

_THP = "/sys/kernel/mm/transparent_hugepage/"


def _read_setting(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _advised_huge_bytes(smaps: str = "/proc/self/smaps") -> int | None:
    """``AnonHugePages`` bytes of the mappings flagged ``hg`` (advised MADV_HUGEPAGE); ``None`` if unreadable."""
    huge = 0
    pending = 0  # AnonHugePages of the current mapping, counted once its VmFlags line says hg
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if head == "AnonHugePages:":
                    pending = int(line.split()[1]) * 1024
                elif head == "VmFlags:":
                    if "hg" in line.split()[1:]:
                        huge += pending
                    pending = 0
    except (OSError, ValueError, IndexError):
        return None
    return huge


def host_page_report(pool_bytes: int, smaps: str = "/proc/self/smaps") -> dict:
    """The ``env.host_pages`` entry of a results JSON.

    Args:
        pool_bytes: bytes of the live pools (the sum of the ferries' ``host_bytes``).
        smaps: the file to read (a test gives its own).

    Returns:
        ``{"thp_enabled", "thp_defrag"}``: the kernel's THP settings (the bracketed
        word is the one in force; ``None`` if unreadable); ``"pool_bytes"``;
        ``"anon_huge_bytes"``: bytes of huge pages under the mappings advised
        ``MADV_HUGEPAGE`` (``None`` without a pool or smaps); ``"huge_page_coverage"``:
        their ratio to ``pool_bytes``, at most 1 (``None`` likewise); ``"source"``.
    """
    out: dict = {"thp_enabled": _read_setting(_THP + "enabled"), "thp_defrag": _read_setting(_THP + "defrag"),
                 "pool_bytes": pool_bytes, "anon_huge_bytes": None, "huge_page_coverage": None,
                 "source": "/proc/self/smaps: AnonHugePages of the mappings advised MADV_HUGEPAGE (VmFlags hg)"}
    if not pool_bytes:
        return out
    huge = _advised_huge_bytes(smaps)
    if huge is None:
        return out
    out["anon_huge_bytes"] = huge
    out["huge_page_coverage"] = min(1.0, huge / pool_bytes)
    return out
