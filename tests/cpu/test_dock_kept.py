"""torchferry.Dock on the CPU with storages an offload keeps on the device ([Note: a storage shared with a
tensor the ferry does not know] in ``_core/_state/holders.py``): each counts once across sets, an eviction
counts only what it frees, and a reload brings in only what is not there already ([Note: kept storages count
once], [Note: an eviction frees what it releases] in ``_core/_dock/measure.py``)."""

import pytest
import torch

from torchferry import Dock, Ferry
from tests.cpu.test_dock import U, Set, dock_with


def test_a_storage_kept_for_two_sets_counts_once():
    """Two sets over halves of one storage that the caller holds (``base``): each offload keeps the storage
    (2 units); the dock counted it once per set (4 units held for 2 on the device)."""
    base = torch.randn(2 * U // 4, generator=torch.Generator().manual_seed(7))
    want = base.clone()
    fa, fb = Ferry(base[: U // 4], device="cpu"), Ferry(base[U // 4:], device="cpu")
    c = Set(1, seed=3, offloaded=False)
    dock = Dock(16 * U)
    for name, f in (("a", fa), ("b", fb), ("c", c.ferry)):
        dock.add(name, f)
    dock.evict("a")  # b, resident, counts the storage a kept
    assert fa.residency.on_host and not fb.residency.on_host
    assert dock.resident_bytes == 2 * U + U
    dock.evict("b")  # both kept it: once
    assert fb.residency.on_host
    assert dock.resident_bytes == 2 * U + U
    assert dock.free_bytes == 16 * U - 3 * U
    with dock.use("a", "b"):
        assert dock.resident_bytes == 2 * U + U  # resident, both view the one storage: once
    assert torch.equal(base, want)


def test_resident_sets_sharing_a_storage_never_take_the_dock_over_its_budget():
    """Two resident halves of a tensor the caller keeps counted it each: evicting one looked like freeing it, so
    loading ``c`` took the dock to 5 units over a 4-unit budget. Counted once, neither frees anything, and
    ``c`` is refused, naming what stays on the device."""
    base = torch.randn(2 * U // 4, generator=torch.Generator().manual_seed(7))
    c, e = torch.randn(U // 4), torch.randn(2 * U // 4)
    ferries = [Ferry(t, device="cpu") for t in (base[: U // 4], base[U // 4:], c, e)]
    for f in ferries:
        f.offload().wait()
    dock = Dock(4 * U)
    for name, f in zip("abce", ferries, strict=True):
        dock.add(name, f)
    with dock.use("a"):
        pass
    dock.acquire("e")
    dock.prefetch("b")
    assert dock.resident_bytes <= 4 * U
    with pytest.raises(RuntimeError, match=r"cannot make room for 'c'.*would leave on the device 'a'"):
        dock.acquire("c")
    assert dock.resident_bytes <= 4 * U and not dock.is_resident("c")


def test_a_set_whose_eviction_frees_nothing_is_not_chosen():
    """Least recently used is ``a``, but a view the caller holds keeps all of its storage: evicting it freed
    nothing and left the dock 4 units over the budget; ``b`` leaves instead."""
    dock, s = dock_with(8, a=4, b=4, c=4)
    with dock.use("a"):
        alias = s["a"].t[:10]  # a view the ferry does not know
    with dock.use("b"):
        pass
    with dock.use("c"):
        assert s["a"].resident and not s["b"].resident and s["c"].resident
        assert dock.resident_bytes == 8 * U
    assert s["a"].moves == (1, 1)  # offloaded when made, loaded by its use: not evicted since
    assert torch.equal(alias, s["a"].want[:10])


def test_no_room_when_only_sets_that_free_nothing_are_idle():
    """With the only idle set's storage held by the caller, ``use()`` cannot make room: it refuses, naming
    the bytes an eviction would leave, and moves nothing."""
    dock, s = dock_with(6, a=4, b=4)
    with dock.use("a"):
        alias = s["a"].t[:10]
    with pytest.raises(RuntimeError, match=r"cannot make room for 'b' .* an eviction would leave on the device "
                                           r"'a' 16384 bytes .*Nothing was moved"):
        with dock.use("b"):
            pass
    assert s["a"].resident and not s["b"].resident and s["a"].moves == (1, 1)
    assert dock.resident_bytes == 4 * U
    del alias
    with dock.use("b"):  # a's storage is its own again: its eviction frees it
        assert not s["a"].resident and dock.resident_bytes == 4 * U


def test_an_evicted_set_with_kept_storages_is_prefetched():
    """A prefetch of a set whose storage stayed on the device counted its bytes twice (kept and incoming):
    6 units needed for the 4 on the device, so it never loaded."""
    dock, s = dock_with(6, a=4)
    with dock.use("a"):
        alias = s["a"].t[:10]
    dock.evict("a")
    assert not s["a"].resident and dock.resident_bytes == 4 * U
    assert dock.prefetch("a") == ("a",)
    assert s["a"].resident and s["a"].moves == (2, 2)
    assert dock.resident_bytes == 4 * U
    with dock.use("a"):
        assert s["a"].moves == (2, 2) and dock.stats.prefetch_hits == 1
        assert torch.equal(s["a"].t, s["a"].want) and torch.equal(alias, s["a"].want[:10])
