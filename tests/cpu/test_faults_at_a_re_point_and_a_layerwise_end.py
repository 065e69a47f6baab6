"""Variants of the all-or-nothing guarantee (docs/reliability.md: "Every transfer is all or nothing under any
exception ... in offload(), reload() (plain and layer-wise) ... a re-point"), faulted the way
``test_faults.py`` faults them (a trace function raising at one torchferry call), at points its sweeps do not
reach: an FSDP2 offload whose parameters hold gradients (``_prefetch_body`` drops them first), and the end of a
layer-wise reload completed by ``reload()``."""

from __future__ import annotations

import sys


import torchferry
from torchferry import Ferry
from torchferry._core._state.host_blocks import in_host_pool
from tests.cpu.test_faults import SRC, Case, _counting_hooks, _run, fsdp2_stepped
from tests.helpers import assert_same, snapshot
from tests.spawn import run_spawned


class _RaiseAt:
    """Raises ``exc`` at the first call of the torchferry function ``name`` (made from ``caller``, if given)."""

    def __init__(self, name: str, exc: type[BaseException], caller: str | None = None) -> None:
        self.name, self.exc, self.caller, self.hit = name, exc, caller, False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if (event == "call" and not self.hit and code.co_filename.startswith(SRC) and code.co_name == self.name
                and (self.caller is None or (frame.f_back is not None and frame.f_back.f_code.co_name == self.caller))):
            self.hit = True
            sys.settrace(None)
            raise self.exc(f"injected at {self.name}")
        return None


def _offload_with_grads_body(rank, world):
    from tests.helpers import cpu_mesh

    for exc in (RuntimeError, SystemExit, KeyboardInterrupt):
        m, opt, x = fsdp2_stepped(cpu_mesh(world))  # grads kept: they move with the parameters
        case = _counting_hooks(Case(m, opt, x, Ferry(m, opt, device="cpu")))
        case.ferry.offload()
        case.ferry.reload()
        want = snapshot(m, opt)
        inj = _RaiseAt("swap_local", exc)  # the re-point of the first DTensor parameter
        err = _run(case.ferry.offload, inj)
        assert inj.hit and err is not None, exc
        what = f"{exc.__name__} at swap_local: {err!r}"
        assert case.ferry.residency is torchferry.Residency.DEVICE, what
        # as before the call: every grad present, none on the host pool, every value exact
        for n, p in m.named_parameters():
            assert p.grad is not None, f"{what}: {n}.grad lost"
            assert not in_host_pool(p.grad._local_tensor.data_ptr()), f"{what}: {n}.grad views the host pool"
        assert_same(snapshot(m, opt), want)
        # and a retry cycles, every hook firing once after it
        case.ferry.offload()
        case.ferry.reload()
        assert_same(snapshot(m, opt), want)
        case.fires.clear()
        opt.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        assert sorted(case.fires.values()) == [1] * len(list(m.parameters())), what


def test_a_failed_re_point_of_an_fsdp2_offload_with_grads_leaves_the_grads_as_they_were():
    """An FSDP2 model holding gradients, an exception at the first DTensor re-point of ``offload()``: the call
    raises with residency DEVICE, but the first parameter's ``.grad`` is left viewing the host pool (seen with
    RuntimeError and SystemExit; ``_exchange`` swapped the impls, then ``swap_local`` raised, and the half-done
    exchange is not in ``done`` so it is never undone); the next ``offload()`` is then refused for good
    ("targets[0].0.weight.grad is already offloaded by another Ferry"). The same fault in the offload of a
    layer-wise reload's tail (after the units' forward and backward) drops that ``.grad`` instead."""
    run_spawned(_offload_with_grads_body, world=1, timeout_s=200)


def _end_of_layerwise_body(rank, world):
    from tests.helpers import cpu_mesh

    m, opt, x = fsdp2_stepped(cpu_mesh(world))
    opt.zero_grad(set_to_none=True)  # a layer-wise reload moves no grads
    ferry = Ferry(m, opt, device="cpu")
    ferry.offload()
    ferry.reload()
    ferry.offload()
    want = snapshot(m, opt)
    ferry.reload(prefetch=True)
    # the run's bookkeeping is dropped, then residency is set: a fault between the two
    inj = _RaiseAt("is_cuda", RuntimeError, caller="_end_prefetch")
    err = _run(ferry.reload, inj)
    assert inj.hit and err is not None
    ferry.reload()  # a retry completes it
    assert ferry.residency is torchferry.Residency.DEVICE, f"after {err!r} and a retried reload(): {ferry.residency}"
    assert_same(snapshot(m, opt), want)
    ferry.offload()
    ferry.reload()
    assert ferry.residency is torchferry.Residency.DEVICE
    assert_same(snapshot(m, opt), want)


def test_a_fault_ending_a_layerwise_reload_leaves_a_reload_that_completes_it():
    """``reload()`` completing a layer-wise reload: ``_end_prefetch`` drops the run and the offload record, then
    sets residency; an exception between leaves the ferry PREFETCHING with no run, and every later
    ``reload()`` returns leaving it PREFETCHING."""
    run_spawned(_end_of_layerwise_body, world=1, timeout_s=200)
