"""Re-pointing tensor objects between device storage and host slots, keeping everything autograd holds.

[Note: parked TensorImpls]
The tensor objects users hold (parameters, DTensors, ``.grad``s, optimizer
state) must be CPU tensors viewing the pool while offloaded and device tensors
again after a reload, as the same Python objects. Assigning ``t.data = host``
(``set_data``) keeps the object but, when the device changes, drops the
parameter's ``AccumulateGrad`` node (``VariableHooks::set_data`` resets
``grad_accumulator_``): the next backward makes a new node, and whatever was
registered on the old one is silently gone, DDP's reducer hooks first (found
on 2 H200s: DDP synchronised gradients at step 1 only). For a DTensor,
``torch.utils.swap_tensors`` with a twin moved the whole ``TensorImpl``, and
with it the tensor hooks, post-accumulate-grad hooks and a frozen
parameter's ``.grad``, to the twin that was then dropped.

So nothing is re-pointed in place. Each tensor gets a *twin* object and the
two exchange their ``TensorImpl``s (``torch._C._swap_tensor_impl``, plus a
DTensor's ``_local_tensor`` slot): on offload the user's object takes the
twin's host impl and the twin parks the original device impl, untouched, with
its autograd metadata (grad accumulator, hooks, ``.grad`` link, version
counter); on reload they exchange back. The host twin is kept for the next
cycle, so a steady cycle makes no objects. ``torch.utils.swap_tensors`` is
not used: it poisons a live ``AccumulateGrad`` node, which is right for a
one-way swap and wrong here, where the original impl comes back. Attributes in
``__dict__`` (``_is_param``) stay with the user's object.

A parameter's ``.grad`` is a link inside the impl: the host impl is given the
host ``.grad`` (or ``None``) each offload; the parked device impl still links
the device grad, which comes back with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from .fsdp import dtensor_twin, is_dtensor, local_of, set_local, swap_impls, swap_local, versions

__all__ = ["Move", "Parking", "move_to", "moved", "view_on"]

_NONE = torch.empty(0)  # stands in for a missing twin in a versions() call


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


def _link_grad(t: torch.Tensor, g: torch.Tensor | None, name: str) -> None:
    try:
        t.grad = g
    except RuntimeError as e:  # PyTorch checks a .grad against its tensor
        raise RuntimeError(
            f"torchferry: cannot offload {name}: its .grad ({tuple(g.shape)}, {g.dtype}) no longer fits it "
            f"({tuple(t.shape)}, {t.dtype}); was it given other bytes (.data = ...)? Set its .grad to None "
            "first. Nothing was moved."
        ) from e


def _exchange(a: torch.Tensor, b: torch.Tensor, dtensor: bool) -> None:
    """Exchanges two objects' impls (and a DTensor's local shard slot) together or not at all: an exception
    between the two steps puts the impls back (a half-exchanged ``.grad`` viewed the pool for good)."""
    swap_impls(a, b)
    if dtensor:
        try:
            swap_local(a, b)
        except BaseException:
            swap_impls(a, b)
            raise


class Move(NamedTuple):
    """A tensor object's move to the device, prepared (allocated) but not applied: see :func:`moved`."""

    tensor: torch.Tensor  # the object the user holds
    dtensor: bool
    replacement: torch.Tensor  # a DTensor twin over the moved local shard, or the moved plain tensor


def move_to(t: torch.Tensor, device: torch.device) -> Move:
    """Prepares the move of a tensor object the ferry does not hold yet to ``device``, keeping its
    identity: the device copy is made now (this may run out of memory), nothing is re-pointed.

    For tensors without autograd history of their own (a state-dict load's new tensors): plain
    ones through ``t.data``, DTensors by exchanging impls with a twin over the moved local shard.
    """
    if is_dtensor(t):
        return Move(t, True, dtensor_twin(t, local_of(t).to(device)))
    return Move(t, False, t.data.to(device))


def moved(move: Move) -> Callable[[], None]:
    """Applies a prepared :class:`Move`; returns what undoes it."""
    t = move.tensor
    if move.dtensor:
        _exchange(t, move.replacement, True)
        return lambda: _exchange(t, move.replacement, True)
    old = t.data
    t.data = move.replacement
    return lambda: setattr(t, "data", old)


class Parking:
    """The tensor objects of one plan, each with a twin; see [Note: parked TensorImpls].

    Args:
        tensors: the objects users hold, each once.
        names: their names, for errors.

    ``to_host`` and ``to_device`` take index lists, so a layer-wise reload can
    bring back one FSDP unit at a time; a parameter and its ``.grad`` must be
    in the same call.
    """

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        self.tensors = tensors
        self.names = names
        self._dtensor = [is_dtensor(t) for t in tensors]  # decided once: a tensor's type does not change
        # Leaves that can hold a .grad link: parameters (frozen ones too) and leaves requiring grad.
        self._grad_slot = [isinstance(t, nn.Parameter) or (t.requires_grad and t.is_leaf) for t in tensors]
        self._twins: list[torch.Tensor | None] = [None] * len(tensors)
        self._host_key: object = None  # what the host twins were made over (the host views)
        self.on_host = [False] * len(tensors)

    def to_host(self, indices: list[int] | range, host_locals: list[torch.Tensor], key: object) -> None:
        """Parks the device impls of ``tensors[indices]``; the objects then view ``host_locals[i]``.

        ``key`` identifies the host views: twins made over other views are made again.

        Raises:
            RuntimeError: naming the tensor, if one could not be moved; the ones
                already moved are moved back first (all or nothing).
        """
        if key is not self._host_key:
            self._twins = [None if not h else t for t, h in zip(self._twins, self.on_host, strict=False)]
            self._host_key = key
        tensors, twins, dtensor, grad_slot = self.tensors, self._twins, self._dtensor, self._grad_slot
        grads: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        done: list[int] = []
        try:
            for i in indices:
                t = tensors[i]
                twin = twins[i]
                if twin is None:
                    local = host_locals[i]
                    twin = dtensor_twin(t, local) if dtensor[i] else local
                elif dtensor[i] and local_of(twin) is not host_locals[i]:
                    # FSDP2 replaced the local shard while it was on the host (an uneven shard
                    # re-padded by module.to(...)): the pool view again ([Note: FSDP2's shard
                    # buffer after a move] in .fsdp)
                    set_local(twin, host_locals[i])
                if twin.requires_grad != t.requires_grad:
                    twin.requires_grad_(t.requires_grad)
                g = t.grad if grad_slot[i] else None
                _exchange(t, twin, dtensor[i])
                twins[i] = twin
                done.append(i)
                if grad_slot[i]:  # only once exchanged: the undo unlinks host impls' grads alone
                    grads.append((i, t, g))
            for i, t, g in grads:  # the host impl links the host grad (the grad objects moved above)
                if t.grad is not g:
                    _link_grad(t, g, self.names[i])
        except BaseException as e:
            for _, t, _g in grads:
                if t.grad is not None:
                    t.grad = None
            self._undo(done, to_host=True)
            self._raise(e, indices, done)
        for i in done:
            self.on_host[i] = True

    def to_device(self, indices: list[int] | range) -> None:
        """Gives ``tensors[indices]`` their parked device impls back (all or nothing)."""
        done: list[int] = []
        try:
            for i in indices:
                t, twin = self.tensors[i], self._twins[i]
                if twin.requires_grad != t.requires_grad:  # frozen or unfrozen while offloaded
                    twin.requires_grad_(t.requires_grad)
                _exchange(t, twin, self._dtensor[i])  # pyright: ignore[reportArgumentType]  # every parked index has its twin
                done.append(i)
        except BaseException as e:
            self._undo(done, to_host=False)
            self._raise(e, indices, done)
        for i in done:
            self.on_host[i] = False

    def host_locals(self, indices: list[int] | range) -> dict[int, torch.Tensor]:
        """After :meth:`to_device`: ``id()`` of each DTensor of ``tensors[indices]`` -> the host local
        shard its twin parks now ([Note: FSDP2's shard buffer after a move] in ``.fsdp``)."""
        return {id(self.tensors[i]): local_of(twin) for i in indices
                if self._dtensor[i] and (twin := self._twins[i]) is not None}

    def revert_to_device(self, indices: list[int] | range) -> None:
        """Undoes a :meth:`to_device` of ``indices`` exactly: the objects take their host impls back
        and the twins park the device impls again, grad links as they were ([Note: all or nothing])."""
        for i in indices:
            _exchange(self.tensors[i], self._twins[i], self._dtensor[i])  # pyright: ignore[reportArgumentType]  # every parked index has its twin
            self.on_host[i] = True

    def locals(self) -> list[torch.Tensor]:
        """The plain tensor of each object (a DTensor's local shard), in order."""
        if not any(self._dtensor):
            return self.tensors
        return [local_of(t) if d else t for t, d in zip(self.tensors, self._dtensor, strict=False)]

    def has_grad_slot(self, i: int) -> bool:
        """Whether ``tensors[i]`` can hold a ``.grad`` link (a parameter, or a leaf requiring grad)."""
        return self._grad_slot[i]

    def parked(self, i: int) -> torch.Tensor | None:
        """While ``tensors[i]`` is on the host: the twin holding its device impl."""
        return self._twins[i] if self.on_host[i] else None

    def host_twins(self) -> list[torch.Tensor | None]:
        """Per tensor, the twin holding its host impl while it is resident (``None``: none, or on the host)."""
        return [t if not h else None for t, h in zip(self._twins, self.on_host, strict=False)]

    def host_versions(self, indices: list[int] | range | None = None) -> list[object]:
        """Per tensor (``indices``, default all), the version counter of its host twin while
        resident (the impl that viewed the pool: a host tensor kept from the last offload shares
        it), ``-1`` where there is none."""
        idx = range(len(self.tensors)) if indices is None else indices
        twins = [self._twins[i] if not self.on_host[i] else None for i in idx]
        vs = versions([_NONE if t is None else t for t in twins])
        return [-1 if t is None else v for t, v in zip(twins, vs, strict=False)]

    def forget_host(self) -> None:
        """Drops the host twins of resident tensors (they keep the pool's memory mapped)."""
        self._twins = [t if h else None for t, h in zip(self._twins, self.on_host, strict=False)]
        self._host_key = None

    def _undo(self, done: list[int], *, to_host: bool) -> None:
        for i in reversed(done):
            _exchange(self.tensors[i], self._twins[i], self._dtensor[i])  # pyright: ignore[reportArgumentType]  # every parked index has its twin

    def _raise(self, e: BaseException, indices, done: list[int]) -> None:
        indices = list(indices)
        if isinstance(e, RuntimeError) and len(done) < len(indices):
            i = indices[len(done)]
            t = self.tensors[i]
            raise RuntimeError(
                f"torchferry: cannot re-point {self.names[i]} ({type(t).__name__}, {tuple(t.shape)}): {e}"
            ) from e
        raise e
