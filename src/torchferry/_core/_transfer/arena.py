"""Device-side allocation for a reload: one segment instead of one ``cudaMalloc`` per storage.

[Note: reload arena]
After ``torch.cuda.empty_cache()`` (which verl calls after every offload) the
caching allocator holds no memory, so re-allocating N storages costs N
``cudaMalloc`` calls on the reload's critical path, and N ``cudaFree`` calls in
the next ``empty_cache()``: 12-87 ms for 339 storages of 30.5 GB against
1.2-3.7 ms for one allocation of the same total, measured on an H200
(``git show 75cc57c:benchmarks/results/probe_reload_h200_qwen2.5-7b-unsharded_2026-11-30.json``).

So we allocate one block the size of all large storages (the allocator's
large pool: > 1 MiB, sizes rounded to 512 B) and free it at once: it stays
cached as one segment, and the storages' ``resize_`` calls carve it front to
back (best fit, split rule of ``c10/cuda/CUDACachingAllocator.cpp``). Free
blocks already cached in partly used segments (there always are some in a
training process: 40-260 MB measured after ``empty_cache()`` in a 7B FSDP2
run) may take some storages first, by best fit; the arena's unused tail is then
larger. ``seal()`` allocates a filler over whatever tail is left (> 1 MiB), so
that no foreign allocation can land in the segment and keep it alive after the
next offload. When the state is offloaded again every block of the segment is
free, it coalesces, and ``empty_cache()`` returns it with one ``cudaFree``.

An earlier rule skipped the arena whenever any cached free block could hold a
storage; with FSDP2 that was always the case, so every reload paid one
``cudaMalloc`` per storage: 0.15-0.17 s of host time for 299 storages of
35 GB (``reload()`` returned only after it), against 0.5 ms for 300
allocations carved from a seeded arena, both measured on an H200
(``git show 75cc57c:benchmarks/results/probe_alloc_h200_2026-11-30.json``,
``git show 75cc57c:benchmarks/results/probe_prefetch_host_h200_2026-11-30.json``). A layer-wise reload waits for
that host time before the first forward can even be queued.

[Note: a reload takes the blocks its offload freed]
An offload frees the device storages under its D2H event (``record_stream``):
the allocator hands those blocks out again only once it has seen the event
complete. A reload issued right behind its own offload (``offload(); reload()``)
seeded its arena while the blocks still waited, so it took other cached blocks
or a new segment. In ``test_thousand_cycles_hold_memory_flat``
(``tests/gpu/test_reliability.py``) reserved memory grew 805 MB over 1,000
back-to-back cycles of a 134 MB state after the rest of the GPU tier
(``benchmarks/results/soak_gpu_h200x1_2026-12-01_dc0385b.json``). So
``seed(after=...)`` first waits on the host, when it has not completed, for
the ferry's own last offload at an event recorded after the allocator's events
for the freed blocks (``release()`` in ``copies.py``; the allocator looks at
its events on the next allocation). The reload's H2D copies read the host slots
that offload fills, so they could not start before it anyway; the host loses
only its lead in queueing them. With the rule the same test, after the same
tier, grew by 0 bytes on an H200
(``benchmarks/results/soak_gpu_h200x1_2026-12-02_2a0919f.json``);
``test_back_to_back_reload_takes_the_blocks_its_offload_freed`` holds it.
Not done where the arena does not apply (a swap's release schedule frees
storages as its copies go).

Only done with the native allocator and default rounding/splitting (no
``max_split_size_mb``, ``roundup_power2_divisions`` or ``expandable_segments``
in ``PYTORCH_CUDA_ALLOC_CONF``), where those rules hold; otherwise storages
are allocated one by one, as before.
"""

from __future__ import annotations

import functools

import torch

from .._api.env import ARENA_ENV, allocator_conf, reload_arena

__all__ = ["ARENA_ENV", "ReloadArena", "arena_supported"]


_SMALL_SIZE = 1 << 20  # kSmallSize: blocks up to 1 MiB go to the small pool
_ROUND_LARGE = 2 << 20  # kRoundLarge: large segments are multiples of 2 MiB
_MIN_BLOCK = 512  # kMinBlockSize: request sizes are rounded to 512 B
_MIN_ARENA = 64 << 20  # below this the per-storage cost is negligible


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@functools.lru_cache(maxsize=1)
def arena_supported() -> bool:
    """True with the native CUDA caching allocator at default rounding and splitting, unless
    ``TORCHFERRY_RELOAD_ARENA`` is off.

    Raises:
        ValueError: ``TORCHFERRY_RELOAD_ARENA`` is neither on nor off (not cached: every call raises).
    """
    if not reload_arena():
        return False
    conf = allocator_conf()
    if any(k in conf for k in ("max_split_size_mb", "roundup_power2_divisions", "expandable_segments:true",
                               "backend:cudamallocasync")):
        return False
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):
        return False


class ReloadArena:
    """Seeds the allocator with one segment for the large storages of a reload.

    Usage: ``arena = ReloadArena.seed(device, sizes)`` before the storages are
    re-allocated on the current stream, ``arena.seal(storages)`` after. Keep the
    arena object while the state is resident; drop it after the next offload
    released the storages.
    """

    def __init__(self, base: int, total: int, device: torch.device) -> None:
        self._tail = base + total  # end of the bytes the storages can fill
        self._total = total
        self._device = device
        self._fillers: list[torch.Tensor] = []  # 1D uint8 on device: the segment's tail

    @classmethod
    def seed(cls, device: torch.device, sizes: list[int],
             after: torch.cuda.Event | None = None) -> ReloadArena | None:
        """Allocates and frees one block for every large storage in ``sizes`` (bytes).

        Args:
            device: the reload's device.
            sizes: every storage's size in bytes.
            after: the ferry's own last offload event, waited for on the host first if it has
                not completed ([Note: a reload takes the blocks its offload freed]).

        Returns ``None`` (and allocates nothing) when the arena does not apply:
        unsupported allocator settings, little to allocate, or no room.
        """
        if device.type != "cuda" or not arena_supported():
            return None
        large = [r for r in (_round(n, _MIN_BLOCK) for n in sizes if n) if r > _SMALL_SIZE]
        total = sum(large)
        if total < _MIN_ARENA:
            return None
        if after is not None and not after.query():
            after.synchronize()
        try:
            block = torch.empty(total, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            return None
        base = block.data_ptr()
        del block  # cached as one free segment, carved by the resize_ calls that follow
        return cls(base, total, device)

    def seal(self, storages: list[torch.UntypedStorage] | None = None) -> None:
        """Takes the segment's unused tail, after the storages took their blocks.

        Args:
            storages: the storages just allocated; those inside the arena tell
                where its tail starts (``None``: assume they filled it exactly).
        """
        end = self._tail  # base + total
        base = end - self._total
        tail_start = end
        if storages is not None:
            tail_start = base
            for st in storages:
                n = st.nbytes()
                p = st.data_ptr() if n else 0
                if base <= p < end:
                    tail_start = max(tail_start, p + _round(n, _MIN_BLOCK))
        seg_end = base + _round(self._total, _ROUND_LARGE)
        filler = seg_end - tail_start
        if filler <= _SMALL_SIZE:  # nothing of the large pool fits there
            return
        for _ in range(4):  # best fit may first hand out a foreign free block of the same size
            try:
                t = torch.empty(filler, dtype=torch.uint8, device=self._device)
            except torch.OutOfMemoryError:
                return
            self._fillers.append(t)
            if t.data_ptr() == tail_start:
                return

    def release(self) -> None:
        self._fillers.clear()
