"""Host memory for the pool: page-aligned anonymous mappings, pinned in place.

Why not ``torch.empty(n, pin_memory=True)``: it goes through PyTorch's caching
host allocator, which rounds every block up to a power of two (verl's seed on
2 H200s: 86.90 GB pinned for 45.69 GB of FSDP2 state per rank, 1.90x, the
``seed`` row of ``benchmarks/results/bench_qwen2.5-7b_h200x2_2026-11-30.json``)
and pins at 3.1 GB/s (``pinning.torch_GBps`` in
``benchmarks/results/bench-pin-pinning_h200x1_2026-11-30.json``). Here we map exactly the bytes asked for,
touch the pages (in parallel, through ATen's intra-op thread pool) and
register the range with ``cudaHostRegister``: 4 GiB pinned in 0.18 s, 23.6 GB/s,
in the same measurement.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .._state.host_blocks import in_host_pool
from .._state.host_blocks import live_blocks as _live
from .node_memory import meminfo

__all__ = ["HostBuffer", "available_host_bytes", "host_page_report", "in_host_pool"]

logger = logging.getLogger("torchferry")

# cudaHostRegisterPortable: the range counts as pinned for every CUDA context of
# the process, not only the one current at registration (CUDA runtime API docs).
_CUDA_HOST_REGISTER_PORTABLE = 0x01


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` if unknown."""
    return meminfo().get("MemAvailable")


def _describe_available() -> str:
    avail = available_host_bytes()
    return "unknown" if avail is None else f"{avail} bytes"


class _Mapping(mmap.mmap):
    """An anonymous mapping that unpins itself when the last tensor viewing it dies.

    ``torch.frombuffer`` keeps a reference to this object for as long as any
    storage views it, so ``__del__`` runs only when no tensor can read the
    memory any more: unregister from CUDA first, then unmap. Closing it any
    earlier would leave views (a user's ``state_dict()`` taken while offloaded,
    say) pointing at unmapped memory.
    """

    pinned_ptr: int = 0
    on_unmap = None  # called once the memory is unmapped (the node ledger's give-back)

    def __del__(self) -> None:
        if _live is not None:  # None at interpreter shutdown
            _live.pop(id(self), None)
        if self.on_unmap is not None:
            try:
                self.on_unmap()
            except Exception:  # interpreter shutdown; a dead process's entry is dropped anyway
                pass
            self.on_unmap = None
        if self.pinned_ptr:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.pinned_ptr)
            except Exception:  # interpreter shutdown: CUDA may already be gone
                pass
            self.pinned_ptr = 0
        try:
            self.close()
        except (BufferError, ValueError):
            pass




def _read_setting(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def host_page_report() -> dict:
    """How the live pool blocks of this process are backed by pages (for results' ``env``).

    The DMA engine translates every page of a pinned range; whether the pool
    is covered by transparent huge pages (2 MiB) or by 4 KiB pages is the
    first thing to check when a pool copies below a ``torch`` pinned buffer
    on the same host.

    Returns:
        ``{"thp_enabled", "thp_defrag"}``: the kernel's THP settings (the
        bracketed word is the one in force; ``None`` if unreadable);
        ``"pool_bytes"``: bytes of live pool mappings; ``"anon_huge_bytes"``:
        of those, bytes backed by huge pages (``AnonHugePages`` of their VMAs
        in ``/proc/self/smaps``); ``"huge_page_coverage"``: their ratio
        (``None`` without pool or smaps).
    """
    thp = "/sys/kernel/mm/transparent_hugepage/"
    out: dict = {"thp_enabled": _read_setting(thp + "enabled"), "thp_defrag": _read_setting(thp + "defrag"),
                 "pool_bytes": sum(end - start for start, end in _live.values()), "anon_huge_bytes": None,
                 "huge_page_coverage": None}
    ranges = list(_live.values())
    if not ranges:
        return out
    huge, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if head[0] in "0123456789abcdef" and "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = any(lo < end and start < hi for start, end in ranges)
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return out
    out["anon_huge_bytes"] = huge
    out["huge_page_coverage"] = min(1.0, huge / out["pool_bytes"]) if out["pool_bytes"] else None
    return out


def _map_anonymous(nbytes: int) -> mmap.mmap:
    """Maps ``nbytes`` of private anonymous memory (page aligned).

    Raises:
        RuntimeError: the kernel refused the mapping (host memory exhausted).
    """
    try:
        mm = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, MemoryError, OverflowError) as e:
        raise RuntimeError(
            f"torchferry: could not allocate a host pool of {nbytes} bytes "
            f"({nbytes / 1e9:.2f} GB); available host memory: "
            f"{_describe_available()} ({e})"
        ) from e
    # Huge pages make the first touch and the registration faster (fewer pages to
    # fault in and to register); harmless where the OS says no.
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm


_TOUCH_CHUNK = 256 << 20  # bytes per task of the first touch


def _touch(buf: torch.Tensor) -> None:
    """Faults every page of ``buf`` in now, from several threads, not in the copy engine's path.

    Own threads rather than ATen's intra-op pool: ``torchrun`` sets
    ``OMP_NUM_THREADS=1``, which made one rank touch 45.7 GB single-threaded at
    3.7 GB/s (``benchmarks/results/bench_qwen2.5-7b_h200x2_2026-11-30.json``, first run).
    ``fill_`` releases the GIL, so the threads run in parallel.
    """
    n = buf.numel()
    workers = max(1, min(16, os.cpu_count() or 1, n // _TOUCH_CHUNK))
    if workers == 1:
        buf.fill_(0)
        return
    chunks = [(i, min(i + _TOUCH_CHUNK, n)) for i in range(0, n, _TOUCH_CHUNK)]
    with ThreadPoolExecutor(workers, thread_name_prefix="torchferry-touch") as pool:
        list(pool.map(lambda c: buf[c[0] : c[1]].fill_(0), chunks))


class HostBuffer:
    """One exact-size block of host memory, its first ``pin_bytes`` pinned.

    Args:
        nbytes: size in bytes (> 0).
        pin_bytes: bytes from the start to register with CUDA (0: none; at
            most ``nbytes``). The rest stays pageable.
        device: the CUDA device index made current while registering (so a
            thread of rank 1 does not create a context on GPU 0).

    Attributes:
        tensor: 1D ``torch.uint8`` tensor of ``nbytes`` elements over the block.
        nbytes: size in bytes (the mapping itself is rounded to the page size).
        pinned_bytes: bytes registered with the CUDA driver (0 when not pinned).
        pin_seconds: host seconds spent mapping, touching and registering.

    Raises:
        RuntimeError: the mapping or the registration failed; the message names
            the bytes asked for and ``MemAvailable``. Nothing stays allocated.
    """

    def __init__(self, nbytes: int, *, pin_bytes: int, device: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"HostBuffer needs a positive size, got {nbytes=}")
        if not 0 <= pin_bytes <= nbytes:
            raise ValueError(f"HostBuffer: pin_bytes={pin_bytes} outside [0, {nbytes}]")
        self.nbytes = nbytes
        self.pinned_bytes = 0
        self._pageable: torch.Tensor | None = None
        t0 = time.perf_counter()
        mm = _map_anonymous(nbytes)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # 1D uint8; keeps `mm` alive
        _live[id(mm)] = (self.tensor.data_ptr(), self.tensor.data_ptr() + nbytes)
        self._mapping = mm
        _touch(self.tensor)
        if pin_bytes:
            self._register(pin_bytes, device)
        self.pin_seconds = time.perf_counter() - t0
        logger.debug("host buffer: %d bytes, %d pinned, %.3f s", nbytes, self.pinned_bytes, self.pin_seconds)

    @property
    def pinned(self) -> bool:
        """Whether the whole block is registered with the CUDA driver."""
        return self.pinned_bytes == self.nbytes

    def _register(self, pin_bytes: int, device: int | None) -> None:
        cudart = torch.cuda.cudart()
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), pin_bytes, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(err[0] if isinstance(err, tuple) else err)
        if code != 0:
            self.free()
            raise RuntimeError(
                f"torchferry: cudaHostRegister of {pin_bytes} bytes "
                f"({pin_bytes / 1e9:.2f} GB) failed with CUDA error {code}; "
                f"available host memory: {_describe_available()}"
            )
        self.pinned_bytes = pin_bytes
        self._mapping.pinned_ptr = self.tensor.data_ptr()
        if pin_bytes < self.nbytes:
            # The pageable rest as a storage of its own: is_pinned() looks at a
            # storage's start, so views there must not share the pinned one's.
            self._pageable = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=pin_bytes)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """1D ``torch.uint8`` view of ``[offset, offset + nbytes)``, which must lie wholly in
        the pinned part or wholly in the pageable rest."""
        pinned = self.pinned_bytes
        if 0 < pinned < self.nbytes and offset >= pinned:
            return self._pageable[offset - pinned : offset - pinned + nbytes]
        if offset < pinned < offset + nbytes:
            raise AssertionError(f"view [{offset}, {offset + nbytes}) straddles the pinned boundary {pinned}")
        return self.tensor[offset : offset + nbytes]

    def own_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Like :meth:`view`, but over a storage of its own that holds exactly these bytes.

        Pickling, ``torch.save`` or ``share_memory_()`` of a tensor over it then
        sees ``nbytes`` bytes, not the whole block; the block stays mapped
        while the view lives.
        """
        pinned = self.pinned_bytes
        if offset < pinned < offset + nbytes:
            raise AssertionError(f"view [{offset}, {offset + nbytes}) straddles the pinned boundary {pinned}")
        return torch.frombuffer(self._mapping, dtype=torch.uint8, offset=offset, count=nbytes)

    def free(self) -> None:
        """Drops the pool's references to the block. Idempotent.

        The block is unpinned and unmapped when the last tensor viewing it
        is gone (see :class:`_Mapping`): at once if the state is resident,
        later if the caller still holds host views.
        """
        self.tensor = None  # type: ignore[assignment]
        self._pageable = None
        self._mapping = None
