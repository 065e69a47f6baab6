"""Run a test body in N fresh processes with a process group (gloo or NCCL).

[Note: ranks forked from a server that has imported torch]
On the CPU (gloo) the ranks are started by multiprocessing's forkserver, not spawned: a server
process (one for each test process, started at its first call) imports torch, Dynamo and
torch.distributed once and forks each rank from there, so a rank does not pay for those imports
again (about 2.5 CPU seconds of each rank's 3.5 in a 2-rank test on a 2-core host). A rank is still
a process of its own that shares nothing with the test process: nothing of torchferry or of the
test module is imported in the server (the rank imports them itself, as a spawned one does), no
thread runs there, and the rank takes the test process's environment (os.environ at the call, as a
spawned process inherits it) before it runs. What a rank no longer has of its own is Python's hash
seed: the ranks share the server's. NCCL ranks are still spawned (the GPU tests' timings and memory
figures stay as they were measured).
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the server imports before it forks a rank: nothing that reads the environment at import in a
# way a test steers (torchferry reads it at its own import, in the rank).
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.device_mesh",
            "torch.distributed.tensor"]


def _context(backend: str):
    if backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call of the process)
    return ctx


def _entry(rank, world, port, backend, fn, errors, environ):
    try:
        os.environ.clear()
        os.environ.update(environ)  # the test process's, at the call (a spawned process's inheritance)
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
    ctx = _context(backend)
    errors = ctx.SimpleQueue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, errors, environ)) for r in range(world)]
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
