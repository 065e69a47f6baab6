"""Copies issued from a thread ([Note: copies issued off the caller's thread] in
``_schedules/issuer.py``): the Issuer's order, failure and cancel; a layer-wise reload issued from
it (forced on the CPU, where it is otherwise synchronous) stays bit-identical, in every mode of
the prefetch tests, with an offload during forward, and when the thread fails part way."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from tests.cpu.test_early import _offload_during_forward_checks
from tests.cpu.test_prefetch import _prefetch_checks
from tests.spawn import run_spawned
from torchferry._core._schedules.issuer import Issuer

needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
CPU = torch.device("cpu")


def test_issuer_runs_the_jobs_in_order_on_another_thread():
    seen: list[tuple[int, str]] = []
    gate = threading.Event()

    def job(i):
        if i == 3:
            gate.wait(5)
        seen.append((i, threading.current_thread().name))

    issuer = Issuer(CPU, job, 1, 6)
    issuer.start()
    assert issuer.wait(2) and issuer.done == 3  # jobs 1 and 2 done; 3 waits at the gate
    assert issuer.running
    gate.set()
    assert issuer.wait(5) and issuer.done == 6
    issuer.stop()
    assert not issuer.running and issuer.error is None
    assert [i for i, _ in seen] == [1, 2, 3, 4, 5]
    assert {name for _, name in seen} == {"torchferry-h2d-issuer"}


def test_a_failing_job_stops_the_thread_and_says_so():
    done: list[int] = []

    def job(i):
        if i == 2:
            raise RuntimeError("copy failed")
        done.append(i)

    issuer = Issuer(CPU, job, 0, 5)
    issuer.start()
    assert issuer.wait(1)
    assert not issuer.wait(2)  # the thread stopped at job 2: the caller takes over from there
    assert issuer.done == 2 and done == [0, 1]
    assert isinstance(issuer.error, RuntimeError) and "copy failed" in str(issuer.error)
    issuer.stop()


def test_stop_cancels_the_jobs_not_started_and_joins():
    started, gate = threading.Event(), threading.Event()
    done: list[int] = []

    def job(i):
        started.set()
        gate.wait(5)
        done.append(i)

    issuer = Issuer(CPU, job, 0, 100)
    issuer.start()
    assert started.wait(5)
    threading.Timer(0.05, gate.set).start()
    issuer.stop()  # job 0 under way finishes first; none after it starts
    assert done == [0] and not issuer.running


def _in_background(body, rank: int, world: int) -> None:
    """``body`` with the reload's copies issued by the thread (the CPU's copies are synchronous)."""
    from torchferry._core._schedules import groups, prefetch
    from torchferry._core._schedules import issuer as issuer_mod

    prefetch.BACKGROUND_ON_CPU = True
    groups.TAIL_PIECE_BYTES = 256  # the optimizer state goes in several groups too
    started: list[int] = []
    start = issuer_mod.Issuer.start
    issuer_mod.Issuer.start = lambda self: (started.append(1), start(self))[1]  # type: ignore[method-assign]
    try:
        body(rank, world)
    finally:
        issuer_mod.Issuer.start = start  # type: ignore[method-assign]
        prefetch.BACKGROUND_ON_CPU = False
        groups.TAIL_PIECE_BYTES = 256 << 20
    assert started, "no reload went through the issuer thread"


@needs_dist
def test_prefetch_from_the_thread_keeps_the_order_and_the_values():
    run_spawned(functools.partial(_in_background, _prefetch_checks), world=2)


def _modes_checks(rank: int, world: int, mode: str) -> None:
    """Training through prefetching reloads (grads dropped, as verl does) matches a run without
    torchferry bit for bit: one ferry or two, units not resharded after forward, a unit run on its
    own first, an exception in the forward."""
    from torch.distributed.fsdp import fully_shard
    from torch import nn

    from tests.helpers import cpu_mesh, differs, train_step
    from torchferry import Ferry, Residency

    mesh = cpu_mesh(world)

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
        raf = mode != "no_reshard_after_forward"
        for layer in m:
            fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
        fully_shard(m, mesh=mesh, reshard_after_forward=raf)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = build()
    m, opt = build()
    assert torch.equal(train_step(ref, ref_opt, x, set_to_none=True), train_step(m, opt, x, set_to_none=True))
    ferries = [Ferry(m), Ferry(opt)] if mode == "two_ferries" else [Ferry(m, opt)]
    for it in range(4):
        for f in ferries:
            f.offload()
        for f in ferries:
            f.reload(prefetch=True)
        assert ferries[0].residency is Residency.PREFETCHING
        if mode == "sub_unit_first" and it == 1:
            with torch.no_grad():
                m[2](torch.randn(4, 16))
        if mode == "exception_in_forward" and it == 1:
            h = m[1].register_forward_pre_hook(lambda mod, args: (_ for _ in ()).throw(ValueError("boom")))
            with pytest.raises(ValueError, match="boom"):
                m(x)
            h.remove()
        assert torch.equal(train_step(ref, ref_opt, x, set_to_none=True), train_step(m, opt, x, set_to_none=True))
    for f in ferries:
        f.offload()
        f.reload()
    assert not differs(ref, ref_opt, m, opt)


@needs_dist
@pytest.mark.parametrize("mode", ["two_ferries", "one_ferry", "no_reshard_after_forward", "sub_unit_first",
                                  "exception_in_forward"])
def test_prefetch_from_the_thread_is_bit_identical_in_every_mode(mode):
    body = functools.partial(_modes_checks, mode=mode)
    run_spawned(functools.partial(_in_background, body), world=2)


@needs_dist
def test_offload_during_forward_beside_a_reload_from_the_thread():
    run_spawned(functools.partial(_in_background, _offload_during_forward_checks), world=2)


def _thread_fails_checks(rank: int, world: int) -> None:
    """The thread's copies fail at the second group: the caller's thread issues the rest, and
    training stays bit-identical to a run without torchferry; a warning says what happened."""
    import logging

    from tests.helpers import cpu_mesh, differs, three_units, train_step
    from torchferry import Ferry, Residency
    from torchferry._core._schedules import prefetch

    prefetch.BACKGROUND_ON_CPU = True
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("torchferry").addHandler(handler)
    copy_group = prefetch.PrefetchRun._copy_group
    failed: list[int] = []

    def flaky(self, gi, queue=None):
        if threading.current_thread().name == "torchferry-h2d-issuer" and gi == 2:
            failed.append(gi)
            raise RuntimeError("injected copy failure")
        copy_group(self, gi, queue)

    prefetch.PrefetchRun._copy_group = flaky  # type: ignore[method-assign]
    try:
        mesh = cpu_mesh(world)
        ref, ref_opt = three_units(mesh, opt="adamw")
        m, opt = three_units(mesh, opt="adamw")
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        ferry = Ferry(m, opt)
        for _ in range(3):
            assert torch.equal(train_step(ref, ref_opt, x, set_to_none=True), train_step(m, opt, x, set_to_none=True))
            ferry.offload()
            ferry.reload(prefetch=True)
            assert ferry.residency is Residency.PREFETCHING
        assert torch.equal(train_step(ref, ref_opt, x, set_to_none=True), train_step(m, opt, x, set_to_none=True))
        assert not differs(ref, ref_opt, m, opt)
    finally:
        prefetch.PrefetchRun._copy_group = copy_group  # type: ignore[method-assign]
        prefetch.BACKGROUND_ON_CPU = False
    assert failed, "the injected failure never ran"
    assert any("caller's thread issues the rest" in r.getMessage() for r in records)


@needs_dist
def test_a_failure_in_the_thread_is_taken_over_by_the_callers_thread():
    run_spawned(_thread_fails_checks, world=2)



def test_optimizer_state_alone_is_issued_from_the_thread_in_pieces(monkeypatch):
    """A ferry over an optimizer alone (verl moves model and optimizer with separate calls): its
    state is one tail group, cut into pieces so that the thread issues all but the first; the
    step waits for every piece and matches a run without torchferry bit for bit."""
    from torch import nn

    from torchferry import Ferry, Residency
    from torchferry._core._schedules import groups, prefetch

    monkeypatch.setattr(prefetch, "BACKGROUND_ON_CPU", True)
    monkeypatch.setattr(groups, "TAIL_PIECE_BYTES", 1024)
    runs: list = []
    monkeypatch.setattr(prefetch.PrefetchRun, "begin",
                        lambda self, begin=prefetch.PrefetchRun.begin: (runs.append(self), begin(self))[1])

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def step(m, opt):
        m(torch.ones(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ref, ref_opt = build()
    m, opt = build()
    step(ref, ref_opt)
    step(m, opt)
    ferry = Ferry(opt)
    for _ in range(3):
        ferry.offload()
        ferry.reload(prefetch=True)
        assert ferry.residency is Residency.PREFETCHING
        step(ref, ref_opt)
        step(m, opt)
    assert len(runs) == 3 and all(len(r.groups) >= 3 for r in runs)  # 3 weight states of 8 KiB alone
    assert all(g.unit is None for g in runs[0].groups)
    assert sum(g.nbytes for g in runs[0].groups) == runs[0].plan.state_bytes
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)
    for sa, sb in zip(ref_opt.state.values(), opt.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("other", ["offload_during_forward", "skip_unchanged_ferry", "user_hook"])
@pytest.mark.parametrize("background", [False, True])
def test_a_step_that_completes_a_reload_runs_beside_later_global_step_hooks(monkeypatch, other, background):
    """The step pre-hook that completes a layer-wise reload removes its entry while torch iterates
    its global pre-hooks; a hook registered after it (offload during forward, a skip_unchanged
    ferry's, the user's) made ``step()`` raise "OrderedDict mutated during iteration" and not run
    ([Note: a global step hook is never removed]); failed before its fix."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from torchferry import Ferry, Residency
    from torchferry._core._schedules import prefetch

    monkeypatch.setattr(prefetch, "BACKGROUND_ON_CPU", background)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    handles = []
    try:
        torch.manual_seed(0)
        m = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        x = torch.randn(4, 16)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ferry = Ferry(m, opt)
        ferry.offload()
        ferry.reload(prefetch=True)
        if other == "offload_during_forward":
            ferry.offload_during_forward()
        elif other == "skip_unchanged_ferry":
            ref_model = nn.Linear(8, 8)
            ref = Ferry(ref_model, skip_unchanged=True)
            ref.offload()
            ref.reload()
        else:
            calls: list[int] = []
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            handles.append(register_optimizer_step_pre_hook(lambda *a: calls.append(1)))
        m(x).sum().backward()
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        assert ferry.residency is Residency.DEVICE
        assert all(not torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))  # the step ran
        if other == "user_hook":
            assert calls == [1]
    finally:
        for h in handles:
            h.remove()
        dist.destroy_process_group()


def test_a_full_window_is_waited_down_to_the_refill_mark():
    """The issuer thread's wait ([Note: copies issued off the caller's thread]): none while the group
    fits; else for the first issued group after whose copies at most the refill mark stays queued
    with the new group's bytes; everything when nothing smaller does."""
    from torchferry._core._schedules.issuer import wait_target

    nbytes = [4, 4, 4, 4, 4, 4]
    assert wait_target(nbytes, 0, 3, 3, high=16, low=16) is None  # 12 queued + 4 fits in 16
    assert wait_target(nbytes, 0, 4, 4, high=16, low=16) == 0  # 16 + 4: the oldest group's copies
    assert wait_target(nbytes, 0, 4, 4, high=16, low=8) == 2  # then 4 queued + 4 <= 8
    assert wait_target(nbytes, 1, 5, 5, high=16, low=8) == 3
    assert wait_target(nbytes, 0, 4, 4, high=16, low=0) == 3  # refill from empty
    assert wait_target([4, 4, 40], 0, 2, 2, high=16, low=16) == 1  # a group larger than the window
    assert wait_target([4, 40], 0, 1, 1, high=16, low=16) == 0
    assert wait_target([4, 40], 1, 1, 1, high=16, low=16) is None  # nothing queued: it goes alone


def test_the_refill_mark_comes_from_the_environment(monkeypatch):
    from torchferry._core._schedules.issuer import ISSUE_WINDOW_BYTES, refill_mark
    from torchferry._public.env import REFILL_ENV, core_settings

    monkeypatch.delenv(REFILL_ENV, raising=False)
    assert refill_mark(core_settings().issue_refill_bytes) == ISSUE_WINDOW_BYTES  # as soon as a group fits
    monkeypatch.setenv(REFILL_ENV, str(512 << 20))
    assert refill_mark(core_settings().issue_refill_bytes) == 512 << 20
    for bad in ("-1", "1.5", "512M", str(ISSUE_WINDOW_BYTES + 1)):
        monkeypatch.setenv(REFILL_ENV, bad)
        with pytest.raises(ValueError, match="TORCHFERRY_ISSUE_REFILL_BYTES=.* is not a number of bytes"):
            core_settings()
    with pytest.raises(ValueError, match="refill mark must be in"):
        refill_mark(ISSUE_WINDOW_BYTES + 1)


def test_a_bad_refill_mark_fails_at_ferry_before_anything_moved(monkeypatch):
    """Read with the core's settings at ``Ferry()``: a bad mark is refused there (it was refused at the
    layer-wise reload, read then), a good one is the reload's."""
    from torch import nn

    from torchferry import Ferry
    from torchferry._core._schedules import groups, prefetch
    from torchferry._public.env import REFILL_ENV

    monkeypatch.setattr(prefetch, "BACKGROUND_ON_CPU", True)
    monkeypatch.setattr(groups, "TAIL_PIECE_BYTES", 1024)
    m = nn.Linear(64, 64)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in opt.state[m.weight].items()}
    monkeypatch.setenv(REFILL_ENV, "lots")
    with pytest.raises(ValueError, match="TORCHFERRY_ISSUE_REFILL_BYTES"):
        Ferry(opt)
    assert all(torch.equal(opt.state[m.weight][k], v) for k, v in want.items())
    monkeypatch.setenv(REFILL_ENV, "0")
    ferry = Ferry(opt)
    ferry.offload().wait()
    monkeypatch.setenv(REFILL_ENV, "lots")  # after Ferry(): not read
    ferry.reload(prefetch=True)
    assert ferry._prefetch is not None and ferry._prefetch._refill == 0
    opt.state_dict()  # completes the reload
    assert all(torch.equal(opt.state[m.weight][k], v) for k, v in want.items())
