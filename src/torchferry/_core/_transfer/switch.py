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
behind the whole queue: on one H200 (torch 2.11) a 34 KiB H2D copy waited
1235 ms behind one large copy, 1188-1194 ms behind back-to-back 64 MiB or
256 MiB pieces and 6.9 ms (p90 8.1) behind torchferry's per-unit storages,
against 0.04 ms alone; stream priority does not change copy-engine order
(meta-pytorch/torchrec PRs #4303, #4315, #4339; NVIDIA/cudf #15620 reports a
51 KB copy delayed 12 ms behind a ~200 MB one). The engine does take another
stream's copy after a copy of 1 KiB or a one-element kernel on the copy
stream (not after an 8 KiB copy or an event record): 16 MiB pieces with a
1 KiB copy after each held the small copy to 0.17 ms, 32 MiB pieces to 0.37 ms,
with the bulk at 53-55 GB/s.

So every bulk copy torchferry issues (whole-set offload and reload, packed
chunks, a layer-wise reload's groups, an offload during forward) goes through
:meth:`SwitchPoints.copy`: pieces of at most :data:`SWITCH_BYTES`, and after
every :data:`SWITCH_BYTES` copied on that stream (counted across calls: the
engine sees one queue) a :data:`SEPARATOR_BYTES` copy between two scratch
buffers of the same direction. The behaviour is the driver's, not a
documented guarantee: ``tests/gpu/test_switch_points.py`` measures a small
copy's latency with and without switch points on the GPU it runs on, so a
driver that changes it is caught, and ``torchferry bench`` reports it
(``small_h2d_latency_ms``). ``TORCHFERRY_SWITCH_BYTES=0`` turns them off.
"""

from __future__ import annotations

import os

import torch

__all__ = ["SEPARATOR_BYTES", "SWITCH_BYTES", "SWITCH_ENV", "SwitchPoints"]

SWITCH_ENV = "TORCHFERRY_SWITCH_BYTES"
SWITCH_BYTES = 16 << 20  # bytes between two switch points: ~0.3 ms at 55 GB/s (see the Note)
SEPARATOR_BYTES = 1 << 10  # the separator copy: 1 KiB (an 8 KiB copy is not a switch point)


def switch_bytes_from_env() -> int:
    """``TORCHFERRY_SWITCH_BYTES`` (bytes; ``0``: no switch points), default :data:`SWITCH_BYTES`.

    Raises:
        ValueError: not an integer >= 0.
    """
    raw = os.environ.get(SWITCH_ENV, "").strip()
    if not raw:
        return SWITCH_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"torchferry: {SWITCH_ENV} must be an integer >= 0 (bytes; 0 turns switch points off), "
                         f"got {raw!r}")
    return value


class SwitchPoints:
    """The switch points of one copy stream (see [Note: switch points]).

    Args:
        device: the CUDA device.
        direction: ``"h2d"`` or ``"d2h"``: the direction of the separator copy.
        every: bytes between switch points (``0``: none); default from the environment.

    Attributes:
        every: bytes between two switch points (``0``: off).
        separators: separator copies issued so far (tests, the bench).
    """

    def __init__(self, device: torch.device, direction: str, every: int | None = None) -> None:
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"torchferry: SwitchPoints direction must be 'h2d' or 'd2h', got {direction!r}")
        self.device, self.direction = device, direction
        self.every = switch_bytes_from_env() if every is None else every
        self.separators = 0
        self._since = 0  # bytes queued on the stream since the last switch point
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None

    def _separate(self) -> None:
        if self._host is None or self._dev is None:
            self._host = torch.zeros(SEPARATOR_BYTES, dtype=torch.uint8, pin_memory=True)
            self._dev = torch.zeros(SEPARATOR_BYTES, dtype=torch.uint8, device=self.device)
        if self.direction == "h2d":
            self._dev.copy_(self._host, non_blocking=True)
        else:
            self._host.copy_(self._dev, non_blocking=True)
        self.separators += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream (the copy stream), in pieces
        with switch points. ``dst`` and ``src``: 1D uint8 tensors of one length, one on the host
        (pinned) and one on the device."""
        n = src.numel()
        every = self.every
        if not every:
            dst.copy_(src, non_blocking=True)
            return
        off = 0
        while off < n:
            take = min(n - off, every - self._since)
            if off == 0 and take == n:
                dst.copy_(src, non_blocking=True)
            else:
                dst[off:off + take].copy_(src[off:off + take], non_blocking=True)
            off += take
            self._since += take
            if self._since >= every:
                self._separate()
                self._since = 0
