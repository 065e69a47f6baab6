"""What an optimizer's first ``step()`` allocates on its parameters' device, told before it runs.

[Note: first-step state]
PyTorch's optimizers make their state lazily, in the first ``step()`` (each one's ``_init_group``
in ``torch/optim/``, torch 2.13), so a dock that admits a first training phase must tell the
bytes beforehand, or find them over the budget one phase later: ``Adam(amsgrad=True)`` was
admitted at step 0 and refused at step 1 while the estimate assumed two state tensors per
parameter (issue 46 item 3). :func:`first_step_bytes` reads the layout from each parameter
group's options, as the optimizer's ``_init_group`` does: tensors shaped like the parameter
(Adam / AdamW ``exp_avg`` and ``exp_avg_sq``, ``max_exp_avg_sq`` with ``amsgrad``; SGD's
``momentum_buffer`` with ``momentum != 0``; RMSprop's ``square_avg``, ``momentum_buffer`` with
``momentum > 0``, ``grad_avg`` with ``centered``; ...) and 0-dim tensors on the device (``step``
with ``capturable`` or ``fused``, which otherwise keep it on the host; ASGD's ``step``, ``eta``
and ``mu`` always). ``foreach`` changes only the kernels, not the state. An optimizer whose
layout is not known here (LBFGS, third-party ones) gives ``None``: its state is measured after
its first step instead (``Dock.release``, [Note: a set counts its bytes now] in ``measure``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._state.fsdp import local_of

__all__ = ["first_step_bytes"]

_Layout = Callable[[dict], tuple[int, int]]  # a param group -> (tensors like each parameter, 0-dim device tensors)


def _on_device(group: dict, *keys: str) -> int:
    return int(any(group.get(k) for k in keys))


# The first matching class in an optimizer's MRO wins (AdamW is an Adam).
_LAYOUTS: tuple[tuple[type[torch.optim.Optimizer], _Layout], ...] = (
    (torch.optim.Adam, lambda g: (2 + int(bool(g.get("amsgrad"))), _on_device(g, "capturable", "fused"))),
    (torch.optim.SGD, lambda g: (int(g.get("momentum", 0) != 0), 0)),
    (torch.optim.RMSprop, lambda g: (1 + int(g.get("momentum", 0) > 0) + int(bool(g.get("centered"))),
                                     _on_device(g, "capturable"))),
    (torch.optim.Adamax, lambda g: (2, _on_device(g, "capturable"))),
    (torch.optim.NAdam, lambda g: (2, 2 * _on_device(g, "capturable"))),  # step, mu_product
    (torch.optim.RAdam, lambda g: (2, _on_device(g, "capturable"))),
    (torch.optim.Adadelta, lambda g: (2, _on_device(g, "capturable"))),
    (torch.optim.Rprop, lambda g: (2, _on_device(g, "capturable"))),
    (torch.optim.ASGD, lambda g: (1, 3)),  # ax; step, eta, mu on the device
    (torch.optim.Adagrad, lambda g: (1, _on_device(g, "fused"))),  # made at construction already
    (torch.optim.SparseAdam, lambda g: (2, 0)),
)


def _layout_of(optimizer: torch.optim.Optimizer) -> _Layout | None:
    for cls in type(optimizer).__mro__:
        for known, layout in _LAYOUTS:
            if cls is known:
                return layout
    return None


def first_step_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int | None:
    """Bytes the first ``step()`` of ``optimizer`` allocates on ``device`` ([Note: first-step state]).

    Counts every parameter that requires a gradient (one that gets none in the step gets no
    state: an upper bound then), each state tensor in the parameter's dtype and local shard size
    (FSDP2's DTensors), each 0-dim one as a float32 (a float64 under ``torch.set_default_dtype(float64)``).

    Returns:
        The bytes, or ``None`` for an optimizer whose state layout is not known here.
    """
    layout = _layout_of(optimizer)
    if layout is None:
        return None
    scalar = 8 if torch.get_default_dtype() == torch.float64 else 4
    total = 0
    for group in optimizer.param_groups:
        like, scalars = layout(group)
        for p in group["params"]:
            if not p.requires_grad:
                continue
            local = local_of(p)
            if local.device.type != device.type or (device.index is not None and local.device.index != device.index):
                continue
            total += like * local.numel() * local.element_size() + scalars * scalar
    return total
