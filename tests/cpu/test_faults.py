"""Every transfer is all or nothing under any exception ([Note: all or nothing] in
``torchferry._core._ferry.interrupts``).

Each case brings a ferry to a state, then runs one transfer call once per torchferry function
call it makes, raising at that call (``KeyboardInterrupt``, ``SystemExit``, an out-of-memory or a
``RuntimeError``, in turn). After every fault the state must be consistent (residency, where the
tensors live, the forward guard, every value bit-exact) and a retry must complete the cycle with
every autograd hook firing exactly once (before: a fault in the reload's
baseline hash left residency HOST with the tensors on the device, and the retried reload gave the
parameters the host twins' impls, so 0 of their post-accumulate hooks fired).
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import torchferry
from torchferry import Ferry
from torchferry._core._state.host_blocks import in_host_pool
from tests.helpers import assert_same, snapshot
from tests.spawn import run_spawned

SRC = os.path.dirname(torchferry.__file__) + os.sep
FAULTS = (KeyboardInterrupt, SystemExit, torch.OutOfMemoryError, RuntimeError)


class _Injector:
    """A trace function raising at the ``n``-th call of a torchferry function (``n=None``: counts)."""

    def __init__(self, n: int | None, exc: type[BaseException] = RuntimeError) -> None:
        self.n, self.exc, self.calls, self.where = n, exc, 0, None
        self.sites: list[tuple] = []  # counting: per call, (function, caller, caller's line)

    def points(self) -> list[int]:
        """The calls to fault: the first and the last call of each call site (a loop over the
        tensors is faulted at its first and its last iteration)."""
        first: dict[tuple, int] = {}
        last: dict[tuple, int] = {}
        for i, site in enumerate(self.sites):
            first.setdefault(site, i)
            last[site] = i
        return sorted(set(first.values()) | set(last.values()))

    def __call__(self, frame, event, arg):
        code = frame.f_code  # comprehensions and generator expressions are parts of their caller's step
        if event == "call" and code.co_filename.startswith(SRC) and not code.co_name.startswith("<"):
            if self.n is None:
                caller = frame.f_back
                self.sites.append((frame.f_code, caller.f_code if caller else None, caller.f_lineno if caller else 0))
            elif self.calls == self.n:
                self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                sys.settrace(None)
                raise self.exc(f"injected at {self.where}")
            self.calls += 1
        return None


def _run(fn, injector: _Injector) -> BaseException | None:
    sys.settrace(injector)
    try:
        fn()
    except BaseException as e:  # noqa: B036 (the faults are what is tested)
        return e
    finally:
        sys.settrace(None)
    return None


@dataclass
class Case:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    ferry: Ferry
    fires: dict = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for p in self.model.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out += list(self.model.buffers())
        out += [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return [t._local_tensor if hasattr(t, "_local_tensor") else t for t in out]


def _plain_case(skip: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(16, 8)
    m(x).square().mean().backward()
    opt.step()  # grads kept: parameters, grads, buffers and optimizer state all move
    return _counting_hooks(Case(m, opt, x, Ferry(m, opt, device="cpu", skip_unchanged=skip)))


def _counting_hooks(case: Case) -> Case:
    """A post-accumulate-grad hook on every parameter, counting in ``case.fires``."""
    for p in case.model.parameters():
        p.register_post_accumulate_grad_hook(lambda p, f=case.fires: f.__setitem__(id(p), f.get(id(p), 0) + 1))
    return case


def _on_pool(case: Case) -> list[bool]:
    return [in_host_pool(t.data_ptr()) for t in case.tensors() if t.numel()]


def _check_consistent(case: Case, before: list[bool], expected: dict, what: str) -> None:
    """Residency, where each tensor lives and the forward guard agree; every value is as before.
    Offloaded: each tensor where it was before the call (a replacement made while offloaded is
    off the pool), or all on the pool (the call completed)."""
    r = case.ferry.residency
    if r is torchferry.Residency.PREFETCHING:
        case.ferry.reload()  # completes the layer-wise reload
        r = case.ferry.residency
    on_pool = _on_pool(case)
    if r.on_host:
        assert on_pool == before or all(on_pool), f"{what}: residency {r.name}, tensors on the pool {on_pool}"
        with pytest.raises(RuntimeError, match="offloaded"):
            case.model(case.x)
    else:
        assert not any(on_pool), f"{what}: residency {r.name} but {sum(on_pool)} tensors still on the pool"
    assert_same(snapshot(case.model, case.opt), expected)


def _check_retry(case: Case, expected: dict, what: str) -> None:
    """A full cycle after the fault: bit-exact, then every parameter's hook fires exactly once."""
    case.ferry.offload()
    case.ferry.reload()
    assert case.ferry.residency is torchferry.Residency.DEVICE, what
    assert_same(snapshot(case.model, case.opt), expected)
    case.fires.clear()
    case.opt.zero_grad(set_to_none=True)
    case.model(case.x).square().mean().backward()
    params = list(case.model.parameters())
    assert case.fires == {id(p): 1 for p in params}, f"{what}: hooks fired {case.fires}"
    case.opt.step()
    after = snapshot(case.model, case.opt)
    case.ferry.offload()
    case.ferry.reload()
    assert_same(snapshot(case.model, case.opt), after)


def _replace_optimizer_state(case: Case) -> None:
    """A checkpoint resume while offloaded: new (CPU) state tensors where the ferry's were."""
    sd = copy.deepcopy(case.opt.state_dict())
    case.opt.load_state_dict(sd)


def _assign_weight(case: Case) -> None:
    """``p.data = t`` while offloaded (other bytes, same object)."""
    w = case.model[0].weight
    w.data = torch.randn_like(w) * 3


# name -> (prepare, operation)
OPS = {
    "first offload": (lambda c: None, lambda c: c.ferry.offload()),
    "offload": (lambda c: (c.ferry.offload(), c.ferry.reload()), lambda c: c.ferry.offload()),
    "reload": (lambda c: (c.ferry.offload(), c.ferry.reload(), c.ferry.offload()), lambda c: c.ferry.reload()),
    "reload, state replaced": (lambda c: (c.ferry.offload(), _replace_optimizer_state(c)),
                               lambda c: c.ferry.reload()),
    "offload, state replaced": (lambda c: (c.ferry.offload(), _replace_optimizer_state(c)),
                                lambda c: c.ferry.offload()),
    "reload, bytes assigned": (lambda c: (c.ferry.offload(), _assign_weight(c)), lambda c: c.ferry.reload()),
}


def _sweep(build, prepare, op, name: str) -> int:
    """Runs ``op`` once per torchferry call site it reaches (first and last call of each), faulting
    at that call; returns the number of faults."""
    case = build()
    prepare(case)
    counter = _Injector(None)
    assert _run(functools.partial(op, case), counter) is None
    total = counter.calls
    points = counter.points()
    assert len(points) > 10, f"{name}: only {len(points)} call sites traced"
    for n in points:
        case = build()
        prepare(case)
        expected, before = snapshot(case.model, case.opt), _on_pool(case)
        inj = _Injector(n, FAULTS[n % len(FAULTS)])
        err = _run(functools.partial(op, case), inj)
        what = f"{name}: fault {n}/{total} at {inj.where}"
        # None: a best-effort step absorbed it (a hash that failed: the offload copies instead).
        assert err is None or isinstance(err, (inj.exc, RuntimeError)), f"{what}: {type(err).__name__}: {err}"
        _check_consistent(case, before, expected, what)
        _check_retry(case, expected, what)
    return len(points)


@pytest.mark.parametrize("skip", [False, True], ids=["copy-all", "skip-unchanged"])
@pytest.mark.parametrize("name", list(OPS))
def test_transfer_is_all_or_nothing_under_a_fault_at_every_call(name, skip):
    prepare, op = OPS[name]
    _sweep(lambda: _plain_case(skip), prepare, op, name)


def test_reload_fault_in_the_baseline_hash_keeps_hooks(monkeypatch):
    """The smallest case: ``KeyboardInterrupt`` in the reload's baseline hash, then a retry."""
    import torchferry._core._schedules.unchanged as unchanged

    m = nn.Linear(64, 64)
    fires = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fires.append(p))
    ferry = Ferry(m, device="cpu", skip_unchanged=True)
    ferry.offload()
    ferry.reload()
    ferry.offload()
    with monkeypatch.context() as mp:
        mp.setattr(unchanged, "hash_storages", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            ferry.reload()
    assert ferry.residency is torchferry.Residency.HOST
    assert in_host_pool(m.weight.data_ptr())
    ferry.reload()
    assert not in_host_pool(m.weight.data_ptr())
    m(torch.randn(2, 64)).sum().backward()
    assert len(fires) == 2


def test_sigint_during_a_transfer_is_raised_after_it_completes(monkeypatch):
    """A real Ctrl-C (SIGINT) arriving while a call re-points tensors is held until the call is done."""
    import signal

    import torchferry._core._state.parking as repoint

    m = nn.Linear(16, 16)
    ferry = Ferry(m, device="cpu")
    before = m.weight.detach().clone()
    real = repoint._exchange
    sent = []

    def exchange(a, b, dtensor):
        real(a, b, dtensor)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)  # delivered between two exchanges

    # Python's own handler for the test, whatever the test process inherited (an ignored SIGINT is
    # left alone by the ferry, as the caller chose): a CI worker once had it ignored here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with monkeypatch.context() as mp:
            mp.setattr(repoint, "_exchange", exchange)
            with pytest.raises(KeyboardInterrupt):
                ferry.offload()
        assert ferry.residency.on_host  # the offload completed, then Ctrl-C was raised
        assert all(in_host_pool(p.data_ptr()) for p in m.parameters())
        ferry.reload()
        assert torch.equal(m.weight, before)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


class _Stop(Exception):
    """What the test's SIGTERM handler raises (as a worker's handler raises ``SystemExit``)."""


@pytest.mark.parametrize("where", ["between the installs", "between the restores"])
def test_a_signal_between_two_handler_swaps_is_neither_lost_nor_left_held(where, monkeypatch):
    """[Note: a signal between two handler swaps] in ``_core/_transfer/signals.py``: a SIGTERM whose handler
    raises, arriving between the two installs, left SIGINT's hold in place (every later Ctrl-C swallowed); a
    Ctrl-C between the two restores left SIGTERM's hold in place and the SIGTERM held during the call lost."""
    from torchferry._core._transfer import signals

    got = []

    def on_term(signum, frame):
        got.append("SIGTERM")
        raise _Stop

    previous = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, signal.default_int_handler),
                                                    (signal.SIGTERM, on_term))}
    real, calls = signal.signal, []

    def swap(signum, handler):  # a signal arrives right after the first swap of the installs, or of the restores
        out = real(signum, handler)
        calls.append(signum)
        if where == "between the installs" and len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)
        if where == "between the restores" and len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return out

    m = nn.Linear(16, 16)
    before = m.weight.detach().clone()
    ferry = Ferry(m, device="cpu")
    try:
        monkeypatch.setattr(signals.signal, "signal", swap)
        if where == "between the installs":
            with pytest.raises(_Stop):
                ferry.offload()
            assert ferry.residency is torchferry.Residency.DEVICE  # nothing moved: it never got in
        else:
            with pytest.raises(_Stop) as e:  # both delivered: the Ctrl-C as it came, then the SIGTERM held
                with signals.deferred():
                    signal.raise_signal(signal.SIGTERM)  # held for the block
            assert got == ["SIGTERM"] and isinstance(e.value.__context__, KeyboardInterrupt)
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is on_term
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C works again
            signal.raise_signal(signal.SIGINT)
        ferry.offload()
        ferry.reload()
        assert torch.equal(m.weight, before)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_an_ignored_sigint_stays_ignored_through_a_transfer(monkeypatch):
    """A caller that ignores SIGINT (``SIG_IGN``) keeps ignoring it: a Ctrl-C during an offload is not
    turned into a ``KeyboardInterrupt`` and the handler is ``SIG_IGN`` after the call."""
    import signal

    import torchferry._core._state.parking as repoint

    m = nn.Linear(16, 16)
    ferry = Ferry(m, device="cpu")
    real = repoint._exchange

    def exchange(a, b, dtensor):
        real(a, b, dtensor)
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with monkeypatch.context() as mp:
            mp.setattr(repoint, "_exchange", exchange)
            ferry.offload()
        assert ferry.residency.on_host and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    ferry.reload()


def fsdp2_stepped(mesh):
    """Three Linears (two FSDP2 units and the root's), AdamW stepped once: gradients kept, state made."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    m(x).square().mean().backward()
    opt.step()
    return m, opt, x


def _prefetch_body(rank, world):
    from tests.helpers import cpu_mesh

    mesh = cpu_mesh(world)

    def build():
        m, opt, x = fsdp2_stepped(mesh)
        opt.zero_grad(set_to_none=True)  # a layer-wise reload moves no grads
        return _counting_hooks(Case(m, opt, x, Ferry(m, opt, device="cpu", skip_unchanged=True)))

    offloaded = lambda c: (c.ferry.offload(), c.ferry.reload(), c.ferry.offload())  # noqa: E731
    _sweep(build, offloaded, lambda c: c.ferry.reload(prefetch=True), "reload(prefetch=True)")
    _sweep(build, lambda c: (offloaded(c), c.ferry.reload(prefetch=True)),
           lambda c: c.model(c.x), "forward during a layer-wise reload")


def test_layerwise_reload_is_all_or_nothing_under_a_fault_at_every_call():
    run_spawned(_prefetch_body, world=1, timeout_s=600)


# ------------------------------------------------------------------ device memory freed or allocated
_REAL_RESIZE = torch.UntypedStorage.resize_


class _ResizeFault:
    """Stands in for ``UntypedStorage.resize_``: its ``n``-th call (``None``: none, counting) raises
    ``exc``, or, with ``sigterm``, completes and then sends this process a real SIGTERM."""

    def __init__(self, n: int | None, exc: type[BaseException] = RuntimeError, sigterm: bool = False) -> None:
        self.n, self.exc, self.sigterm, self.calls = n, exc, sigterm, 0

    def __call__(self, storage: torch.UntypedStorage, size: int):
        i, self.calls = self.calls, self.calls + 1
        if i != self.n:
            return _REAL_RESIZE(storage, size)
        if not self.sigterm:
            raise self.exc(f"injected at resize_ call {i} (size {size})")
        out = _REAL_RESIZE(storage, size)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: inside the loop
        return out

    @property
    def method(self):
        """What to set as ``UntypedStorage.resize_`` (a function, so that it binds the storage)."""
        return lambda storage, size: self(storage, size)


@dataclass
class Other:
    """A second state set, offloaded: what a swap brings in, what a dock loads."""

    t: torch.Tensor
    want: torch.Tensor
    ferry: Ferry
    dock: torchferry.Dock | None = None


def _other(case: Case, dock: bool) -> Other:
    t = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    o = Other(t, t.clone(), Ferry(t, device="cpu"))
    o.ferry.offload()
    if dock:  # room for one of the two: using "other" evicts "case"
        budget = max(case.ferry.reserve_host() and 0 or case.ferry.state_bytes, o.ferry.state_bytes) + 64
        o.dock = torchferry.Dock(budget, device="cpu")
        o.dock.add("case", case.ferry)
        o.dock.add("other", o.ferry)
    return o


def _use(dock: torchferry.Dock | None, name: str) -> None:
    assert dock is not None
    with dock.use(name):
        pass


# name -> (prepare, operation, retry of the operation); prepare returns the second set, if any
MOVES = {
    "first offload": (lambda c: None, lambda c, o: c.ferry.offload(), None),
    "offload": (lambda c: (c.ferry.offload(), c.ferry.reload()) and None, lambda c, o: c.ferry.offload(), None),
    "reload": (lambda c: (c.ferry.offload(), c.ferry.reload(), c.ferry.offload()) and None,
               lambda c, o: c.ferry.reload(), None),
    "swap": (lambda c: _other(c, dock=False), lambda c, o: torchferry.swap(c.ferry, o.ferry),
             lambda c, o: (c.ferry.reload(), o.ferry.offload(), torchferry.swap(c.ferry, o.ferry))),
    "dock eviction": (lambda c: _other(c, dock=True), lambda c, o: _use(o.dock, "other"),
                      lambda c, o: _use(o.dock, "other")),
}


def _check_other(o: Other | None, what: str) -> None:
    if o is None:
        return
    torch.testing.assert_close(o.t, o.want, atol=0, rtol=0, msg=what)
    if o.dock is not None:  # the dock's records agree with where the sets are
        for name, ferry in (("case", None), ("other", o.ferry)):
            ferry = ferry or o.dock.ferry(name)
            assert o.dock.is_resident(name) == (not ferry.residency.on_host), f"{what}: dock on {name!r}"


def _resize_sweep(name: str, skip: bool, fault_of) -> int:
    """Runs the move once per ``resize_`` call it makes, ``fault_of(n)`` at call ``n``: the state is
    as before or the move completed, every value bit-exact, and the move and a cycle work after."""
    prepare, op, retry = MOVES[name]
    calls = _resize_calls(name, skip)
    for n in range(calls):
        case = _plain_case(skip)
        other = prepare(case)
        expected, before = snapshot(case.model, case.opt), _on_pool(case)
        fault = fault_of(n)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.UntypedStorage, "resize_", fault.method)
            with pytest.raises((fault.exc, RuntimeError, SystemExit)):
                op(case, other)
        what = f"{name}: fault at resize_ call {n}/{calls} ({fault.exc.__name__})"
        _check_consistent(case, before, expected, what)
        _check_move_after(case, other, retry, expected, what)
    return calls


def _check_move_after(case: Case, other: Other | None, retry, expected: dict, what: str) -> None:
    """The second set as it should be, and the move's retry (if any) and a full cycle work."""
    _check_other(other, what)
    if retry is not None:
        retry(case, other)
        _check_other(other, what + ", retried")
        assert_same(snapshot(case.model, case.opt), expected)
    if other is None or other.dock is None:
        _check_retry(case, expected, what)


def _resize_calls(name: str, skip: bool) -> int:
    """How many ``resize_`` calls the move ``name`` makes (at least 4)."""
    prepare, op, _ = MOVES[name]
    case = _plain_case(skip)
    other = prepare(case)
    counter = _ResizeFault(None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", counter.method)
        op(case, other)
    assert counter.calls >= 4, f"{name}: only {counter.calls} resize_ calls"
    return counter.calls


@pytest.mark.parametrize("skip", [False, True], ids=["copy-all", "skip-unchanged"])
@pytest.mark.parametrize("name", list(MOVES))
def test_every_move_is_all_or_nothing_when_freeing_or_allocating_device_memory_fails(name, skip):
    """An exception at each ``resize_`` of the move (each storage its release frees, each its reload
    allocates). Reproduces the report against 0e8596e: a failure at the second ``resize_(0)`` of an
    offload left the first layer's storages freed under a ferry reporting DEVICE."""
    _resize_sweep(name, skip, lambda n: _ResizeFault(n, FAULTS[n % len(FAULTS)]))


@pytest.mark.parametrize("name", list(MOVES))
def test_every_move_completes_before_a_sigterm_that_arrives_while_it_frees_memory(name):
    """A real SIGTERM sent from inside each ``resize_`` of the move, with a handler raising
    ``SystemExit`` (as Ray's, Slurm's and Kubernetes' stops meet a worker's handler): the handler
    runs once the move has completed, and is the caller's own again afterwards."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        n = _resize_sweep(name, False, lambda n: _ResizeFault(n, SystemExit, sigterm=True))
        assert calls == [signal.SIGTERM] * n
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_release_undone_from_the_pool_gives_back_the_bytes_of_the_freed_storages(monkeypatch):
    """The smallest case of the report: two ``nn.Linear(1024, 1024)``, the offload's second
    ``resize_(0)`` raising: the ferry stays DEVICE with every storage whole, and a retry cycles."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    ferry = Ferry(m, device="cpu")
    want = {k: v.clone() for k, v in m.state_dict().items()}
    frees = []

    def resize(storage, size):
        if size == 0:
            frees.append(storage)
            if len(frees) == 2:
                raise RuntimeError("injected")
        return _REAL_RESIZE(storage, size)

    with monkeypatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", resize)
        with pytest.raises(RuntimeError, match="injected"):
            ferry.offload()
    assert ferry.residency is torchferry.Residency.DEVICE
    assert [p.untyped_storage().nbytes() for p in m.parameters()] == [p.numel() * 4 for p in m.parameters()]
    out = m(torch.ones(2, 1024))
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=0, rtol=0)
    ferry.offload()
    ferry.reload()
    torch.testing.assert_close(m(torch.ones(2, 1024)), out, atol=0, rtol=0)


def test_swap_schedule_frees_all_or_nothing_and_keeps_its_records_true(monkeypatch):
    """A swap with a budget (on a GPU) hands its outgoing storages to a ``ReleaseSchedule``: storages
    skipped as unchanged are freed at ``hold()``, all or nothing (given their bytes back from the
    pool), and a release that fails part-way keeps the rest pending, so a later ``release_rest()``
    frees exactly those."""
    from torchferry._core._schedules.release import ReleaseSchedule
    from torchferry._core._state.plan import build_plan, storage_bytes
    from torchferry._core._transfer.copies import D2HIssued
    from torchferry._core._transfer.streams import streams_for

    ts = [torch.randn(1024, generator=torch.Generator().manual_seed(i)) for i in range(4)]  # 4 KiB each
    want = [t.clone() for t in ts]
    plan = build_plan(ts)
    sources = [storage_bytes(s, plan.device) for s in plan.storages]
    slots = [src.clone() for src in sources]  # the pool's copies
    ev = types.SimpleNamespace(synchronize=lambda: None)
    issued = D2HIssued(None, None, [(4096, ev), (8192, ev)], [0, 0, 4096, 8192])
    streams = streams_for(torch.device("cpu"))
    sched = ReleaseSchedule(budget_bytes=16384, base_bytes=16384)
    with monkeypatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", _ResizeFault(1).method)  # the second unchanged storage
        with pytest.raises(RuntimeError, match="injected"):
            sched.hold(plan, sources, slots, issued, streams, {0, 1})
    assert [s.nbytes() for s in plan.storages] == [4096] * 4
    for t, w in zip(ts, want, strict=True):
        torch.testing.assert_close(t, w, atol=0, rtol=0)
    sched.release_rest()  # nothing was taken
    assert [s.nbytes() for s in plan.storages] == [4096] * 4

    sched.hold(plan, sources, slots, issued, streams, {0, 1})  # a retry takes them
    assert [s.nbytes() for s in plan.storages] == [0, 0, 4096, 4096]
    with monkeypatch.context() as mp:
        mp.setattr(torch.UntypedStorage, "resize_", _ResizeFault(0).method)
        with pytest.raises(RuntimeError, match="injected"):
            sched.before_alloc(16384)  # storage 2 must go first, and cannot
    assert [s.nbytes() for s in plan.storages] == [0, 0, 4096, 4096]
    sched.release_rest()
    assert [s.nbytes() for s in plan.storages] == [0, 0, 0, 0]


# ------------------------------------------------------------------ a swap's and a dock's moves, traced
def _three_sets() -> tuple[torchferry.Dock, dict[str, tuple[torch.Tensor, torch.Tensor, Ferry]]]:
    """Three 4 KiB sets under a dock with room for two; "a" and "b" resident, "c" evicted."""
    sets = {}
    for i, name in enumerate("abc"):
        t = torch.randn(1024, generator=torch.Generator().manual_seed(i))
        sets[name] = (t, t.clone(), Ferry(t, device="cpu"))
    dock = torchferry.Dock(2 * 4096 + 64, device="cpu")
    for name, (_, _, ferry) in sets.items():
        dock.add(name, ferry)
    with dock.use("a", "b"):
        pass
    return dock, sets


def _dock_use(dock: torchferry.Dock, *names: str) -> None:
    with dock.use(*names):
        pass


DOCK_MOVES = {  # each evicts "a" or "b" and loads "c" (a swap on the dock's path)
    "swap": lambda d, s: torchferry.swap(s["a"][2], s["c"][2]),
    "dock use": lambda d, s: _dock_use(d, "c"),
    "dock use of a resident and an evicted set": lambda d, s: _dock_use(d, "a", "c"),
    "dock acquire": lambda d, s: d.acquire("c"),
}


@pytest.mark.parametrize("name", list(DOCK_MOVES))
def test_swap_and_dock_moves_never_hold_more_than_they_make_room_for_under_a_fault_at_every_call(name):
    """A fault at each torchferry call of a swap or a dock's move (first and last of each call site):
    the sets are where the dock says, bit-exact, the dock within its budget, and the same use works
    after. Before: a fault after the incoming set's reload had completed (in its bookkeeping) made
    swap() reload the outgoing set too, so all three sets were on the device against a budget of two."""
    op = DOCK_MOVES[name]
    dock, sets = _three_sets()
    counter = _Injector(None)
    assert _run(functools.partial(op, dock, sets), counter) is None
    points = counter.points()
    assert len(points) > 50, f"{name}: only {len(points)} call sites traced"
    for n in points:
        dock, sets = _three_sets()
        inj = _Injector(n, FAULTS[n % len(FAULTS)])
        err = _run(functools.partial(op, dock, sets), inj)
        what = f"{name}: fault {n}/{counter.calls} at {inj.where}"
        assert err is None or isinstance(err, (inj.exc, RuntimeError)), f"{what}: {type(err).__name__}: {err}"
        for held in list(dock.in_use):  # an acquire that completed before raising
            dock.release(held)
        resident = [k for k, (_, _, ferry) in sets.items() if not ferry.residency.on_host]
        assert len(resident) <= 2, f"{what}: {resident} all on the device"
        for k, (t, want, _) in sets.items():
            assert dock.is_resident(k) == (k in resident), f"{what}: the dock on {k!r}"
            torch.testing.assert_close(t, want, atol=0, rtol=0, msg=what)
        assert dock.resident_bytes <= dock.budget_bytes, what
        for names in (("c",), ("a", "c"), ("b",)):
            _dock_use(dock, *names)
        for k, (t, want, _) in sets.items():
            torch.testing.assert_close(t, want, atol=0, rtol=0, msg=what + ", after")
