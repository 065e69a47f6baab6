"""Re-pointing tensor objects between device storage and host slots, keeping identity.

Plain tensors and ``nn.Parameter``s are re-pointed with ``t.data = other``
(``set_data``: the same ``TensorImpl`` takes the other tensor's storage,
sizes, strides and device, as ``nn.Module._apply`` does for ``model.cpu()``).
That keeps the Python object, its autograd metadata and its ``.grad``.

A DTensor is a wrapper subclass: its device is fixed in the wrapper and its
data lives in ``_local_tensor``, so ``.data =`` would leave the local shard
where it was. For DTensors we build a twin DTensor with the same spec over the
other local tensor and exchange the two with ``torch.utils.swap_tensors``
(which also moves the local tensor slot), then hand each Python object its own
``__dict__`` back, so attributes such as ``_is_param`` stay with the object.
``swap_tensors`` refuses tensors that are weakly referenced or whose
``TensorImpl`` is shared (e.g. a live autograd graph); the grad link of a
DTensor parameter lives in its ``TensorImpl`` and is carried over by hand.
"""

from __future__ import annotations

import torch

from ._plan import is_dtensor

__all__ = ["view_on", "Repointer"]


def view_on(local: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``local`` over the bytes of ``base``.

    Args:
        local: the plain tensor to mirror (dtype, size, stride, storage offset).
        base: 1D ``torch.uint8`` view of a whole storage's bytes (a pool slot,
            or a device storage), possibly at an offset into a larger storage.

    Returns:
        A tensor on ``base``'s device with ``local``'s dtype, size and stride,
        at ``local``'s storage offset counted from the start of ``base``.
    """
    itemsize = local.element_size()
    byte_offset = base.storage_offset() + local.storage_offset() * itemsize
    if byte_offset % itemsize:
        raise AssertionError(f"slot misaligned for {local.dtype}: {byte_offset=}")
    out = torch.empty(0, dtype=local.dtype, device=base.device)
    return out.set_(base.untyped_storage(), byte_offset // itemsize, local.size(), local.stride())


def _swap_keep_dicts(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.utils.swap_tensors(a, b)
    a_dict, b_dict = a.__dict__, b.__dict__
    a.__dict__, b.__dict__ = b_dict, a_dict


class Repointer:
    """Re-points a list of tensor objects at new data, all or nothing.

    ``apply(new_locals)`` re-points ``tensors[i]`` so that its (local) data is
    ``new_locals[i]``; it returns the previous locals so the move can be undone
    with another ``apply``. If one re-point fails, the ones already done are
    undone before the error propagates.
    """

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        self.tensors = tensors
        self.names = names
        self._dtensor = [is_dtensor(t) for t in tensors]  # decided once: a tensor's type does not change

    @staticmethod
    def _set(t: torch.Tensor, new_local: torch.Tensor, dtensor: bool) -> torch.Tensor:
        """Re-points one tensor; returns what it pointed at before."""
        if dtensor:
            from torch.distributed.tensor import DTensor

            use_count = getattr(t, "_use_count", None)
            if use_count is not None and use_count() > 1:
                # swap_tensors would poison the AccumulateGrad node of a live
                # graph (the backward then fails far from here): refuse now.
                raise RuntimeError(
                    "it is held by a live autograd graph or another reference to its TensorImpl; "
                    "run backward (or drop the graph) before offloading"
                )
            twin = DTensor(new_local, t._spec, requires_grad=t.requires_grad)
            _swap_keep_dicts(t, twin)
            return twin._local_tensor
        old = t.detach()
        t.data = new_local
        return old

    def apply(self, new_locals: list[torch.Tensor]) -> list[torch.Tensor]:
        # A DTensor parameter's grad is held by its TensorImpl, which the swap
        # exchanges: unlink the grads, move everything, link them again.
        grad_links = [
            (t, t.grad) for t, d in zip(self.tensors, self._dtensor) if d and t.requires_grad and t.grad is not None
        ]
        for t, _ in grad_links:
            t.grad = None
        old: list[torch.Tensor] = []
        set_one = self._set
        try:
            # One loop for thousands of tensors: no per-tensor try (see [Note: optimistic offload]).
            for t, d, new in zip(self.tensors, self._dtensor, new_locals, strict=True):
                old.append(set_one(t, new, d))
        except BaseException as e:
            for t, d, prev in zip(self.tensors, self._dtensor, old):
                set_one(t, prev, d)
            for t, g in grad_links:
                t.grad = g
            if isinstance(e, RuntimeError) and len(old) < len(self.tensors):
                t = self.tensors[len(old)]
                raise RuntimeError(
                    f"torchferry: cannot re-point {self.names[len(old)]} ({type(t).__name__}, "
                    f"{tuple(t.shape)}): {e}"
                ) from e
            raise
        for t, g in grad_links:
            t.grad = g
        return old
