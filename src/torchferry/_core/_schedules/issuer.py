"""A layer-wise reload's copies issued from a thread, so the caller's thread goes on launching compute.

[Note: copies issued off the caller's thread]
A reload queued at once is thousands of ``cudaMemcpyAsync`` calls (one per
storage and, with [Note: switch points], one per piece and separator), and
a stream holds only so many queued operations: once it is full, the call that
queues one more blocks the host until the copy engine has drained some. On one
H200 (compute-rich Qwen2.5-1.5B step, commit 4d8b770) queuing update_actor's
18.5 GB reload in 16 MiB pieces held the caller 0.246 s against 0.095 s whole,
ahead of the first forward: host time the step waits for, while the forward
it could have launched would have hidden the copies. So the copies of every
group but the first are issued by an :class:`Issuer` thread, in forward
order, on the same H2D stream; the caller allocates every storage first (the
caching allocator ties a block to the allocating thread's current stream,
which must stay the caller's) and issues the first group itself, so the
reload's handle has an event when ``reload()`` returns. A unit's pre-forward
hook waits on the host only until its own group is *issued* (then the stream
waits for its event as before), which is never later than the synchronous
issue would have reached it. The thread releases the GIL inside each copy
call, so a blocked queue blocks only the thread.

Failures keep the all-or-nothing rules: whatever the thread raises stops it
and the caller's thread issues the rest itself (a failure there propagates as
in a synchronous reload); an abort cancels the thread and joins it before
anything is freed. Ctrl-C reaches the caller's thread only, which cancels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["Issuer"]


class Issuer:
    """Runs ``job(i)`` for ``i`` in ``range(first, stop)``, in order, on a daemon thread.

    Args:
        device: the device the jobs issue on (set as the thread's current CUDA device).
        job: issues one group's copies and records its event; may raise.
        first, stop: the range of job indices.

    Attributes:
        error: what a job raised (the thread then stopped), or ``None``.
    """

    def __init__(self, device: torch.device, job: Callable[[int], None], first: int, stop: int) -> None:
        self._device, self._job, self._stop = device, job, stop
        self._next = first  # the first job not yet done
        self._cv = threading.Condition()
        self._cancelled = False
        self._ended = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="torchferry-h2d-issuer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            while True:
                with self._cv:
                    i = self._next
                    if self._cancelled or i >= self._stop:
                        break
                self._job(i)
                with self._cv:
                    self._next = i + 1
                    self._cv.notify_all()
        except BaseException as e:  # handed to the caller's thread, which issues the rest itself
            self.error = e
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify_all()

    def wait(self, i: int) -> bool:
        """Blocks until job ``i`` is done or the thread stopped; ``True`` if the thread did job ``i``."""
        with self._cv:
            while self._next <= i and not self._ended:
                self._cv.wait()
            return self._next > i

    @property
    def done(self) -> int:
        """How many jobs are done (all of them below this index)."""
        with self._cv:
            return self._next

    @property
    def running(self) -> bool:
        """The thread still has jobs to issue."""
        with self._cv:
            return not self._ended

    def stop(self) -> None:
        """Cancels the jobs not yet started and joins the thread (idempotent)."""
        with self._cv:
            self._cancelled = True
        interrupted: BaseException | None = None
        while self._thread.is_alive():  # a job under way finishes first: nothing is freed under it
            try:
                self._thread.join()
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
