"""Misuse refused clearly with the state intact, never a crash or silent corruption: threads, a first offload under
``no_grad`` / ``inference_mode``, aliases the ferry does not know, copies and pickles of offloaded state, state dicts
while offloaded, a ferry closed inside a dock, ferries over a module and its submodule, ``torch.compile``."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from torch import nn

from torchferry import Dock, Ferry, Residency


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def _values(m) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _same(m, want) -> None:
    for p, w in zip(m.parameters(), want, strict=True):
        assert torch.equal(p.detach(), w)


def _stepped():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    return m, opt


# --------------------------------------------------------------- threads
def test_a_dock_use_from_another_thread_while_a_thread_offloads_its_ferry_keeps_true_records(own_ledger, monkeypatch):
    from torchferry._core._ferry import state_set

    m = _model()
    want = _values(m)
    f = Ferry(m, device="cpu")
    dock = Dock(1 << 20, device="cpu")
    dock.add("m", f)
    inside, go_on = threading.Event(), threading.Event()
    real = state_set.StateSet.offload

    def slow(self, schedule):
        inside.set()
        go_on.wait(10)
        return real(self, schedule)

    monkeypatch.setattr(state_set.StateSet, "offload", slow)
    t = threading.Thread(target=f.offload, name="mover")
    t.start()
    assert inside.wait(10)
    try:
        with dock.use("m"):
            go_on.set()
            t.join(10)
            if f.residency is not Residency.DEVICE:  # offloaded directly by the other thread: loud, not corrupt
                with pytest.raises(RuntimeError, match="offloaded"):
                    m(torch.ones(2, 8))
    finally:
        go_on.set()
    t.join(10)
    monkeypatch.setattr(state_set.StateSet, "offload", real)
    assert not dock.in_use
    with dock.use("m"):
        assert f.residency is Residency.DEVICE
        _same(m, want)
        m(torch.ones(2, 8))


def test_a_forward_in_another_thread_while_one_reloads_is_refused_or_exact(own_ledger, monkeypatch):
    from torchferry._core._ferry import state_set

    m = _model()
    x = torch.ones(2, 8)
    out = m(x).detach().clone()
    f = Ferry(m, device="cpu")
    f.offload()
    inside, go_on = threading.Event(), threading.Event()
    real = state_set.StateSet.reload

    def slow(self, *a, **k):
        inside.set()
        go_on.wait(10)
        return real(self, *a, **k)

    monkeypatch.setattr(state_set.StateSet, "reload", slow)
    t = threading.Thread(target=f.reload, name="mover")
    t.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="offloaded"):
        m(x)
    go_on.set()
    t.join(10)
    assert f.residency is Residency.DEVICE
    assert torch.equal(m(x), out)


# --------------------------------------------------------------- grad modes
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("skip", [False, True])
def test_a_first_offload_under_a_grad_mode_with_optimizer_state_trains_exactly(own_ledger, mode, skip):
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    ref_m, ref_opt = _stepped()
    m, opt = _stepped()
    f = Ferry(m, opt, skip_unchanged=skip, device="cpu")
    with ctx():
        f.offload()
    f.reload()
    for mm, oo in ((m, opt), (ref_m, ref_opt)):
        mm(torch.ones(2, 8)).sum().backward()
        oo.step()
    _same(m, _values(ref_m))
    with ctx():
        f.offload()
        f.reload()
    assert all(not p.is_inference() for p in m.parameters())
    assert all(not t.is_inference() for s in opt.state.values() for t in s.values())


def test_a_first_prefetch_reload_under_inference_mode_leaves_the_state_usable(own_ledger):
    m, opt = _stepped()
    want = _values(m)
    f = Ferry(m, device="cpu")
    f.offload()
    with torch.inference_mode():
        f.reload(prefetch=True)
        m(torch.ones(2, 8))
    f.reload()
    _same(m, want)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()


# --------------------------------------------------------------- views the ferry does not know
def _aliases(p):
    return {
        "slice": lambda: p[1:3],
        "view": lambda: p.view(-1),
        "expand": lambda: p[0:1].expand(4, -1),
        "as_strided": lambda: p.as_strided((2, 2), (1, 8), 3),
        "storage": lambda: torch.empty(0, dtype=p.dtype).set_(p.untyped_storage()),
        "storage_offset": lambda: torch.empty(0, dtype=p.dtype).set_(p.untyped_storage(), 8, (4,), (1,)),
        "detach_view": lambda: p.detach().view(4, 16),
        "unflatten": lambda: p.detach().T,
    }


@pytest.mark.parametrize("kind", list(_aliases(torch.zeros(8, 8))))
def test_an_unknown_alias_of_a_parameter_stays_readable_and_shares_again(own_ledger, kind):
    m = _model()
    p = m[0].weight
    a = _aliases(p)[kind]()
    want_a, want = a.detach().clone(), _values(m)
    f = Ferry(m, device="cpu")
    for _ in range(2):
        f.offload()
        assert torch.equal(a, want_a)
        f.reload()
        _same(m, want)
        with torch.no_grad():
            p.add_(1)
        assert torch.equal(a.detach(), _aliases(p)[kind]().detach())
        with torch.no_grad():
            p.copy_(want[0])


@pytest.mark.parametrize("kind", ["slice", "view", "expand", "as_strided", "storage"])
def test_an_unknown_alias_of_optimizer_state_stays_readable(own_ledger, kind):
    m, opt = _stepped()
    s = opt.state[m[0].weight]["exp_avg"]
    a = _aliases(s)[kind]()
    want_a = a.clone()
    f = Ferry(m, opt, device="cpu")
    f.offload()
    assert torch.equal(a, want_a)
    f.reload()
    assert torch.equal(a, want_a)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert torch.equal(a, _aliases(s)[kind]())


# --------------------------------------------------------------- copies and pickles
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copying_an_offloaded_optimizer_gives_its_exact_state_and_leaves_it_intact(own_ledger, how):
    m, opt = _stepped()
    want = copy.deepcopy(opt.state_dict())
    f = Ferry(m, opt, device="cpu")
    f.offload()
    if how == "deepcopy":
        c = copy.deepcopy(opt)
    elif how == "pickle":
        c = pickle.loads(pickle.dumps(opt))
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    for k, s in want["state"].items():
        for n, v in s.items():
            assert torch.equal(c.state_dict()["state"][k][n], v)
    f.reload()
    for k, s in want["state"].items():
        for n, v in s.items():
            assert torch.equal(opt.state_dict()["state"][k][n], v)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    f.offload()
    f.reload()


@pytest.mark.parametrize("how", ["pickle", "deepcopy_sub"])
def test_copying_an_offloaded_module_is_refused_and_leaves_it_intact(own_ledger, how):
    m = _model()
    want = _values(m)
    f = Ferry(m, device="cpu")
    f.offload()
    with pytest.raises(RuntimeError, match="torchferry: cannot copy or pickle"):
        if how == "pickle":
            pickle.dumps(m)
        else:
            copy.deepcopy(m[0])  # a submodule of the target
    f.reload()
    _same(m, want)


# --------------------------------------------------------------- state dicts while offloaded
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_while_offloaded_is_what_comes_back(own_ledger, skip, assign):
    m = _model()
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    sd = {k: v.detach().clone() for k, v in other.state_dict().items()}
    f = Ferry(m, skip_unchanged=skip, device="cpu")
    f.offload()
    f.reload()
    f.offload()
    m.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=assign)
    f.reload()
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    f.offload()
    f.reload()
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert f.residency is Residency.DEVICE


def test_a_state_dict_taken_while_offloaded_and_loaded_after_the_reload_round_trips(own_ledger):
    m, opt = _stepped()
    f = Ferry(m, opt, device="cpu")
    f.offload()
    msd, osd = m.state_dict(), opt.state_dict()
    f.reload()
    m2, opt2 = _stepped()
    m2.load_state_dict(msd)
    opt2.load_state_dict(osd)
    _same(m2, _values(m))
    f.offload()  # the pool overwritten: the copies loaded above must not alias it
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(0)
    f.reload()
    _same(m2, _values(m))


# --------------------------------------------------------------- a ferry inside a dock
@pytest.mark.parametrize("when", ["resident", "evicted"])
def test_a_ferry_closed_inside_a_dock_is_refused_by_the_dock_and_the_state_stays(own_ledger, when):
    m = _model()
    want = _values(m)
    f = Ferry(m, device="cpu")
    lin = torch.nn.Linear(64, 64)
    g = Ferry(lin, device="cpu")
    dock = Dock(1 << 20, device="cpu")
    dock.add("m", f)
    dock.add("g", g)
    if when == "evicted":
        dock.evict("m")
        with pytest.raises(RuntimeError, match=r"close\(\) while the state is offloaded"):
            f.close()
        with dock.use("m"):
            _same(m, want)
        return
    f.close()
    _same(m, want)
    with dock.use("m"):
        _same(m, want)
    dock.remove("m")
    with dock.use("g"):  # the rest of the dock works
        pass
    _same(m, want)
    m(torch.ones(2, 8))


def test_a_ferry_closed_inside_a_use_block_leaves_the_dock_usable(own_ledger):
    m = _model()
    want = _values(m)
    f = Ferry(m, device="cpu")
    dock = Dock(1 << 20, device="cpu")
    dock.add("m", f)
    with dock.use("m"):
        f.close()
    assert not dock.in_use
    dock.remove("m")
    _same(m, want)


# --------------------------------------------------------------- a ferry over a module and one over its submodule
@pytest.mark.parametrize("order", ["outer_first", "inner_first"])
def test_a_ferry_over_a_submodule_of_another_ferrys_module_is_refused_or_exact(own_ledger, order):
    m = _model()
    want = _values(m)
    x = torch.ones(2, 8)
    out = m(x).detach().clone()
    outer = Ferry(m, device="cpu")
    inner = Ferry(m[0], device="cpu")
    first, second = (outer, inner) if order == "outer_first" else (inner, outer)
    first.offload()
    with pytest.raises(RuntimeError, match="another Ferry|offloaded by"):
        second.offload()
    with pytest.raises(RuntimeError):
        second.reload() if second.residency is not Residency.DEVICE else (_ for _ in ()).throw(RuntimeError())
    first.reload()
    _same(m, want)
    second.offload()
    second.reload()
    _same(m, want)
    assert torch.equal(m(x), out)


def test_the_outer_ferry_reloading_while_the_inner_one_holds_its_submodule_is_refused(own_ledger):
    m = _model()
    want = _values(m)
    outer = Ferry(m, device="cpu")
    inner = Ferry(m[0], device="cpu")
    outer.offload()
    outer.reload()
    inner.offload()
    with pytest.raises(RuntimeError):
        outer.offload()
    assert outer.residency is Residency.DEVICE
    inner.reload()
    outer.offload()
    outer.reload()
    _same(m, want)


# --------------------------------------------------------------- torch.compile
def test_a_compiled_module_round_trips_and_its_compiled_forward_is_exact(own_ledger):
    m = _model()
    c = torch.compile(m, backend="eager")
    x = torch.ones(2, 8)
    out = c(x).detach().clone()
    f = Ferry(c, device="cpu")
    for _ in range(2):
        f.offload()
        f.reload()
        assert torch.equal(c(x), out)
        assert torch.equal(m(x), out)
