"""Host memory for the pool: page-aligned anonymous mappings, pinned in place.

Why not ``torch.empty(n, pin_memory=True)``: it goes through PyTorch's caching
host allocator, which rounds every block up to a power of two (measured on an
H200 host: 28.96 GB pinned for 15.23 GB of FSDP2 state, 1.90x,
``shared/anchors/fsdp.r0.json``) and pins at 1.9-2.6 GB/s
(``shared/anchors/pinning.json``). Here we map exactly the bytes asked for,
touch the pages (in parallel, through ATen's intra-op thread pool) and
register the range with ``cudaHostRegister``: 8 GiB pinned in 0.54 s with huge
pages in the same measurement.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["HostBuffer", "available_host_bytes", "in_host_pool"]

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable: the range counts as pinned for every CUDA context of
# the process, not only the one current at registration (CUDA runtime API docs).
_CUDA_HOST_REGISTER_PORTABLE = 0x01


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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

    def __del__(self) -> None:
        _live.pop(id(self), None)
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


# id(mapping) -> (start, end) of every live host block, to recognise pool memory.
_live: dict[int, tuple[int, int]] = {}


def in_host_pool(ptr: int) -> bool:
    """True if ``ptr`` lies in a torchferry host block (state offloaded by some ferry)."""
    return any(start <= ptr < end for start, end in _live.values())


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
    # Huge pages make the first touch and the registration several times
    # faster (shared/anchors/pinning.json); harmless where the OS says no.
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
    3.7 GB/s (``benchmarks/results/bench_qwen2.5-7b_h200x2`` first run).
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
    """One exact-size block of host memory, pinned when ``pin=True``.

    Attributes:
        tensor: 1D ``torch.uint8`` tensor of ``nbytes`` elements over the block.
        nbytes: size in bytes (the mapping itself is rounded to the page size).
        pinned: whether the block is registered with the CUDA driver.
        pin_seconds: host seconds spent touching and registering the block.

    Raises:
        RuntimeError: the mapping or the registration failed; the message names
            the bytes asked for and ``MemAvailable``. Nothing stays allocated.
    """

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        if nbytes <= 0:
            raise ValueError(f"HostBuffer needs a positive size, got {nbytes=}")
        self.nbytes = nbytes
        self.pinned = False
        t0 = time.perf_counter()
        mm = _map_anonymous(nbytes)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # 1D uint8; keeps `mm` alive
        _live[id(mm)] = (self.tensor.data_ptr(), self.tensor.data_ptr() + nbytes)
        self._mapping = mm
        _touch(self.tensor)
        if pin:
            self._register()
        self.pin_seconds = time.perf_counter() - t0
        logger.debug(
            "host buffer: %d bytes, pinned=%s, %.3f s", nbytes, self.pinned, self.pin_seconds
        )

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(
            self.tensor.data_ptr(), self.nbytes, _CUDA_HOST_REGISTER_PORTABLE
        )
        code = int(err[0] if isinstance(err, tuple) else err)
        if code != 0:
            self.free()
            raise RuntimeError(
                f"torchferry: cudaHostRegister of {self.nbytes} bytes "
                f"({self.nbytes / 1e9:.2f} GB) failed with CUDA error {code}; "
                f"available host memory: {_describe_available()}"
            )
        self.pinned = True
        self._mapping.pinned_ptr = self.tensor.data_ptr()

    def free(self) -> None:
        """Drops the pool's references to the block. Idempotent.

        The block is unpinned and unmapped when the last tensor viewing it
        is gone (see :class:`_Mapping`): at once if the state is resident,
        later if the caller still holds host views.
        """
        self.tensor = None  # type: ignore[assignment]
        self._mapping = None
