"""Switch points: bulk copies cut into pieces with a separator the copy engine yields at.

[Note: switch points]
A GPU has one copy engine per direction, and every stream's host-device copies
share it. The engine does not interleave the copies of several streams: it
takes another stream's copy only at a few points of the queue it is working
through, not at the boundary between two large copies nor at an event. So a
small copy that the compute stream issues while a reload is queued (FSDP2's
all-gather copy-out and reduce-scatter copy-in put 34 KiB and 1.8 MiB of
metadata into pinned memory and copy it to the device on the compute stream,
``pack_vecs`` in PyTorch's ``aten/src/ATen/native/cuda/TensorShape.cu``) waits
behind the queue, where the engine does not switch: in a layer-wise reload on
one H200 (compute-rich Qwen2.5-1.5B step, torch 2.11) a 34 KiB copy on the
compute stream at each unit's forward waited p90 4.56 ms against 0.005 ms
alone. Stream priority does not change copy-engine order (meta-pytorch/torchrec
PRs #4303, #4315, #4339; NVIDIA/cudf #15620 reports a 51 KB copy delayed 12 ms
behind a ~200 MB one). The engine does take another stream's copy after a copy
of 1 KiB on the copy stream: the switch points below.

Whether a stream's small copy meets this depends on the stream: on one H200
(torch 2.11; ``benchmarks/switch_points.py``,
``benchmarks/results/switch_points_h200x1_2026-12-01.json``) a 34 KiB copy on
the default stream beside an 8 GB copy on a fresh stream did not wait at all
(0.005 ms), while in the bench's layer-wise reload a 34 KiB copy on the compute
stream at each unit's forward waited p50 0.23 ms, p90 0.29 with 16 MiB switch
points (``benchmarks/results/bench_qwen2.5-1.5b_h200x1_2026-12-01.json``).
The pieces cost copy-engine time: an 8 GB H2D copy ran at 55.3 GB/s
whole, 53.2 in 16 MiB pieces with a 1 KiB separator, 53.9 in 24 MiB and 54.3
in 32 MiB ones; D2H at 55.3, 54.7, 54.9 and 55.0.

Where switch points apply (on CUDA, unless ``TORCHFERRY_SWITCH_BYTES=0``) every bulk
copy that runs beside other work goes through :meth:`SwitchPoints.copy` (a
layer-wise reload's groups, every D2H copy: whole-set offloads, packed chunks,
an offload during forward, and a whole-set reload issued from another stream
than the device's default one, as the Dock's prefetch); a whole-set reload from
the default stream, which that stream waits for in full, copies whole. The
pieces are of at most the interval, and after every interval copied on that
stream (counted across calls: the engine sees one queue) a :data:`SEPARATOR_BYTES`
copy of the piece's first bytes again (same source, same destination: no
scratch memory).

They are on by default on CUDA, every 16 MiB for H2D and 32 MiB for D2H
(``TORCHFERRY_SWITCH_BYTES`` sets both; ``0`` turns them off).
Issued from the caller's thread, a layer-wise reload in pieces cost more than
it gave: on one H200 (compute-rich Qwen2.5-1.5B step, commit 4d8b770) 16 MiB
switch points held the compute stream's 34 KiB copy to p90 0.21 ms against
4.56 ms without, but issuing the reload in pieces took 0.246 s of host time
against 0.095 s, ahead of the first forward, and the exposed reload rose to
0.296 s/step from 0.146
(``benchmarks/results/bench_qwen2.5-1.5b-compute-rich_h200x1_2026-12-01.json``
against
``benchmarks/results/bench_qwen2.5-1.5b-compute-rich-no-switch-points_h200x1_2026-12-01.json``).
So a reload queued at once is issued from a thread ([Note: copies issued off
the caller's thread] in ``_schedules/issuer.py``).
[Note: whole copies where the caller waits]
The driver queues a stream's commands in a buffer of bounded size; once it is
full, the next ``cudaMemcpyAsync`` blocks the host until the copy engine has
worked through enough of it. The pieces and separators double an offload's
commands: on one H200 (torch 2.11, a probe at 617698b whose output is not kept)
``offload()`` of 24.7 GB in 1,464 storages (the shapes of a Qwen2.5-1.5B model,
its gradients and AdamW state) returned after 255 ms of its 452 with switch
points and after 13-24 ms without, at the same rate (54.6 and 54.9 GB/s);
``tests/gpu/test_switch_points.py`` checks the effect on every GPU it runs on
(under :func:`whole_copies` an offload of 1,536 storages returns before half of
its copies ran). Where the caller waits for the copies at once,
nothing of its own can run beside them for the pieces to serve, and the
blocked host is all they give: the framework helpers (``integrations``: verl's
and SkyRL's offload helpers make the caller's stream wait, AReaL's
``offload()`` waits for the copies, SkyRL synchronises) run their moves under
:func:`whole_copies`, so that their offloads return at once and the host work
after them (AReaL's garbage collection) runs beside the copies. It applies to
the calling thread only (a ``ContextVar``): a layer-wise reload's issuer
thread keeps its switch points.

``tests/gpu/test_switch_points.py`` measures the mechanism (a small copy's wait
on 16 streams, the pieces' rate) on the GPU it runs on, so a driver that
changes it is caught.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator

import torch


__all__ = ["D2H_SWITCH_BYTES", "SEPARATOR_BYTES", "SWITCH_BYTES", "SwitchPoints", "default_interval",
           "interval", "whole_copies"]

_whole = contextvars.ContextVar("torchferry_whole_copies", default=False)


@contextlib.contextmanager
def whole_copies():
    """Within it, this thread's bulk copies skip the switch points (for a caller that waits for them
    at once: [Note: whole copies where the caller waits])."""
    token = _whole.set(True)
    try:
        yield
    finally:
        _whole.reset(token)

SWITCH_BYTES = 16 << 20  # H2D bytes between two switch points: ~0.3 ms at 55 GB/s (see the Note)
# D2H: 32 MiB, ~0.6 ms (16 MiB pieces cost 1.1% of the rate in the Note's run and 2.1% once in the
# GPU tier at 1ed056c; 32 MiB ones 0.5%); the small D2H copies beside an offload are rarer.
D2H_SWITCH_BYTES = 32 << 20
SEPARATOR_BYTES = 1 << 10  # the separator copy: 1 KiB (an 8 KiB copy is not a switch point)


def default_interval(direction: str) -> int:
    """The measured interval of ``"h2d"`` (:data:`SWITCH_BYTES`) or ``"d2h"`` (:data:`D2H_SWITCH_BYTES`), bytes."""
    return D2H_SWITCH_BYTES if direction == "d2h" else SWITCH_BYTES


def interval(direction: str, setting: int | None) -> int:
    """Bytes between switch points of ``direction``'s copy stream: ``setting`` (``CoreSettings.switch_bytes``,
    from ``TORCHFERRY_SWITCH_BYTES``; ``0``: none), ``None``: the measured interval (:func:`default_interval`)."""
    return default_interval(direction) if setting is None else setting


class SwitchPoints:
    """The switch points of one copy stream (see [Note: switch points]).

    Args:
        device: the CUDA device.
        direction: ``"h2d"`` or ``"d2h"``: the direction of the separator copy.
        every: bytes between switch points (``0``: none); default the measured interval of ``direction``
            (:func:`default_interval`) on CUDA, none on the CPU.

    Attributes:
        every: bytes between two switch points (``0``: off).
        separators: separator copies issued so far (tests, the bench).
    """

    def __init__(self, device: torch.device, direction: str, every: int | None = None) -> None:
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"torchferry: SwitchPoints direction must be 'h2d' or 'd2h', got {direction!r}")
        self.device, self.direction = device, direction
        # The CPU has no copy engine to share: its copies never need switch points.
        self.every = (default_interval(direction) if device.type == "cuda" else 0) if every is None else every
        self.separators = 0
        self._since = 0  # bytes queued on the stream since the last switch point
        self._lock = threading.Lock()  # two threads may queue on one stream (an issuer thread and a caller)

    def _separate(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The separator: the first :data:`SEPARATOR_BYTES` of the piece just copied, copied again
        (the same bytes to the same place, in stream order: no scratch memory, nothing changes)."""
        n = min(SEPARATOR_BYTES, src.numel())
        dst[:n].copy_(src[:n], non_blocking=True)
        self.separators += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream (the copy stream), in pieces
        with switch points. ``dst`` and ``src``: 1D uint8 tensors of one length, one on the host
        (pinned) and one on the device."""
        n = src.numel()
        every = self.every
        if not every or _whole.get():
            dst.copy_(src, non_blocking=True)
            return
        with self._lock:
            self._pieces(dst, src, n, every)

    def _cuts(self, n: int, every: int) -> Iterator[tuple[int, int, bool]]:
        """``(offset, bytes, separator after)`` of each piece of an ``n``-byte copy (under the lock),
        counting the stream's bytes since its last switch point."""
        off = 0
        if self._since >= every:  # the interval was lowered since the last copy
            self._since = 0
        while off < n:
            take = min(n - off, every - self._since)
            self._since += take
            separate = self._since >= every
            if separate:
                self._since = 0
            yield off, take, separate
            off += take

    def _pieces(self, dst: torch.Tensor, src: torch.Tensor, n: int, every: int) -> None:
        for off, take, separate in self._cuts(n, every):
            d, s = (dst, src) if off == 0 and take == n else (dst[off:off + take], src[off:off + take])
            d.copy_(s, non_blocking=True)
            if separate:
                self._separate(d, s)

    def copy_by_pointer(self, queue: Callable[[int, int, int], None], dst: int, src: int, n: int) -> None:
        """As :meth:`copy`, for ``n`` bytes from address ``src`` to address ``dst``, each piece and
        separator queued by ``queue(dst, src, nbytes)`` ([Note: copies queued by pointer] in
        ``driver``); the switch points are counted with :meth:`copy`'s, on one stream."""
        every = self.every
        if not every or _whole.get():
            queue(dst, src, n)
            return
        with self._lock:
            for off, take, separate in self._cuts(n, every):
                queue(dst + off, src + off, take)
                if separate:
                    queue(dst + off, src + off, min(SEPARATOR_BYTES, take))
                    self.separators += 1
