"""Device-side allocation for a reload: one segment instead of one ``cudaMalloc`` per storage.

[Note: reload arena]
After ``torch.cuda.empty_cache()`` (which verl calls after every offload) the
caching allocator holds no memory, so re-allocating N storages costs N
``cudaMalloc`` calls on the reload's critical path, and N ``cudaFree`` calls in
the next ``empty_cache()``: 12-87 ms for 339 storages of 30.5 GB against
1.2-3.7 ms for one allocation of the same total, measured on an H200
(``git show 75cc57c:benchmarks/results/probe_reload_h200_qwen2.5-7b-unsharded_2026-11-30.json``).

So we allocate one block the size of the large storages (the allocator's
large pool: > 1 MiB, sizes rounded to 512 B) and free it at once: it stays
cached as one segment, and the storages' ``resize_`` calls carve it front to
back (best fit, split rule of ``c10/cuda/CUDACachingAllocator.cpp``). When
the state is offloaded again every block of the segment is free, it coalesces,
and ``empty_cache()`` returns it with one ``cudaFree``.

An earlier rule skipped the arena whenever any cached free block could hold a
storage; with FSDP2 that was always the case, so every reload paid one
``cudaMalloc`` per storage: 0.15-0.17 s of host time for 299 storages of
35 GB (``reload()`` returned only after it), against 0.5 ms for 300
allocations carved from a seeded arena, both measured on an H200
(``git show 75cc57c:benchmarks/results/probe_alloc_h200_2026-11-30.json``,
``git show 75cc57c:benchmarks/results/probe_prefetch_host_h200_2026-11-30.json``). A layer-wise reload waits for
that host time before the first forward can even be queued.

[Note: an arena only for what the cache cannot hold]
Free blocks already cached on the reload's stream (there always are some in a
training process: 40-260 MB after ``empty_cache()`` in a 7B FSDP2 run, and
more where a phase freed tensors without ``empty_cache()``: a rollout's KV
cache) take storages first, by best fit, before the arena: the arena is the
largest free block. An arena the size of every storage then kept an unused
tail, and ``seal()`` filled that tail so no other allocation could land there:
device memory allocated beside the state, which verl's own helpers (one
``cudaMalloc`` per tensor, after the cached blocks) never hold. In verl's step
order on one H100 (``tests/gpu/test_memory_beside_verl_cuda.py``) the log-prob
phase peaked at 8.16 GB against 4.93 GB with verl's helpers: a 3.22 GB filler
over an arena the cached blocks had made redundant. So :func:`arena_bytes`
replays the allocator's best fit over the cached free blocks
(:func:`free_blocks`, from the allocator's snapshot) and sizes the arena for
what they cannot hold, with itself among the blocks; none when that is under
64 MiB. ``seal()`` fills only a tail under one segment rounding (2 MiB); a
larger one (a replay the allocations did not follow) stays free, so the
reload never holds more than its storages. An arena the allocator served from
a cached block (no new segment) is not used.

[Note: an arena sized down]
:func:`arena_bytes` sizes the arena by replays: each adds what stayed unplaced and takes off the tail
left. Inserting the arena changes which block the best fit gives each storage, so the replays can
alternate: free blocks of 5.5, 3.5 and 300.4 MiB and storages of 197, 94 and 243 MiB went between an
arena that let the 243 MiB one go unplaced (243 MiB: the 197 MiB storage took it) and one of 442 MiB
with a 208 MiB tail, where 292 MiB places all three with none. When the best replay keeps a tail, sizes
between the need and it are tried too (every 2 MiB where that is at most 4,096 storages replayed, else
16), each also less its own tail. Over 1,500 random caches and storages the arena chosen is then within
1% of the smallest that places every storage with no tail (``tests/cpu/test_pool.py``).

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
for the freed blocks (``release()`` in ``release.py``; the allocator looks at
its events on the next allocation). The reload's H2D copies read the host slots
that offload fills, so they could not start before it anyway; the host loses
only its lead in queueing them. With the rule the same test, after the same
tier, grew by 0 bytes on an H200
(``benchmarks/results/soak_gpu_h200x1_2026-12-02_2a0919f.json``);
``test_back_to_back_reload_takes_the_blocks_its_offload_freed`` holds it.
Not done where the arena does not apply (a swap's release schedule frees
storages as its copies go).

[Note: no arena under a layer-wise reload]
A layer-wise reload (``reload(prefetch=...)``, ``_schedules/prefetch.py``: verl's
``optimizer_at_step`` and ``layerwise_reload``) allocates its storages one by one from
the caching allocator, with no arena, and its H2D stream waits for the caller's stream
after them ([Note: reload allocates on the caller's stream] in ``h2d.py``). With an
arena seeded before that wait, verl 0.9.1's FSDP1 actor (Qwen2.5-1.5B, one H100, the
optimizer state reloaded at ``optimizer.step()``) trained to NaN: 8 of 8 processes
across four runs, after 1 to 9 steps bit-identical to verl's; a process with no arena
(the bench patched for the diagnosis, not kept) stayed bit-identical for 13 steps
(``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp-full-compute-rich_h100x1_2026-12-06_1e33954_arena-bisect.json``,
strategy ``noarena``), as did one with ``optimizer_at_step`` off (whole reloads, arena
on) for 12 (``..._1e33954_at-step-bisect.json``, strategy ``noat``). The storage at the
arena's base (the embedding's AdamW state, 933.5 MB, issued first) was wrong from byte
1,024 to at most 25 KB when the reload completed. The cause: verl's ``full_determinism``
turns on ``torch.use_deterministic_algorithms(True)``, under which ``torch.empty`` on a
GPU also queues a kernel filling its memory
(``torch.utils.deterministic.fill_uninitialized_memory``); the arena's seed, a
``torch.empty`` of the whole arena, was filled with 0xFF (NaN as fp32) on the caller's
stream after the H2D stream had waited for it, so the fill raced the first copy (the
first KiB was right: the piece's separator, [Note: switch points], copied it again).
Arenas are now allocated with no kernel (``torch.UntypedStorage``: :func:`_unfilled`).
With such an arena seeded, allocated into and sealed before the wait (ffc6d8a), the path
was exact (``tests/gpu/test_deterministic_fill_cuda.py`` passed; the FSDP1 actor
bit-identical over 11 rounds,
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp-full-compute-rich_h100x1_2026-12-06_eba85c2_micro-8-8.json``)
but bought nothing and cost memory: with LoRA (one H100, 6.2 GB per reload) the log-prob
phase's calls took 0.159 s against 0.144 s without it, and the rollout found 185 MB less
free than under verl's helpers (84.05 against 84.24 GB, ``free_alone_bytes``; equal
without it) (``..._fsdp2-lora-compute-rich_h100x1_2026-12-06_d133bc4_micro-8-8.json``
against ``..._28d93dd_micro-8-8.json``). Its one gain: the offload's ``empty_cache()`` freed one
segment, not one per storage (LoRA's offload calls 0.043 s with it, 0.083 s without at 2a41efd,
``..._2a41efd_micro-8-8.json``, on another H100 whose verl offloads took 1.4x longer too); the
rollout's memory comes first. The calls' host time is spent elsewhere
([Note: the calls timed] in ``benchmarks/verl_step/timing.py`` profiles them). So the
layer-wise path keeps no arena; ``tests/gpu/test_deterministic_fill_cuda.py`` holds it
exact under the fill with the caller's stream held up.

[Note: allocator settings read now]
Only done with the native allocator and default rounding/splitting, where those
rules hold; otherwise storages are allocated one by one, as before.
:func:`arena_supported` read ``PYTORCH_CUDA_ALLOC_CONF`` once per process
(cached) and looked for substrings: it missed settings changed at run time
(verl 0.9.1's ``set_expandable_segments`` in ``verl/utils/device.py`` calls
``torch.cuda.memory._set_allocator_settings("expandable_segments:True")``, and
``verl/workers/engine_workers.py`` turns it off and on again around the rollout,
after a first reload may have asked), spellings with spaces or capitals
(``"expandable_segments: True"``), and options it did not list. So every call
reads the settings now: the environment's (``PYTORCH_CUDA_ALLOC_CONF``, then
``PYTORCH_ALLOC_CONF``, read with the ferry's settings at ``Ferry()``,
``CoreSettings.allocator_conf``: torch reads them once too), with those the allocator was last given at run time
over them where torch tells them (``torch._C._accelerator_getAllocatorSettings``,
which returns the last string set, or the environment's before any: an option
an earlier call set and the last one left out is not seen; a torch without it
has the environment only). They are parsed as ``key:value`` pairs
(spaces dropped, lower case, a bracketed list one value), and the arena is used
only when every key is one known not to change the device pool's rounding,
splitting or segments (:data:`_NEUTRAL`), ``expandable_segments`` is false and
``backend`` native: an option this module does not know turns it off
(``tests/cpu/test_pool.py::test_reload_arena_reads_the_allocator_settings_now``).
Expandable segments made while they were on outlive the setting; the replay
models fixed ``cudaMalloc``'d segments, which they are not, so :func:`free_blocks`
leaves their free blocks out (``is_expandable`` in the snapshot).
"""

from __future__ import annotations

import bisect
import re

import torch

from .._api.settings import CoreSettings
from .._state.fsdp import allocator_settings_set

__all__ = ["ReloadArena", "allocator_settings", "arena_bytes", "arena_supported", "best_fit",
           "free_blocks", "parse_allocator_settings"]


_SMALL_SIZE = 1 << 20  # kSmallSize: blocks up to 1 MiB go to the small pool
_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: a smaller large request gets a kLargeBuffer segment
_LARGE_BUFFER = 20 << 20  # kLargeBuffer
_ROUND_LARGE = 2 << 20  # kRoundLarge: large segments are multiples of 2 MiB
_MIN_BLOCK = 512  # kMinBlockSize: request sizes are rounded to 512 B
_MIN_ARENA = 64 << 20  # below this the per-storage cost is negligible
_SIZING_ROUNDS = 6  # replays of the best fit while sizing an arena
_GRID = 16  # arenas tried at least between the need and a sized arena that keeps a tail ([Note: an arena sized down])
_REPLAYED = 4096  # requests replayed at most in that search, where more than _GRID arenas fit in it
# allocator options that leave the device pool's rounding, splitting and segments as the replay has them
# ([Note: allocator settings read now]): the garbage collection of cached blocks, the lock, the host
# (pinned) pool's, graph capture's and the memory fraction
_NEUTRAL = frozenset({"garbage_collection_threshold", "release_lock_on_cudamalloc", "release_lock_on_malloc",
                      "pinned_use_cuda_host_register", "pinned_use_host_register", "pinned_num_register_threads",
                      "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
                      "pinned_max_round_threshold_mb", "graph_capture_record_stream_reuse",
                      "per_process_memory_fraction"})
_DEFAULTS = {"expandable_segments": "false", "backend": "native"}  # options neutral at these values


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _segment_bytes(n: int) -> int:
    """The segment the allocator ``cudaMalloc``s for a large request of ``n`` bytes (rounded)."""
    return _LARGE_BUFFER if n < _MIN_LARGE_ALLOC else _round(n, _ROUND_LARGE)


def best_fit(free: list[int], sizes: list[int], arena: int = 0) -> tuple[int, int]:
    """Replays the caching allocator's large pool for one stream: each request, in order, takes the
    smallest free block that holds it (split when more than 1 MiB is left, the rest staying free), or
    a new segment (:func:`_segment_bytes`, its rest free too).

    Args:
        free: the sizes of the free cached blocks (bytes).
        sizes: the requests in allocation order (bytes, each > 1 MiB and a multiple of 512).
        arena: the size of one more free block, the arena (bytes; 0: none).

    Returns:
        The bytes of the requests no cached block or arena held (those a new ``cudaMalloc`` served, or the
        rest of a segment made for an earlier one), and the arena's bytes
        left free at the end (0 without an arena, or when a request took its rest).
    """
    ARENA = -1  # the arena's tag; cached blocks are tagged by their index, new segments' rests below -1
    blocks = sorted((n, i) for i, n in enumerate(free))  # (size, tag): smallest first, as the allocator's set
    if arena:
        bisect.insort(blocks, (arena, ARENA))
    unplaced = 0
    for k, n in enumerate(sizes):
        i = bisect.bisect_left(blocks, (n, ARENA - len(sizes) - 1))
        if i == len(blocks):
            unplaced += n
            rest, tag = _segment_bytes(n) - n, ARENA - 1 - k
        else:
            size, tag = blocks.pop(i)
            rest = size - n
            if tag < ARENA:  # the rest of a segment made for an earlier request: new memory too
                unplaced += n
        if rest > _SMALL_SIZE:
            bisect.insort(blocks, (rest, tag))
    tail = next((n for n, tag in blocks if tag == ARENA), 0)
    return unplaced, tail


def arena_bytes(free: list[int], sizes: list[int]) -> int:
    """The arena for a reload: the segment the storages that no cached free block holds fill, sized
    with itself among the blocks (:func:`best_fit`); 0 when that is under 64 MiB.

    Args:
        free: the sizes of the cached free blocks of the reload's stream (bytes).
        sizes: the large storages' sizes in allocation order (bytes, rounded to 512).

    See [Note: an arena only for what the cache cannot hold].
    """
    need, _ = best_fit(free, sizes)
    if need < _MIN_ARENA:
        return 0
    best, best_score, size = 0, None, need
    for _ in range(_SIZING_ROUNDS):
        segment = _round(size, _ROUND_LARGE)
        unplaced, tail = best_fit(free, sizes, segment)
        score = (tail >= _ROUND_LARGE, unplaced, tail)  # a tail first: it is memory held; then cudaMallocs
        if best_score is None or score < best_score:
            best, best_score = segment, score
        if unplaced == 0 and tail < _ROUND_LARGE:
            break
        size = segment + unplaced - tail // _ROUND_LARGE * _ROUND_LARGE
        if size < _MIN_ARENA:
            break
    if best_score is not None and best_score[0]:  # a tail held: see [Note: an arena sized down]
        span = best - need
        tries = max(_GRID, min(span // _ROUND_LARGE, _REPLAYED // len(sizes)))
        step = max(_ROUND_LARGE, _round(span // tries, _ROUND_LARGE))
        for size in [*range(need, best, step), best - best_score[2]]:
            segment = _round(size, _ROUND_LARGE)
            while True:  # the candidate, then the candidate less its own tail while that shrinks it
                unplaced, tail = best_fit(free, sizes, segment)
                score = (tail >= _ROUND_LARGE, unplaced, tail)
                if score < best_score or (score == best_score and segment < best):
                    best, best_score = segment, score
                smaller = _round(segment - tail // _ROUND_LARGE * _ROUND_LARGE, _ROUND_LARGE)
                if unplaced or smaller >= segment:
                    break
                segment = smaller
    return best if best >= _MIN_ARENA else 0


def free_blocks(device: torch.device, stream: int) -> list[int]:
    """The sizes (bytes) of the free blocks the caching allocator holds in its large pool for ``stream``
    (a ``cudaStream_t`` as ``torch.cuda.Stream.cuda_stream``) on ``device``, from its snapshot; not those of
    expandable segments ([Note: allocator settings read now])."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a torch without the switch
        segments = torch.cuda.memory_snapshot()
    return [b["size"] for seg in segments
            if seg.get("device") == device.index and seg.get("segment_type") == "large"
            and seg.get("stream") == stream and tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0)
            and not seg.get("is_expandable", False)
            for b in seg["blocks"] if b["state"] == "inactive"]


def parse_allocator_settings(conf: str) -> dict[str, str]:
    """``key:value`` pairs of an allocator settings string, keys and values in lower case without spaces,
    a later key over an earlier one; a bracketed value (``roundup_power2_divisions:[256:1,>:4]``) is one."""
    out: dict[str, str] = {}
    for item in re.split(r",(?![^\[]*\])", "".join(conf.split()).lower()):
        if item:
            key, _, value = item.partition(":")
            out[key] = value
    return out


def allocator_settings(conf: str) -> dict[str, str]:
    """The caching allocator's settings now, parsed (:func:`parse_allocator_settings`): the environment's
    (``conf``: ``CoreSettings.allocator_conf``), with those last set at run time over them where torch tells
    them ([Note: allocator settings read now])."""
    settings = parse_allocator_settings(conf)
    current = allocator_settings_set()  # None: the environment only
    if current is not None:
        settings.update(parse_allocator_settings(current))
    return settings


def arena_supported(settings: CoreSettings) -> bool:
    """True with the native CUDA caching allocator at default rounding, splitting and segments (the
    environment's in ``settings.allocator_conf``, those set at run time read at each call: [Note: allocator
    settings read now]), unless ``settings.reload_arena`` (``TORCHFERRY_RELOAD_ARENA``) is off."""
    if not settings.reload_arena:
        return False
    for key, value in allocator_settings(settings.allocator_conf).items():
        if key not in _NEUTRAL and _DEFAULTS.get(key) != value:
            return False
    try:
        return torch.cuda.memory.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):
        return False


def _unfilled(nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """``nbytes`` of device memory from the caching allocator with no kernel queued on them: under
    ``torch.use_deterministic_algorithms(True)`` a ``torch.empty`` also fills its memory on the current
    stream ([Note: no arena under a layer-wise reload])."""
    return torch.UntypedStorage(nbytes, device=device)


class ReloadArena:
    """Seeds the allocator with one segment for the large storages of a reload.

    Usage: ``arena = ReloadArena.seed(device, sizes, settings)`` before the storages are
    re-allocated on the current stream, ``arena.seal(storages)`` after. Keep the
    arena object while the state is resident; drop it after the next offload
    released the storages.
    """

    def __init__(self, base: int, total: int, device: torch.device) -> None:
        self._tail = base + total  # end of the bytes the storages can fill
        self._total = total
        self._device = device
        self._fillers: list[torch.UntypedStorage] = []  # on the device: the segment's tail

    @classmethod
    def seed(cls, device: torch.device, sizes: list[int], settings: CoreSettings,
             after: torch.cuda.Event | None = None) -> ReloadArena | None:
        """Allocates and frees one block for the large storages in ``sizes`` (bytes, in the order they
        are allocated) that the cached free blocks cannot hold ([Note: an arena only for what the cache
        cannot hold]).

        Args:
            device: the reload's device.
            sizes: every storage's size in bytes.
            settings: the ferry's settings (:func:`arena_supported`).
            after: the ferry's own last offload event, waited for on the host first if it has
                not completed ([Note: a reload takes the blocks its offload freed]).

        Returns ``None`` (and holds nothing) when the arena does not apply:
        unsupported allocator settings, little to allocate beyond what the cache holds, no room,
        or the allocator served it from a cached block.
        """
        if device.type != "cuda" or not arena_supported(settings):
            return None
        large = [r for r in (_round(n, _MIN_BLOCK) for n in sizes if n) if r > _SMALL_SIZE]
        if sum(large) < _MIN_ARENA:
            return None
        if after is not None and not after.query():
            after.synchronize()
        # An allocation processes the allocator's completed events: blocks freed under them are free now.
        _unfilled(1, device)
        total = arena_bytes(free_blocks(device, torch.cuda.current_stream(device).cuda_stream), large)
        if not total:
            return None
        reserved = torch.cuda.memory_reserved(device)
        try:
            block = _unfilled(total, device)
        except torch.OutOfMemoryError:
            return None
        base, new_segment = block.data_ptr(), torch.cuda.memory_reserved(device) - reserved >= total
        del block  # cached as one free segment, carved by the resize_ calls that follow
        return cls(base, total, device) if new_segment else None  # carved from a cached block: no arena

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
        if filler <= _SMALL_SIZE or filler >= _ROUND_LARGE:  # nothing of the large pool fits there, or the
            return  # storages did not follow the replay: left free (see the Note on what the cache cannot hold)
        for _ in range(4):  # best fit may first hand out a foreign free block of the same size
            try:
                t = _unfilled(filler, self._device)
            except torch.OutOfMemoryError:
                return
            self._fillers.append(t)
            if t.data_ptr() == tail_start:
                return

    def release(self) -> None:
        self._fillers.clear()
