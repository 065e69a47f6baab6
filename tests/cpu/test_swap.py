"""torchferry.swap (``_ferry/swap.py``): one state set out, another in, both bit-exact; bad arguments
(a closed ferry, a negative budget) are refused before anything moves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchferry
from torchferry import Ferry, Residency


def _pair():
    torch.manual_seed(0)
    actor, critic = nn.Linear(64, 64), nn.Linear(64, 1)
    return actor, critic, Ferry(actor), Ferry(critic)


def test_swap_moves_both_bit_exact():
    actor, critic, fa, fc = _pair()
    want_a, want_c = actor.weight.detach().clone(), critic.weight.detach().clone()
    fc.offload()
    h_out, h_in = torchferry.swap(fa, fc)
    h_out.wait()
    h_in.wait()
    assert fa.residency is Residency.HOST and fc.residency is Residency.DEVICE
    assert torch.equal(actor.weight, want_a) and torch.equal(critic.weight, want_c)
    torchferry.swap(fc, fa, gpu_budget_bytes=1 << 30)  # and back
    assert fa.residency is Residency.DEVICE and fc.residency is Residency.HOST
    assert torch.equal(actor.weight, want_a) and torch.equal(critic.weight, want_c)


def test_swap_refuses_bad_arguments():
    actor, critic, fa, fc = _pair()
    with pytest.raises(ValueError, match="same ferry"):
        torchferry.swap(fa, fa)
    assert fa.residency is Residency.DEVICE


def test_swap_into_a_closed_ferry_is_refused_before_moving_out():
    """A regression test (failed before its fix): swap() checks 'same ferry' and devices up front but not a closed `into`: `out` is offloaded,
    then into.reload() raises; the failed swap leaves `out` offloaded (nothing rolled back)."""
    a, c = nn.Linear(8, 8), nn.Linear(8, 8)
    fa, fc = Ferry(a), Ferry(c)
    fc.offload()
    fc.reload()
    fc.close()
    with pytest.raises((ValueError, RuntimeError)):
        torchferry.swap(fa, fc)
    assert fa.residency is Residency.DEVICE, "the failed swap left `out` offloaded"


@pytest.mark.parametrize("how", ["raises", "collected"])
def test_a_failed_swap_leaves_an_out_that_was_already_offloaded_where_it_was(how, monkeypatch):
    """swap() is a no-op for an ``out`` already offloaded; when ``into``'s reload then fails (an error, a collected
    target), the failed swap leaves ``out`` offloaded too (it had reloaded it: on a GPU, after an out-of-memory
    in ``into``'s reload, both sets' allocations at once)."""
    a, c = nn.Linear(8, 8), nn.Linear(8, 8)
    fa, fc = Ferry(a), Ferry(c)
    want = a.weight.detach().clone()
    fa.offload()
    fc.offload()
    if how == "raises":
        def fail(*args, **kwargs):
            raise RuntimeError("into's reload failed")

        monkeypatch.setattr(fc, "_reload", fail)
    else:
        del c
    with pytest.raises((RuntimeError, ReferenceError)):
        torchferry.swap(fa, fc)
    assert fa.residency is Residency.HOST and fc.residency is Residency.HOST
    fa.reload()
    assert torch.equal(a.weight, want)


def test_a_swap_whose_rollback_fails_too_names_both_errors_and_leaves_both_offloaded_whole(monkeypatch):
    """``into``'s reload fails, then bringing ``out`` back fails too (on a GPU: out of memory both times): one
    error names both causes, both sets stay offloaded, and ``out.reload()`` retries exactly."""
    a, c = nn.Linear(8, 8), nn.Linear(8, 8)
    fa, fc = Ferry(a), Ferry(c)
    want_a, want_c = a.weight.detach().clone(), c.weight.detach().clone()
    fc.offload()

    def into_fails(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (into)")

    def out_fails(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (out)")

    monkeypatch.setattr(fc, "_reload", into_fails)
    monkeypatch.setattr(fa, "reload", out_fails)
    with pytest.raises(RuntimeError, match=r"into's reload failed \(RuntimeError: CUDA out of memory \(into\)\) "
                       r"and bringing out back failed too \(RuntimeError: CUDA out of memory \(out\)\)") as e:
        torchferry.swap(fa, fc)
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, RuntimeError)
    assert fa.residency is Residency.HOST and fc.residency is Residency.HOST
    monkeypatch.undo()
    fa.reload()
    fc.reload()
    assert torch.equal(a.weight, want_a) and torch.equal(c.weight, want_c)


def test_swap_refuses_a_negative_budget():
    """A regression test (failed before its fix): gpu_budget_bytes is not validated (negative / zero accepted; on the CPU ignored entirely)."""
    a, c = nn.Linear(8, 8), nn.Linear(8, 8)
    fa, fc = Ferry(a), Ferry(c)
    fc.offload()
    with pytest.raises(ValueError):
        torchferry.swap(fa, fc, gpu_budget_bytes=-1)


def test_swap_fits_answers_before_a_swap_what_it_would_refuse():
    """The dock's question (``_dock/mover.py``): no budget, or the CPU's, always fits; a negative one never does
    on a GPU, where ``swap()`` refuses it (``tests/gpu/test_dock_cuda.py`` runs the dock's swaps)."""
    from torchferry._core._ferry.swap import swap_fits

    _, _, fa, fc = _pair()
    fc.offload()
    assert swap_fits(fa, fc, None) and swap_fits(fa, fc, 0) and swap_fits(fa, fc, 1 << 30)
    if torch.cuda.is_available():
        g, h = Ferry(nn.Linear(8, 8).cuda()), Ferry(nn.Linear(8, 8).cuda())
        h.offload().wait()
        assert not swap_fits(g, h, -1) and not swap_fits(g, h, 0) and swap_fits(g, h, 1 << 40)


def test_swap_if_fits_swaps_or_moves_nothing_under_one_measurement():
    """The dock's swap (``_dock/mover.py``): the question and the swap measured once, so an allocation by another
    thread between them cannot make the swap refuse; where the budget cannot hold it, ``None`` and nothing moved.
    Bad input is refused as :func:`torchferry.swap` refuses it."""
    from torchferry._core._ferry.swap import swap_if_fits

    a, c, fa, fc = _pair()
    want = a.weight.detach().clone(), c.weight.detach().clone()
    fc.offload()
    h_out, h_in = swap_if_fits(fa, fc, 0)  # the CPU's budget always fits
    assert fa.residency.on_host and fc.residency is Residency.DEVICE and (h_out.nbytes, h_in.nbytes) == (16640, 260)
    assert torch.equal(c.weight, want[1])
    with pytest.raises(ValueError, match="swap_if_fits: out and into are the same ferry"):
        swap_if_fits(fc, fc, None)
    with pytest.raises(TypeError, match=r"swap_if_fits\(into=...\) must be a torchferry.Ferry"):
        swap_if_fits(fc, object(), None)
    if torch.cuda.is_available():
        g, h = Ferry(nn.Linear(8, 8).cuda()), Ferry(nn.Linear(8, 8).cuda())
        h.offload().wait()
        assert swap_if_fits(g, h, 0) is None
        assert g.residency is Residency.DEVICE and h.residency is Residency.HOST
        assert swap_if_fits(g, h, 1 << 40) is not None
        assert g.residency.on_host and not h.residency.on_host
    fa.reload()
    assert torch.equal(a.weight, want[0])
