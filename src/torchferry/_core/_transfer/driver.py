"""Host-device copies queued by pointer through the CUDA driver API, without a tensor op.

[Note: copies queued by pointer]
The issuer thread ([Note: copies issued off the caller's thread] in
``_schedules/issuer.py``) queues a reload's copies while the caller's thread
launches the step's kernels, and both need the GIL. A ``Tensor.copy_`` holds
it through the whole dispatch (views, checks, the ``cudaMemcpyAsync``), tens
of microseconds per piece. On one H200 (compute-rich Qwen2.5-1.5B step) the
phases computed 0.199 s/step longer than resident with the copies issued from
the thread by ``copy_`` (commit 1ed056c), against 0.048 s/step issued
synchronously (4d8b770).

Here a copy is one ``ctypes`` call of ``cuMemcpyHtoDAsync_v2`` /
``cuMemcpyDtoHAsync_v2`` on the pool's and the storage's pointers, on the copy
stream's handle: a few microseconds, the Python between two calls a few
integer operations. The calls keep the GIL (``ctypes.PyDLL``): a thread that
releases it for each call must take it back after each, and while the
caller's thread runs Python that means waiting for it to hand the GIL over
(CPython forces that after ``sys.getswitchinterval()``, 5 ms), a switch of
threads per piece. So the thread takes the GIL once per group, queues the
group's pieces, and gives it back only where it waits for the copy engine
(:meth:`DriverQueue.wait`, ``cuEventSynchronize`` with the GIL released, in
place of a poll every 0.5 ms). Measured on one H200 (compute-rich Qwen2.5-1.5B
step, commit 24e75c0, one call per piece releasing the GIL, polling): exposed
reload 0.208 s/step and 0.149 s/step of compute overhead, against 0.292 and
0.211 with ``copy_`` in the same session.

What ``copy_`` does besides the copy does not apply to these copies: the host
side is the ferry's pinned pool (``mmap`` + ``cudaHostRegister``, not PyTorch's
caching host allocator, whose blocks ``copy_`` records an event for), and the
device side is a storage the ferry allocated on the caller's stream and keeps
alive; its readers wait for the group's event as before. A failed call
raises, and the caller's thread takes over the copies ([Note: copies issued
off the caller's thread]). ``TORCHFERRY_DRIVER_COPIES=0`` queues them with
``copy_`` instead. So does a slot in a partly pinned pool's pageable rest
(``max_pinned_bytes``): from pageable memory the driver stages the copy on the
host, and ``copy_`` releases the GIL meanwhile.

The driver API needs a current context on the calling thread, which the
runtime binds lazily: :func:`queue_for` makes a runtime call on the stream
first, then asks the driver, and gives ``None`` (use ``copy_``) if there is
still none or it is another device's.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch


__all__ = ["DriverQueue", "queue_for"]

logger = logging.getLogger("torchferry")

_lock = threading.Lock()
_libs: tuple[ctypes.CDLL, ctypes.PyDLL] | None = None
_tried = False


def _load() -> tuple[ctypes.CDLL, ctypes.PyDLL] | None:
    """``libcuda.so.1`` twice, with the signatures used here: calls that release the GIL (waits) and
    calls that keep it (copies); ``None`` where it does not load."""
    global _libs, _tried
    with _lock:
        if _tried:
            return _libs
        _tried = True
        try:
            releasing, keeping = ctypes.CDLL("libcuda.so.1"), ctypes.PyDLL("libcuda.so.1")
        except OSError as e:
            logger.debug("torchferry: libcuda.so.1 does not load (%s): copies queued with copy_", e)
            return None
        u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        for lib in (releasing, keeping):
            lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]  # (CUdeviceptr dst, const void *src, bytes, CUstream)
            lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]  # (void *dst, CUdeviceptr src, bytes, CUstream)
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
            lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
            lib.cuEventSynchronize.argtypes = [vp]  # (CUevent): a torch.cuda.Event's cuda_event
            for f in (lib.cuMemcpyHtoDAsync_v2, lib.cuMemcpyDtoHAsync_v2, lib.cuCtxGetCurrent, lib.cuCtxGetDevice,
                      lib.cuEventSynchronize):
                f.restype = ctypes.c_int
        _libs = (releasing, keeping)
        return _libs


class DriverQueue:
    """Queues copies of one direction on one stream by pointer ([Note: copies queued by pointer]).

    Built by :func:`queue_for` on the thread that uses it. Calling it with ``(dst, src, nbytes)``
    (integer addresses, bytes) queues ``nbytes`` from ``src`` to ``dst`` on the stream, keeping the GIL.

    Raises (on a call):
        RuntimeError: the driver refused the copy; the message names its ``CUresult``.
    """

    def __init__(self, libs: tuple[ctypes.CDLL, ctypes.PyDLL], direction: str, stream: torch.cuda.Stream) -> None:
        releasing, keeping = libs
        self.direction = direction
        self._fn = keeping.cuMemcpyHtoDAsync_v2 if direction == "h2d" else keeping.cuMemcpyDtoHAsync_v2
        self._sync = releasing.cuEventSynchronize
        self._stream = ctypes.c_void_p(stream.cuda_stream)

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        code = self._fn(dst, src, nbytes, self._stream)
        if code:
            raise RuntimeError(f"torchferry: the CUDA driver refused a {self.direction.upper()} copy of {nbytes} bytes "
                               f"(CUresult {code})")

    def wait(self, event: torch.cuda.Event) -> None:
        """Blocks until ``event`` (recorded) has completed, with the GIL released.

        Raises:
            RuntimeError: the driver reported an error for the event; the message names its ``CUresult``.
        """
        code = self._sync(ctypes.c_void_p(event.cuda_event))
        if code:
            raise RuntimeError(f"torchferry: waiting for a copy event failed (CUresult {code})")


def queue_for(direction: str, stream: torch.cuda.Stream, *, enabled: bool = True) -> DriverQueue | None:
    """A :class:`DriverQueue` for ``direction`` (``"h2d"`` or ``"d2h"``) on ``stream``, for the calling
    thread; ``None`` where copies should go through ``copy_`` (switched off: ``enabled`` false, a ferry's
    ``CoreSettings.driver_copies`` from ``TORCHFERRY_DRIVER_COPIES``; no driver library; or no current
    context of the stream's device on this thread)."""
    if not enabled:
        return None
    libs = _load()
    if libs is None:
        return None
    stream.query()  # a runtime call: binds the device's primary context to this thread
    ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
    lib = libs[0]
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value or lib.cuCtxGetDevice(ctypes.byref(dev)) \
            or dev.value != stream.device.index:
        logger.debug("torchferry: no current CUDA context of %s on this thread: copies queued with copy_",
                     stream.device)
        return None
    return DriverQueue(libs, direction, stream)
