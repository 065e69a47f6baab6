"""What every bench scenario sets up the same way: the process group, FSDP2 units, the run's record."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
from torch import nn

__all__ = ["command_line", "env_record", "init_distributed", "shard_fsdp2", "source_commit", "start_scenario"]


def start_scenario(preset: str | None, gpu_default: str, on_progress, *, local_model: bool = False):
    """A scenario's common start: ``(use_cuda, preset, rank, world size, device, say)``.

    ``preset`` defaults to ``gpu_default`` on a GPU and ``"tiny"`` on the CPU;
    ``say(msg, frac)`` is ``on_progress`` on rank 0 and a no-op elsewhere.

    Raises:
        ValueError: a preset other than ``tiny`` without CUDA (unless
            ``local_model``: a checkpoint folder is used instead); more local
            ranks than CUDA devices.
    """
    use_cuda = torch.cuda.is_available()
    preset = preset or (gpu_default if use_cuda else "tiny")
    if not use_cuda and not local_model and preset != "tiny":
        raise ValueError(f"preset {preset!r} needs a GPU; on a machine without CUDA use --preset tiny")
    rank, world, device = init_distributed(use_cuda)
    say = on_progress if (on_progress and rank == 0) else (lambda msg, frac: None)
    return use_cuda, preset, rank, world, device, say


def init_distributed(use_cuda: bool) -> tuple[int, int, torch.device]:
    """Joins (or makes) the process group: ``(rank, world size, device)``.

    Raises:
        ValueError: more local ranks than CUDA devices.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        n = torch.cuda.device_count()
        if world > n and int(os.environ.get("LOCAL_WORLD_SIZE", world)) > n:
            raise ValueError(f"{world} ranks on this node but only {n} CUDA device(s); use --nproc_per_node <= {n}")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if world > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # pyright: ignore[reportPrivateImportUsage]  # HashStore is real; the stubs do not re-export it
    return dist.get_rank(), dist.get_world_size(), device


def shard_fsdp2(model: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 units in forward order, as torchtitan wraps them: the embedding and the output
    projection on their own (when not tied), each decoder layer, the root; bf16 compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    untied = not getattr(model.config, "tie_word_embeddings", True)
    if untied:
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)  # pyright: ignore[reportArgumentType, reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    for layer in model.model.layers:  # pyright: ignore[reportGeneralTypeIssues]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if untied:
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp)  # pyright: ignore[reportArgumentType, reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    fully_shard(model, mesh=mesh, mp_policy=mp)


def command_line() -> str:
    """The command as the user typed it (``python -m torchferry``, under ``torchrun`` if so)."""
    prog = "python -m torchferry" if sys.argv[0].endswith("__main__.py") else Path(sys.argv[0]).name
    launcher = ""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')} "
        prog = "-m torchferry" if prog.startswith("python -m") else prog
    return launcher + " ".join([prog, *sys.argv[1:]])


def env_record(device: torch.device, world: int) -> dict:
    """The ``env`` entry of a results JSON: GPU, torch, world size, UTC date, command, device,
    commit, and the ``TORCHFERRY_*`` settings of the environment (``torchferry_env``)."""
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "world_size": world,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "device": str(device),
        "commit": source_commit(),
        "torchferry_env": {k: v for k, v in sorted(os.environ.items())
                           if k.startswith("TORCHFERRY_") and k not in ("TORCHFERRY_COMMIT", "TORCHFERRY_RESULTS_DIR")},
    }


def source_commit() -> str | None:
    """The commit that ran: ``TORCHFERRY_COMMIT`` if set (a copy of the tree whose ``.git`` is
    stale, as on the device machines), else ``git rev-parse --short HEAD`` of the package's
    checkout, else ``None``."""
    if os.environ.get("TORCHFERRY_COMMIT"):
        return os.environ["TORCHFERRY_COMMIT"]
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None
