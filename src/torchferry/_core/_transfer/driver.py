"""Host-device copies queued by pointer through the CUDA driver API, without a tensor op.

[Note: copies queued by pointer]
The issuer thread ([Note: copies issued off the caller's thread] in
``_schedules/issuer.py``) queues a reload's copies while the caller's thread
launches the step's kernels, and both need the GIL. A ``Tensor.copy_`` holds
it through the whole dispatch (views, checks, the ``cudaMemcpyAsync``), tens
of microseconds per piece, and CPython hands the GIL back to a thread waiting
for it only every ``sys.getswitchinterval()`` (5 ms) while the holder keeps
running Python: so the thread issuing a group's pieces held up the step's
launches. On one H200 (compute-rich Qwen2.5-1.5B step, commit 1ed056c) the
phases computed 0.199 s/step longer than resident with the copies issued from
the thread by ``copy_``, against 0.048 s/step issued synchronously (4d8b770).

Here a copy is one ``ctypes`` call of ``cuMemcpyHtoDAsync_v2`` /
``cuMemcpyDtoHAsync_v2`` on the pool's and the storage's pointers, on the
copy stream's handle; ``ctypes`` releases the GIL for the call, and the Python
between two calls is a few integer operations. What ``copy_`` would have done
besides the copy does not apply to these copies: the host side is the
ferry's pool (``mmap`` + ``cudaHostRegister``, not PyTorch's caching host
allocator, whose blocks ``copy_`` records an event for), and the device side is
a storage the ferry allocated on the caller's stream and keeps alive; its
readers wait for the group's event as before. A failed call raises, and the
caller's thread takes over the copies ([Note: copies issued off the caller's
thread]). ``TORCHFERRY_DRIVER_COPIES=0`` queues them with ``copy_`` instead.

The driver API needs a current context on the calling thread, which the
runtime binds lazily: :func:`queue_for` makes a runtime call on the stream
first, then asks the driver, and gives ``None`` (use ``copy_``) if there is
still none or it is another device's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

__all__ = ["DRIVER_ENV", "DriverQueue", "enabled", "queue_for"]

DRIVER_ENV = "TORCHFERRY_DRIVER_COPIES"
logger = logging.getLogger("torchferry")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    """``libcuda.so.1`` with the signatures used here, or ``None`` where it does not load."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            logger.debug("torchferry: libcuda.so.1 does not load (%s): copies queued with copy_", e)
            return None
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]  # (CUdeviceptr dst, const void *src, bytes, CUstream)
        lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]  # (void *dst, CUdeviceptr src, bytes, CUstream)
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        for f in (lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2, lib.cuCtxGetCurrent, lib.cuCtxGetDevice):
            f.restype = ctypes.c_int
        _lib = lib
        return lib


def enabled() -> bool:
    """``TORCHFERRY_DRIVER_COPIES``: ``1`` (default) queues the issuer thread's copies by pointer, ``0`` with ``copy_``.

    Raises:
        ValueError: neither ``0`` nor ``1``.
    """
    raw = os.environ.get(DRIVER_ENV, "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"torchferry: {DRIVER_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


class DriverQueue:
    """Queues copies of one direction on one stream by pointer ([Note: copies queued by pointer]).

    Built by :func:`queue_for` on the thread that uses it. Calling it with ``(dst, src, nbytes)``
    (integer addresses, bytes) queues ``nbytes`` from ``src`` to ``dst`` on the stream.

    Raises (on a call):
        RuntimeError: the driver refused the copy; the message names its ``CUresult``.
    """

    def __init__(self, lib: ctypes.CDLL, direction: str, stream: torch.cuda.Stream) -> None:
        self.direction = direction
        self._fn = lib.cuMemcpyHtoDAsync_v2 if direction == "h2d" else lib.cuMemcpyDtoHAsync_v2
        self._stream = ctypes.c_void_p(stream.cuda_stream)

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        code = self._fn(dst, src, nbytes, self._stream)
        if code:
            raise RuntimeError(f"torchferry: the CUDA driver refused a {self.direction.upper()} copy of {nbytes} bytes "
                               f"(CUresult {code})")


def queue_for(direction: str, stream: torch.cuda.Stream) -> DriverQueue | None:
    """A :class:`DriverQueue` for ``direction`` (``"h2d"`` or ``"d2h"``) on ``stream``, for the calling
    thread; ``None`` where copies should go through ``copy_`` (switched off, no driver library, or
    no current context on this thread)."""
    if not enabled():
        return None
    lib = _load()
    if lib is None:
        return None
    stream.query()  # a runtime call: binds the device's primary context to this thread
    ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value or lib.cuCtxGetDevice(ctypes.byref(dev)) \
            or dev.value != stream.device.index:
        logger.debug("torchferry: no current CUDA context of %s on this thread: copies queued with copy_",
                     stream.device)
        return None
    return DriverQueue(lib, direction, stream)
