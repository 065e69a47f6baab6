"""What an optimizer's first ``step()`` allocates on its parameters' device, told before it runs.

[Note: first-step state]
PyTorch's optimizers make their state lazily, in the first ``step()`` (each one's ``_init_group``
in ``torch/optim/``, torch 2.13), so a dock that admits a first training phase must tell the
bytes beforehand, or find them over the budget one phase later: ``Adam(amsgrad=True)`` was
admitted at step 0 and refused at step 1 while the estimate assumed two state tensors per
parameter. :func:`first_step_bytes` reads the layout from each parameter
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
from typing import NamedTuple

import torch

from .._state.fsdp import local_of

__all__ = ["first_step_bytes"]

_Like = Callable[[dict], int]  # a param group -> tensors shaped like each of its parameters


class _Layout(NamedTuple):
    like: _Like
    scalars: int  # 0-dim float tensors per parameter (step, ...)
    on_device: tuple[str, ...] | None  # group options that put them on the parameter's device (None: always)


# The first class in an optimizer's MRO found here wins (AdamW is an Adam).
_LAYOUTS: dict[type, _Layout] = {
    torch.optim.Adam: _Layout(lambda g: 2 + int(bool(g.get("amsgrad"))), 1, ("capturable", "fused")),
    torch.optim.SGD: _Layout(lambda g: int(g.get("momentum", 0) != 0), 0, ()),
    torch.optim.RMSprop: _Layout(lambda g: 1 + int(g.get("momentum", 0) > 0) + int(bool(g.get("centered"))), 1,
                                 ("capturable",)),
    torch.optim.Adamax: _Layout(lambda g: 2, 1, ("capturable",)),
    torch.optim.NAdam: _Layout(lambda g: 2, 2, ("capturable",)),  # step, mu_product
    torch.optim.RAdam: _Layout(lambda g: 2, 1, ("capturable",)),
    torch.optim.Adadelta: _Layout(lambda g: 2, 1, ("capturable",)),
    torch.optim.Rprop: _Layout(lambda g: 2, 1, ("capturable",)),
    torch.optim.ASGD: _Layout(lambda g: 1, 3, None),  # ax; step, eta, mu
    torch.optim.Adagrad: _Layout(lambda g: 1, 1, ("fused",)),  # made at construction already
    torch.optim.SparseAdam: _Layout(lambda g: 2, 0, ()),  # its step is an int
}


def _layout_of(optimizer: torch.optim.Optimizer) -> _Layout | None:
    return next((_LAYOUTS[c] for c in type(optimizer).__mro__ if c in _LAYOUTS), None)


def first_step_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int | None:
    """Bytes the first ``step()`` of ``optimizer`` allocates on ``device`` ([Note: first-step state]).

    Counts every parameter that requires a gradient (one that gets none in the step gets no
    state: an upper bound then), each state tensor in the parameter's dtype and local shard size
    (FSDP2's DTensors), each 0-dim one on the device as a float32 (a float64 under
    ``torch.set_default_dtype(float64)``; on a CPU device the host's 0-dim ones count too).

    Returns:
        The bytes, or ``None`` for an optimizer whose state layout is not known here.
    """
    layout = _layout_of(optimizer)
    if layout is None:
        return None
    scalar = 8 if torch.get_default_dtype() == torch.float64 else 4
    total = 0
    for group in optimizer.param_groups:
        like = layout.like(group)
        on_device = (layout.on_device is None or device.type == "cpu"  # the host is the device then
                     or any(group.get(k) for k in layout.on_device))
        scalars = layout.scalars if on_device else 0
        for p in group["params"]:
            if not p.requires_grad:
                continue
            local = local_of(p)
            if local.device.type != device.type or (device.index is not None and local.device.index != device.index):
                continue
            total += like * local.numel() * local.element_size() + scalars * scalar
    return total
