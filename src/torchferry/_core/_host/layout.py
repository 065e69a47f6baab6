"""Where each storage of a plan lives in the host pool, and the views over it.

[Note: one storage per slot]
Every storage's slot is viewed through a storage of its own
(``HostBuffer.own_view``), not through a slice of the pool's one big storage:
a tensor offloaded and then pickled, saved with ``torch.save`` or sent through
a ``torch.multiprocessing`` queue carries only its own bytes (a 2 KiB bias
pickled to 8.4 MB, the whole pool with the Adam moments, when it sliced the
pool), and ``share_memory_()`` on it moves only that slot's storage, never
the pool under the ferry. A slot storage moved that way no longer views the
pool; :meth:`HostViews.intact` notices and the views are made again. The
packed chunks (``_transfer/packing``) are moved as slices of the pool's storage.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import NamedTuple

import torch

from .slots import PackChunk, layout
from .._state.plan import Plan
from .pool import HostPool
from .._state.fsdp import storage_key
from .._state.parking import view_on

__all__ = ["HostLayout", "HostViews", "pin_boundary"]


def pin_boundary(offsets: list[int], nbytes: list[int], chunks: list[PackChunk], cap: int) -> int:
    """The largest pool prefix of at most ``cap`` bytes that ends where a copy ends.

    Copies (a large storage's slot, a packed chunk) never straddle the
    boundary: each lies wholly in pinned or wholly in pageable memory.
    """
    packed = {si for ch in chunks for si in ch.storages}
    ends = [o + n for si, (o, n) in enumerate(zip(offsets, nbytes, strict=False)) if n and si not in packed]
    ends += [ch.pool_offset + ch.nbytes for ch in chunks]
    return max((e for e in ends if e <= cap), default=0)


class Layout(NamedTuple):
    """A plan's pool layout: byte offset per storage, pool bytes, packed chunks."""

    signature: tuple
    offsets: list[int]
    total: int
    chunks: list[PackChunk]


class HostViews:
    """The pool views of one plan and pool block, reused every cycle while both stay.

    Attributes:
        plan, block: the plan and pool block they were made for.
        slots: 1D uint8 views, one per storage, each on a storage of its own
            (see [Note: one storage per slot]).
        pool_chunks: 1D uint8 views of the pool, one per packed chunk.
        chunks: the packed chunks of the layout.
        packed: indices of the packed storages.
    """

    def __init__(self, plan: Plan, block: int, slots: list[torch.Tensor], pool_chunks: list[torch.Tensor],
                 chunks: list[PackChunk]) -> None:
        self.plan = plan  # held, so that no other plan can be mistaken for it
        self.block = block
        self.slots = slots
        self.pool_chunks = pool_chunks
        self.chunks = chunks
        self.packed = {si for ch in chunks for si in ch.storages}
        self._storages = [s.untyped_storage() for s in slots]
        self._ptrs = [st.data_ptr() for st in self._storages]
        self._host_locals: list[torch.Tensor] | None = None
        self._expected: tuple[list, list, list, list] | None = None
        self._offsets: list[int] = []  # per tensor, its slot view's storage offset (elements)
        self._slot_index: dict[int, int] | None = None

    @property
    def host_locals(self) -> list[torch.Tensor]:
        """Per ``plan.tensors`` entry, a view of its slot shaped like its local tensor."""
        if self._host_locals is None:
            self._host_locals = [view_on(r.local, self.slots[r.storage_index]) for r in self.plan.tensors]
            # Taken before any exchange: to_host() may give these very objects the device impls.
            self._expected = _signature(self._host_locals)
            self._offsets = list(map(torch.Tensor.storage_offset, self._host_locals))
        return self._host_locals

    def moved_away(self, locals_: list[torch.Tensor]) -> list[int]:
        """Indices of the plan's tensors whose local tensor (``locals_[i]``, taken while offloaded)
        no longer views its slot as the offload left it: address, shape, stride or dtype changed
        (``p.data = t``, ``p.set_(t)``); see [Note: storage swapped while offloaded]."""
        expected = self._expected
        if expected is None or _signature(locals_) == expected:  # the common case, at C speed
            return []
        return self.moved_among(enumerate(locals_))

    def moved_among(self, pairs: Iterable[tuple[int, torch.Tensor]]) -> list[int]:
        """As :meth:`moved_away` for the given ``(index, local tensor)`` pairs only, in their order
        (a layer-wise reload checks one unit's tensors at a time)."""
        expected = self._expected
        if expected is None:
            return []
        ptrs, shapes, strides, dtypes = expected
        return [i for i, t in pairs
                if (t.data_ptr() != ptrs[i] or t.shape != shapes[i] or t.stride() != strides[i]
                    or t.dtype != dtypes[i]) and not self._slot_moved(i, t)]

    def slot_of(self, storage: torch.UntypedStorage) -> int | None:
        """The plan's storage index whose slot ``storage`` is (each slot has a storage of its own),
        or ``None``."""
        if self._slot_index is None:
            self._slot_index = {storage_key(st): si for si, st in enumerate(self._storages)}
        return self._slot_index.get(storage_key(storage))

    def _slot_moved(self, i: int, t: torch.Tensor) -> bool:
        """Whether ``t`` still views its slot's storage as offloaded, the slot's memory having
        moved under it (``share_memory_()``, which :meth:`intact` finds): not the user's doing."""
        slot = self._storages[self.plan.tensors[i].storage_index]
        shapes, strides, dtypes = self._expected[1:]
        return (storage_key(t.untyped_storage()) == storage_key(slot) and t.shape == shapes[i]
                and t.stride() == strides[i] and t.dtype == dtypes[i] and t.storage_offset() == self._offsets[i])

    def intact(self) -> bool:
        """False if a slot's storage no longer views the pool (``share_memory_()`` moved it)."""
        return [st.data_ptr() for st in self._storages] == self._ptrs


class HostLayout:
    """A ferry's pool layout and host views, cached for the cached plan.

    Args:
        pool: the ferry's host pool.
        max_pinned_bytes: pin at most this prefix of the pool (``None``: all).
    """

    def __init__(self, pool: HostPool, max_pinned_bytes: int | None) -> None:
        self.pool = pool
        self.max_pinned_bytes = max_pinned_bytes
        self._layout: Layout | None = None
        self.cached: HostViews | None = None  # host views of the cached plan

    def layout(self, plan: Plan) -> Layout:
        """The plan's layout (cached by the plan's storage signature)."""
        sig = plan.signature()
        if self._layout is None or self._layout.signature != sig:
            offsets, total, chunks = layout(plan.nbytes)
            self._layout = Layout(sig, offsets, total, chunks)
        return self._layout

    def reserve(self, plan: Plan, *, background: bool = False, quiet: bool = False,
                skip_grads: bool = False) -> Future | None:
        """Makes the pool hold the plan's layout (a no-op when it does).

        Args:
            plan: the state to hold.
            background, quiet: as :meth:`HostPool.reserve`.
            skip_grads: size the pool as if the plan's ``.grad`` storages were
                gone (pinning ahead right after ``optimizer.step()``, before the
                ``zero_grad(set_to_none=True)`` that usually precedes the offload).

        Returns:
            With ``background``, a future of the pinning seconds (or ``None``).

        Raises:
            HostBudgetError, RuntimeError: as :meth:`HostPool.reserve`.
        """
        if skip_grads and plan.has_grads:
            grads = {r.storage_index for r in plan.tensors if r.name.endswith(".grad")}
            sizes = [n for si, n in enumerate(plan.nbytes) if si not in grads]
            offsets, total, chunks = layout(sizes)
        else:
            lay = self.layout(plan)
            sizes, offsets, total, chunks = plan.nbytes, lay.offsets, lay.total, lay.chunks
        pin_bytes = None
        if self.max_pinned_bytes is not None:
            pin_bytes = pin_boundary(offsets, sizes, chunks, self.max_pinned_bytes)
        if total > self.pool.nbytes:
            self.cached = None  # its views would keep the old block mapped
        return self.pool.reserve(total, pin_bytes=pin_bytes, background=background, quiet=quiet)

    def fits(self, plan: Plan) -> bool:
        """Whether the pool holds the plan's layout now (its views need no new block)."""
        return self.layout(plan).total <= self.pool.nbytes

    def views(self, plan: Plan, *, cache: bool) -> HostViews:
        """Pool views for ``plan`` (reserving the pool); kept for reuse when ``cache``.

        Raises:
            RuntimeError: host memory for the pool could not be allocated or pinned.
        """
        self.reserve(plan)
        block = self.pool.block_id
        hv = self.cached
        if hv is not None and hv.plan is plan and hv.block == block and hv.intact():
            return hv
        self.cached = None
        lay = self.layout(plan)
        slots = [self.pool.view(o, n, own=True) for o, n in zip(lay.offsets, plan.nbytes, strict=True)]
        pool_chunks = [self.pool.view(ch.pool_offset, ch.nbytes) for ch in lay.chunks]
        hv = HostViews(plan, block, slots, pool_chunks, lay.chunks)
        if cache:
            self.cached = hv
        return hv

    def current(self, plan: Plan) -> HostViews | None:
        """The cached views if they are ``plan``'s and the pool block is unchanged (no allocation)."""
        hv = self.cached
        if hv is not None and hv.plan is plan and self.pool.ready() and hv.block == self.pool.block_id and hv.intact():
            return hv
        return None

    def forget(self) -> None:
        """Drops the cached views (they keep the pool's memory mapped)."""
        self.cached = None


def _signature(tensors: list[torch.Tensor]) -> tuple[list, list, list, list]:
    """Addresses, shapes, strides and dtypes (about 0.4 us a tensor: ``map`` over the C methods)."""
    return (list(map(torch.Tensor.data_ptr, tensors)), [t.shape for t in tensors],
            list(map(torch.Tensor.stride, tensors)), [t.dtype for t in tensors])
