"""Run a test body in N spawned processes with a process group (gloo or NCCL)."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, fn, errors):
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            fn(rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    # Every check passed and the process group is gone: leave without running C++ static
    # destructors. Gloo's threads sometimes abort there ("terminate called without an active
    # exception", exit -6), about 1 run in 15 of a 2-rank test on a 2-core CI machine.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_spawned(fn, world: int = 2, backend: str = "gloo", timeout_s: float = 240) -> None:
    """Runs ``fn(rank, world)`` on ``world`` processes; fails with every rank's traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
