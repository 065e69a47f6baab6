"""Host memory (``_host/budget.py``, ``_host/memory.py``): the node budget (refusal leaves
everything intact, ranks counted together), background pinning and release_host().
"""

from __future__ import annotations

import functools
import json
import logging
import os

import pytest
import torch

from tests.helpers import assert_same, node_ledger, snapshot, trained
from tests.spawn import run_spawned
from torchferry import Ferry, HostBudgetError, Residency
from torchferry._core._host.budget import NodeLedger


pytestmark = pytest.mark.usefixtures("own_ledger")  # each test its own node ledger (tests/conftest.py)


def test_budget_refusal_names_bytes_and_options_and_leaves_state_intact():
    m, opt = trained(ids=torch.arange(6).view(2, 3))
    before = snapshot(m, opt)
    ferry = Ferry(m, opt, host_budget_bytes=1000)
    need = ferry.state_bytes
    assert need > 1000
    with pytest.raises(HostBudgetError, match=r"needs \d+ bytes .* only \d+ bytes .*host budget of 1000 bytes") as ei:
        ferry.offload()
    msg = str(ei.value)
    assert "release_host" in msg and "TORCHFERRY_HOST_BUDGET_BYTES" in msg
    assert "max_pinned_bytes=...) pins less, but the pool still needs the host memory" in msg
    assert ei.value.needed >= need and ei.value.available == 1000
    assert isinstance(ei.value, RuntimeError)
    assert ferry.residency is Residency.DEVICE and ferry.host_bytes == 0  # nothing allocated
    assert_same(before, snapshot(m, opt))  # nothing moved
    assert all(p.untyped_storage().nbytes() > 0 for p in m.parameters())
    assert node_ledger().usage() == {}  # nothing recorded
    with pytest.raises(HostBudgetError):
        ferry.reserve_host()
    with pytest.raises(HostBudgetError):
        ferry.reserve_host(background=True)  # refused at once, not in the thread
    m(torch.arange(6).view(2, 3))  # still usable where it is


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "64")
    ferry = Ferry(torch.ones(100))
    with pytest.raises(HostBudgetError, match="host budget of 64 bytes"):
        ferry.offload()
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "lots")
    with pytest.raises(ValueError, match="TORCHFERRY_HOST_BUDGET_BYTES='lots' is not a number"):
        Ferry(torch.ones(100))


def test_refusal_when_the_node_has_too_little_free_memory(monkeypatch):
    import torchferry._core._host.budget as hb

    monkeypatch.setattr(hb, "meminfo", lambda: {"MemTotal": 10 << 20, "MemAvailable": 1 << 20})
    t = torch.ones(1 << 20)  # 4 MiB
    ferry = Ferry(t)
    with pytest.raises(HostBudgetError, match=r"free memory \(MemAvailable 1048576 bytes"):
        ferry.offload()
    assert t.untyped_storage().nbytes() == 4 << 20 and torch.equal(t, torch.ones(1 << 20))


def test_ledger_records_held_bytes_and_gives_them_back():
    a, b = torch.ones(1000), torch.ones(3000)
    fa, fb = Ferry(a), Ferry(b)
    fa.offload()
    fb.offload()
    me = str(os.getpid())
    assert node_ledger().usage()[me] == {"held": fa.host_bytes + fb.host_bytes, "pending": 0}
    fa.reload()
    fa.release_host()
    assert fa.host_bytes == 0 and node_ledger().usage()[me]["held"] == fb.host_bytes
    fb.reload()
    fb.close()
    assert me not in node_ledger().usage()
    fa.offload()  # a released ferry allocates again
    assert fa.host_bytes > 0 and torch.equal(a.clone(), torch.ones(1000))
    fa.reload()
    assert torch.equal(a, torch.ones(1000))


def test_ledger_drops_dead_processes_and_torn_files(tmp_path):
    ledger = NodeLedger(str(tmp_path / "l.json"))
    with open(ledger.path, "w") as f:
        json.dump({"999999999": {"held": 1 << 40, "pending": 0}}, f)  # no such pid
    assert ledger.usage() == {}
    with open(ledger.path, "w") as f:
        f.write("{torn")
    ledger.request(10, budget=100, what="x")
    assert ledger.usage() == {str(os.getpid()): {"held": 0, "pending": 10}}


def _rank_body(rank: int, world: int, ledger_dir: str, budget: int) -> None:
    import torch.distributed as dist

    os.environ["TORCHFERRY_LEDGER_DIR"] = ledger_dir
    t = torch.ones(1 << 18)  # 1 MiB per rank
    ferry = Ferry(t, host_budget_bytes=budget)
    # Rank 0 takes its pool first; rank 1 then finds the budget used by rank 0.
    if rank == 0:
        ferry.offload()
    dist.barrier()
    if rank == 1:
        with pytest.raises(HostBudgetError, match=r"1 process\(es\) of this node"):
            ferry.offload()
        assert ferry.residency is Residency.DEVICE and torch.equal(t, torch.ones(1 << 18))
    dist.barrier()
    if rank == 0:
        ferry.reload()
        ferry.release_host()
    dist.barrier()
    if rank == 1:
        ferry.offload()  # rank 0 gave its pool back
        ferry.reload()
        assert torch.equal(t, torch.ones(1 << 18))
    dist.barrier()


def test_ranks_of_a_node_share_one_budget(tmp_path):
    run_spawned(functools.partial(_rank_body, ledger_dir=str(tmp_path), budget=(1 << 20) + (1 << 19)), world=2)


def test_background_reserve_then_offload_is_bit_exact():
    m, opt = trained(ids=torch.arange(6).view(2, 3))
    before = snapshot(m, opt)
    ferry = Ferry(m, opt)
    fut = ferry.reserve_host(background=True)
    ferry.offload().wait()  # may arrive before the pool is ready: waits for it
    assert fut.result(timeout=60) >= 0.0 and ferry.host_bytes >= ferry.state_bytes
    ferry.reload().wait()
    assert_same(before, snapshot(m, opt))
    assert ferry.reserve_host(background=True).result() == 0.0  # already fits


def test_background_reserve_failure_surfaces_at_offload(monkeypatch):
    import torchferry._core._host.pool as pool_mod

    def boom(*a, **k):
        raise RuntimeError("torchferry: could not allocate a host pool (simulated)")

    t = torch.arange(1000.0)
    ferry = Ferry(t)
    with monkeypatch.context() as mp:
        mp.setattr(pool_mod, "HostBuffer", boom)
        fut = ferry.reserve_host(background=True)
        with pytest.raises(RuntimeError, match="simulated"):
            fut.result(timeout=60)
        with pytest.raises(RuntimeError, match="simulated"):
            ferry.offload()
        assert ferry.residency is Residency.DEVICE and torch.equal(t, torch.arange(1000.0))
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(1000.0))
    assert str(os.getpid()) in node_ledger().usage()  # the failed one was settled, the new one held
    assert node_ledger().usage()[str(os.getpid())]["pending"] == 0


def test_release_host_while_offloaded_is_refused():
    t = torch.ones(10)
    ferry = Ferry(t)
    ferry.offload()
    with pytest.raises(RuntimeError, match=r"release_host\(\) while the state is offloaded.*reload\(\) first"):
        ferry.release_host()
    assert ferry.residency is Residency.HOST
    ferry.reload()
    assert torch.equal(t, torch.ones(10))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GB"])
def test_byte_options_are_validated(bad):
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Ferry(torch.ones(3), max_pinned_bytes=bad)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        Ferry(torch.ones(3), host_budget_bytes=bad)


def test_budget_inf_and_a_ledger_of_another_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "inf")
    with pytest.raises(ValueError, match="'inf' is not a number of bytes"):
        Ferry(torch.ones(3))
    monkeypatch.delenv("TORCHFERRY_HOST_BUDGET_BYTES")
    ledger = node_ledger()
    for junk in ("[]", '{"%d": 5}' % os.getpid()):
        with open(ledger.path, "w") as f:
            f.write(junk)
        t = torch.ones(10)
        ferry = Ferry(t)
        ferry.offload()
        ferry.reload()
        ferry.close()
        assert torch.equal(t, torch.ones(10))


@pytest.mark.parametrize("pid, entry", [
    ("99999999999", {"held": 1 << 30, "pending": 0}),  # os.kill() raised OverflowError on every offload
    ("4194305", {"held": 1, "pending": 0}),  # above Linux's largest pid_max
    ("0", {"held": 1}),
    ("-12", {"held": 1}),
    ("abc", {"held": 1}),
    ("SELF", {"held": "lots", "pending": 0}),  # SELF: this process's pid (the same ids in every xdist worker)
    ("SELF", {"held": -5}),
    ("SELF", {"held": True}),
    ("SELF", [1, 2]),
    ("0001", {"held": 1}),  # not canonical: a second key for pid 1
    ("\uff11", {"held": 1}),  # a full-width 1: str.isdigit() took it
    ("\u0661\u0662", {"pending": 1}),  # Arabic-Indic digits
    ("SELF", {"held": 1, "since": "now"}),
    ("SELF", {"held": 1, "start": -1}),
])
def test_a_corrupt_ledger_entry_is_skipped_with_a_warning(caplog, pid, entry):
    """A ledger entry with pid 99999999999 made every offload raise os.kill()'s OverflowError."""
    import logging

    pid = str(os.getpid()) if pid == "SELF" else pid
    ledger = node_ledger()
    with open(ledger.path, "w") as f:
        json.dump({pid: entry, str(os.getppid()): {"held": 7, "pending": 0}}, f)  # beside a live, valid one
    t = torch.arange(100.0)
    ferry = Ferry(t)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        ferry.offload()
    assert f"skipped a corrupt entry of the host ledger {ledger.path}: {pid!r}" in caplog.text
    ferry.reload()
    assert torch.equal(t, torch.arange(100.0))
    usage = node_ledger().usage()
    assert usage[str(os.getppid())] == {"held": 7, "pending": 0}  # the valid entry is kept
    assert usage[str(os.getpid())] == {"held": ferry.host_bytes, "pending": 0}  # the corrupt one was dropped
    with open(ledger.path) as f:
        assert pid not in json.load(f) or pid == str(os.getpid())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        ferry.offload()  # once dropped, no more warnings
    assert "corrupt" not in caplog.text
    ferry.reload()


def test_a_torn_ledger_is_started_over_with_a_warning(caplog):
    import logging

    ledger = node_ledger()
    with open(ledger.path, "w") as f:
        f.write('{"12": {"held"')
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        assert ledger.usage() == {}
    assert f"the host ledger {ledger.path} is not JSON" in caplog.text


def _write_ledger(ledger: NodeLedger, entries: dict) -> None:
    with open(ledger.path, "w") as f:
        json.dump(entries, f)


def test_pending_bytes_expire_and_a_reused_pid_is_dropped(caplog):
    """An entry such as ``{"1": {"pending": 10**15}}`` (pid 1 is alive) blocked every pool for good:
    pending bytes recorded without a time, or longer ago than ``PENDING_EXPIRE_S``, are dropped, and
    so is the entry of a pid whose process start time is not the recorded one ([Note: a ledger entry
    expires])."""
    import logging
    import time

    from torchferry._core._host.budget import PENDING_EXPIRE_S, _start_time

    parent = os.getppid()
    start = _start_time(parent)
    assert start is not None
    ledger = node_ledger()
    for entry in ({"pending": 10**15}, {"pending": 10**15, "since": time.time() - PENDING_EXPIRE_S - 1},
                  {"pending": 10**15, "since": time.time() + 10 * PENDING_EXPIRE_S}):  # a clock far off
        _write_ledger(ledger, {"1": entry})
        with caplog.at_level(logging.WARNING, logger="torchferry"):
            ledger.request(1 << 20, budget=1 << 30, what="a host pool")  # granted: the pending bytes expired
        assert f"dropped {10**15} pending bytes of pid 1" in caplog.text
        assert ledger.usage() == {str(os.getpid()): {"held": 0, "pending": 1 << 20}}
        ledger.settle(1 << 20, allocated=False)
        caplog.clear()
    fresh = {"held": 5, "pending": 1 << 29, "since": time.time(), "start": start}
    _write_ledger(ledger, {str(parent): fresh})  # a live pending entry counts
    with pytest.raises(HostBudgetError):
        ledger.request((1 << 29) + 1, budget=1 << 30, what="a host pool")
    assert ledger.usage() == {str(parent): {"held": 5, "pending": 1 << 29}}
    _write_ledger(ledger, {str(parent): {**fresh, "start": start + 1}})  # that pid is another process now
    assert ledger.usage() == {}
    _write_ledger(ledger, {str(parent): {"held": 5, "pending": 3}})  # held bytes without a time stay
    assert ledger.usage() == {str(parent): {"held": 5, "pending": 0}}


def test_this_process_records_its_start_time_and_pending_time():
    import time

    from torchferry._core._host.budget import _start_time

    ledger = node_ledger()
    before = time.time()
    ledger.request(10, budget=None, what="a host pool")
    with open(ledger.path) as f:
        e = json.load(f)[str(os.getpid())]
    assert e["start"] == _start_time(os.getpid()) and e["pending"] == 10 and before <= e["since"] <= time.time()
    ledger.settle(10, allocated=True)
    with open(ledger.path) as f:
        e = json.load(f)[str(os.getpid())]
    assert e["held"] == 10 and e["pending"] == 0 and "since" not in e
    ledger.give_back(10)


@pytest.mark.parametrize("entry", [
    {"held": 1, "pending": 5, "since": 10 ** 400},  # an int beyond a float (before: OverflowError)
    {"held": 1, "since": -(10 ** 400)},
])
def test_an_entry_whose_since_is_too_large_for_a_float_is_skipped(caplog, entry):
    ledger = node_ledger()
    with open(ledger.path, "w") as f:
        json.dump({str(os.getppid()): entry}, f)
    t = torch.arange(100.0)
    ferry = Ferry(t)
    for _ in range(2):  # not once: every offload (the ledger is never written back)
        with caplog.at_level(logging.WARNING, logger="torchferry"):
            ferry.offload()
        ferry.reload()
    assert torch.equal(t, torch.arange(100.0))
    assert "skipped a corrupt entry of the host ledger" in caplog.text


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"1":' * 100_000])
def test_a_ledger_nested_too_deep_for_the_json_parser_is_started_over(caplog, raw):
    ledger = node_ledger()
    with open(ledger.path, "wb") as f:
        f.write(raw)
    t = torch.arange(100.0)
    ferry = Ferry(t)
    with caplog.at_level(logging.WARNING, logger="torchferry"):
        ferry.offload()  # before: RecursionError from json.loads, at every offload
    ferry.reload()
    assert torch.equal(t, torch.arange(100.0))
    assert "starting it over" in caplog.text
