"""Hooks that make use of offloaded state fail loudly instead of running on the host."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._tree import module_tree

__all__ = ["OffloadGuards"]


def _owns_state(m: nn.Module) -> bool:
    """Whether ``m`` directly holds a parameter or buffer (``None`` entries do not count)."""
    params, buffers = m._parameters, m._buffers  # most modules of a large model hold neither
    return bool(params) and any(v is not None for v in params.values()) or (
        bool(buffers) and any(v is not None for v in buffers.values()))


class OffloadGuards:
    """Forward pre-hooks and optimizer step pre-hooks, installed while offloaded.

    Every module in a target's tree that directly owns parameters or buffers
    gets a forward pre-hook (prepended, so it runs before FSDP2's all-gather),
    and every optimizer target a step pre-hook. Both raise ``RuntimeError``
    naming what to call. Nothing is installed while the state is resident, so
    resident forwards pay nothing.
    """

    def __init__(self, describe: Callable[[], str]) -> None:
        self._describe = describe  # e.g. "Ferry(..., residency=HOST)"
        self._handles: list[RemovableHandle] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        if self._handles:
            return
        for root in modules:
            for name, m in module_tree(root):
                if m is root or _owns_state(m):
                    self._handles.append(m.register_forward_pre_hook(self._forward_hook(name), prepend=True))
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._step_hook))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: object) -> None:
            where = f"{type(module).__name__} '{name}'" if name else f"the {type(module).__name__} target"
            raise RuntimeError(
                f"torchferry: forward of {where} while its state is offloaded to host "
                f"memory ({self._describe()}); call ferry.reload() (with the verl helpers: "
                "load_fsdp2_model_to_gpu(model)) before running it"
            )

        return hook

    def _step_hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        raise RuntimeError(
            f"torchferry: {type(optimizer).__name__}.step() while its state is "
            f"offloaded to host memory ({self._describe()}); call ferry.reload() first"
        )
