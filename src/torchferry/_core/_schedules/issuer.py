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
issue would have reached it. The thread keeps at most ``ISSUE_WINDOW_BYTES``
(1 GiB, about 19 ms of copies) queued ahead of the copy engine, waiting for
the oldest group's event when it is full, so the stream's queue never fills
(or, with ``TORCHFERRY_ISSUE_REFILL_BYTES``, until the window has drained to
that mark, then fills it again in one go: each wait gives the GIL up, and
taking it back beside a caller's thread that runs Python can take up to
``sys.getswitchinterval()``, 5 ms; one group of 187 MB per 5 ms is 37 GB/s,
under the link's 55, so under a busy caller the window may drain between two
groups. A lower mark refills several per wait. Not measured yet: the default
mark is the window, the behaviour measured below);
optimizer state (the tail, no hook needs it before the step) goes in groups of
256 MiB, so a ferry over an optimizer alone is issued from the thread too.

What it costs: the thread needs the GIL to queue copies, so the step's own
launches slow down while it runs (less since the copies are queued by
pointer, [Note: copies queued by pointer] in ``_transfer/driver.py``). On one
H200 (compute-rich Qwen2.5-1.5B step, commit 9365f08,
``benchmarks/results/bench_qwen2.5-{1.5b,3b}-compute-rich_h200x1_2026-12-01_9365f08.json``)
the phases still compute 0.174 s/step longer than resident (3B: 0.387), the
exposed reload is 0.240 s/step against a floor of 0.089 (3B: 0.475 against
0.197), and it is not the copies' own cost: the same bytes copied beside the
resident step, in the same pieces, with nothing waiting for them
(``resident+dma``, [Note: the copies' own cost] in the bench's ``overlap``)
computed 0.011 s/step *less* than resident (3B: 0.032 less; its penalty is its
issue time, 0.036 s, 3B 0.389 s: queued at once, the stream's queue fills). So
the excess over the floor lies in the schedule (the thread beside the step's
launches, the hooks' waits), not in the link or the host's memory; not found
yet. Earlier, with 16 MiB switch points: the copies issued synchronously held the caller 0.246 s
before the first forward and the phases computed 0.048 s/step longer than
resident (commit 4d8b770,
``benchmarks/results/bench_qwen2.5-1.5b-compute-rich_h200x1_2026-12-01.json``);
issued from the thread, update_actor's reload returned in 0.031 s and the
phases computed 0.168 s/step longer (commit 956519a), and a 256 MiB window
(more looks at the events) cost more than a 1 GiB one: exposed reload 0.312
against 0.234 s/step, the small H2D copy's p90 0.21 against 0.05 ms
(``benchmarks/results/bench_qwen2.5-1.5b-compute-rich-window-*_h200x1_2026-12-01_956519a.json``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["ISSUE_POLL_S", "ISSUE_WINDOW_BYTES", "Issuer", "refill_mark", "wait_target"]

ISSUE_WINDOW_BYTES = 1 << 30  # copies the issuer thread keeps queued ahead of the engine (bytes; see the Note)


def refill_mark(setting: int | None) -> int:
    """The queued bytes a full issue window is waited down to before the issuer thread fills it again:
    ``setting`` (``CoreSettings.issue_refill_bytes``, from ``TORCHFERRY_ISSUE_REFILL_BYTES``, read in
    ``[0, ISSUE_WINDOW_BYTES]``), ``None``: :data:`ISSUE_WINDOW_BYTES` (as soon as a group fits). A lower
    mark takes the GIL back once per several groups, not once per group.

    Raises:
        ValueError: ``setting`` outside ``[0, ISSUE_WINDOW_BYTES]``.
    """
    if setting is None:
        return ISSUE_WINDOW_BYTES
    if not 0 <= setting <= ISSUE_WINDOW_BYTES:
        raise ValueError(f"torchferry: the issue refill mark must be in [0, {ISSUE_WINDOW_BYTES}] bytes, got {setting}")
    return setting


def wait_target(nbytes: list[int], first: int, issued: int, gi: int, high: int, low: int) -> int | None:
    """Which issued group's copies the issuer thread waits for before it queues group ``gi``.

    Args:
        nbytes: bytes per group. first: the first issued group whose copies may not be done.
        issued: groups issued. high: the window (bytes). low: the refill mark (bytes, <= high).

    Returns:
        ``None`` if nothing is queued or ``gi`` fits (``sum(nbytes[first:issued]) + nbytes[gi] <= high``;
        a group larger than the window goes once the queue is empty); else the first
        group ``k >= first`` after whose copies at most ``low`` bytes stay queued with ``gi``'s
        (the last issued group if none: everything drains first).
    """
    queued = sum(nbytes[first:issued])
    if first >= issued or queued + nbytes[gi] <= high:  # nothing queued, or room
        return None
    k, queued = first, queued - nbytes[first]  # queued: what stays after group k's copies
    while k < issued - 1 and queued + nbytes[gi] > low:
        k += 1
        queued -= nbytes[k]
    return k


ISSUE_POLL_S = 0.0005  # seconds between two looks at the copies' progress, queued with copy_ (1 GiB: ~19 ms of copies)


class Issuer:
    """Runs ``job(i)`` for ``i`` in ``range(first, stop)``, in order, on a thread of its own.

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
        # Not a daemon, as the pool's background allocation (``_host/pool.py``): the exit waits for its copies.
        self._thread = threading.Thread(target=self._run, name="torchferry-h2d-issuer", daemon=False)

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
