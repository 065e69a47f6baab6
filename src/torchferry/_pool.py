"""The host pool: one exact-size host block, cut into slots (``_packing.layout``), reused every cycle."""

from __future__ import annotations

import torch

from ._host_memory import HostBuffer

__all__ = ["HostPool"]

class HostPool:
    """Persistent host memory for one ferry.

    The block is allocated at the first offload, sized exactly to the layout
    (not rounded to a power of two), pinned when the ferry's device is a GPU,
    and kept for every later cycle. It only grows when the state grows (for
    example when gradients or optimizer state appear after the first step).

    Attributes:
        pin: whether blocks are registered with the CUDA driver.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._buffer: HostBuffer | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held (0 before the first offload or after ``release``)."""
        return 0 if self._buffer is None else self._buffer.nbytes

    @property
    def pin_seconds(self) -> float:
        """Host seconds the current block took to allocate, touch and pin."""
        return 0.0 if self._buffer is None else self._buffer.pin_seconds

    def reserve(self, nbytes: int) -> None:
        """Makes the pool hold at least ``nbytes``; a no-op when it already does.

        Must only be called while no slot holds live state (the old block is
        freed before the new one is mapped, so that growing does not need both).

        Raises:
            RuntimeError: host memory could not be allocated or pinned; the
                pool is then empty.
        """
        if nbytes <= self.nbytes:
            return
        self.release()
        self._buffer = HostBuffer(nbytes, pin=self.pin)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """1D ``torch.uint8`` view of ``nbytes`` bytes at ``offset`` of the block."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self._buffer is None or offset + nbytes > self._buffer.nbytes:
            raise AssertionError(f"slot [{offset}, {offset + nbytes}) outside the pool")
        return self._buffer.tensor[offset : offset + nbytes]

    def release(self) -> None:
        """Returns the block to the OS (unpinned first). Idempotent."""
        buf, self._buffer = self._buffer, None
        if buf is not None:
            buf.free()
