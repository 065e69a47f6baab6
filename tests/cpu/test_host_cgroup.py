"""The host budget within the container's memory limit ([Note: the container's memory limit] in
``torchferry._core._host.node_memory``), on a fake ``/proc`` and cgroup tree: the smallest of
``MemAvailable``, the cgroup's limit less its usage and the user's budget applies, and a refusal
names it.

Reproduces: inside a container ``/proc/meminfo`` shows the host, so a pool could
be granted past the cgroup's limit and the kernel ended the worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchferry._core._host.node_memory as nm
from tests.helpers import node_ledger
from torchferry import Ferry, HostBudgetError, Residency
from torchferry._core._host.node_memory import CgroupMemory, cgroup_memory, meminfo

pytestmark = pytest.mark.usefixtures("own_ledger")  # each test its own node ledger (tests/conftest.py)

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # memory.limit_in_bytes of a v1 cgroup without a limit (4 KiB pages)


class FakeNode:
    """A fake ``/proc`` and ``/sys/fs/cgroup`` under ``root``, with the module's roots pointed at them."""

    def __init__(self, root: Path, monkeypatch, *, mem_available: int = 100 * GiB, mem_total: int = 128 * GiB):
        self.proc, self.cgroup = root / "proc", root / "cgroup"
        (self.proc / "self").mkdir(parents=True)
        self.cgroup.mkdir()
        (self.proc / "meminfo").write_text(f"MemTotal:       {mem_total // 1024} kB\n"
                                           f"MemFree:        1 kB\nMemAvailable:   {mem_available // 1024} kB\n")
        monkeypatch.setattr(nm, "PROC_ROOT", str(self.proc))
        monkeypatch.setattr(nm, "CGROUP_ROOT", str(self.cgroup))

    def own(self, text: str) -> None:
        (self.proc / "self" / "cgroup").write_text(text)

    def files(self, folder: str, **content: str) -> Path:
        d = self.cgroup / folder.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        for name, value in content.items():
            (d / name.replace("_", ".", 1)).write_text(value + "\n")
        return d


def test_meminfo_is_read_from_the_injected_proc_root(tmp_path, monkeypatch):
    FakeNode(tmp_path, monkeypatch, mem_available=3 * GiB, mem_total=4 * GiB)
    assert meminfo() == {"MemTotal": 4 * GiB, "MemFree": 1024, "MemAvailable": 3 * GiB}


def test_v2_limit_less_usage_is_the_room_and_a_refusal_names_it(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/kubepods/pod1/c1\n")
    node.files("kubepods", memory_max="max", memory_current=str(50 * GiB))
    node.files("kubepods/pod1", memory_max=str(10 * GiB), memory_current=str(7 * GiB))
    c1 = node.files("kubepods/pod1/c1", memory_max=str(8 * GiB), memory_current=str(7 * GiB))
    got = cgroup_memory()
    assert got == CgroupMemory(headroom=1 * GiB, limit=8 * GiB, usage=7 * GiB, limit_file=str(c1 / "memory.max"),
                               usage_file=str(c1 / "memory.current"), version=2)
    ledger = node_ledger()
    room = GiB - int(0.05 * 8 * GiB)  # less the reserve: 5% of the limit
    with pytest.raises(HostBudgetError, match=(
            rf"needs {2 * GiB} bytes .* only {room} bytes .* within the container's memory limit \(cgroup v2 "
            rf"{c1}/memory.max {8 * GiB} bytes, less {7 * GiB} bytes in use in {c1}/memory.current .*"
            r"raise the container's memory limit")) as ei:
        ledger.request(2 * GiB, budget=None, what="a host pool")
    assert ei.value.needed == 2 * GiB and ei.value.available == room
    assert ledger.usage() == {}  # nothing recorded
    ledger.request(GiB // 2, budget=None, what="a host pool")  # within the room: granted
    assert ledger.usage() == {str(os.getpid()): {"held": 0, "pending": GiB // 2}}


def test_an_ancestors_tighter_limit_applies(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/kubepods/pod1/c1\n")
    pod = node.files("kubepods/pod1", memory_max=str(10 * GiB), memory_current=str(9 * GiB + GiB // 2))
    node.files("kubepods/pod1/c1", memory_max=str(8 * GiB), memory_current=str(2 * GiB))
    got = cgroup_memory()
    assert got is not None and got.headroom == GiB // 2 and got.limit_file == str(pod / "memory.max")


def test_a_cgroup_without_a_limit_leaves_meminfo_and_the_budget(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch, mem_available=3 * GiB, mem_total=4 * GiB)
    node.own("0::/user.slice\n")
    node.files("user.slice", memory_max="max", memory_current=str(GiB))
    assert cgroup_memory() is None
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", "0")
    with pytest.raises(HostBudgetError, match=rf"only {3 * GiB} bytes .* free memory \(MemAvailable {3 * GiB} bytes"):
        node_ledger().request(3 * GiB + 1, budget=None, what="a host pool")


def test_v1_limit_less_usage_and_its_huge_no_limit(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n")  # hybrid: v1 holds memory
    node.files("memory", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=str(60 * GiB))
    node.files("memory/process_api", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=str(GiB))
    leaf = node.files("memory/process_api/abc", memory_limit_in_bytes=str(4 * GiB),
                      memory_usage_in_bytes=str(GiB))
    node.files("", memory_max=str(GiB), memory_current=str(GiB))  # v2 is not read while v1 holds memory
    assert cgroup_memory() == CgroupMemory(3 * GiB, 4 * GiB, GiB, str(leaf / "memory.limit_in_bytes"),
                                           str(leaf / "memory.usage_in_bytes"), 1)
    with pytest.raises(HostBudgetError, match=rf"only {3 * GiB - int(0.05 * 4 * GiB)} bytes .* \(cgroup v1 "
                       rf"{leaf}/memory.limit_in_bytes"):
        node_ledger().request(4 * GiB, budget=None, what="a host pool")
    (leaf / "memory.limit_in_bytes").write_text(V1_UNLIMITED + "\n")
    assert cgroup_memory() is None  # no limit anywhere


def test_a_path_outside_the_mount_is_read_at_the_mounts_root(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/docker/0123abcd\n")  # the host's path; the container sees its own cgroup at the root
    node.files("", memory_max=str(6 * GiB), memory_current=str(2 * GiB))
    got = cgroup_memory()
    assert got is not None and got.headroom == 4 * GiB and got.limit_file == str(node.cgroup / "memory.max")
    node.own("0::/../../etc\n")  # never read outside the mount
    got = cgroup_memory()
    assert got is not None and got.limit_file == str(node.cgroup / "memory.max")


def test_unreadable_or_malformed_files_count_as_no_limit(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    assert cgroup_memory() is None  # no /proc/self/cgroup
    node.own("0::/a/b\n")
    b = node.files("a/b", memory_current=str(GiB))
    (b / "memory.max").mkdir()  # cannot be read as a file
    node.files("a", memory_max="lots", memory_current=str(GiB))  # not a number
    assert cgroup_memory() is None
    node.files("a", memory_max=str(2 * GiB))
    (node.cgroup / "a" / "memory.current").unlink()  # a limit without its usage
    assert cgroup_memory() is None
    node.files("a", memory_current=str(GiB))
    got = cgroup_memory()
    assert got is not None and got.headroom == GiB
    monkeypatch.setattr(nm, "CGROUP_ROOT", str(tmp_path / "nowhere"))
    assert cgroup_memory() is None


@pytest.mark.parametrize("smallest", ["budget", "cgroup", "meminfo"])
def test_the_smallest_limit_applies_and_is_named(tmp_path, monkeypatch, smallest):
    rooms = {"budget": 6 * GiB, "cgroup": 6 * GiB, "meminfo": 6 * GiB, smallest: 2 * GiB}
    node = FakeNode(tmp_path, monkeypatch, mem_available=rooms["meminfo"])
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", "0")
    node.own("0::/job\n")
    node.files("job", memory_max=str(10 * GiB), memory_current=str(10 * GiB - rooms["cgroup"]))
    names = {"budget": "the node's host budget of", "cgroup": "the container's memory limit",
             "meminfo": "the node's free memory"}
    with pytest.raises(HostBudgetError, match=rf"only {2 * GiB} bytes .* within {names[smallest]}") as ei:
        node_ledger().request(3 * GiB, budget=rooms["budget"], what="a host pool")
    assert ei.value.available == 2 * GiB


def test_offload_past_the_containers_limit_is_refused_and_leaves_the_state(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/job\n")
    node.files("job", memory_max=str(GiB), memory_current=str(GiB - (1 << 20)))  # 1 MiB of room
    t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    ferry = Ferry(t)
    with pytest.raises(HostBudgetError, match="container's memory limit"):
        ferry.offload()
    assert ferry.residency is Residency.DEVICE and torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
    node.files("job", memory_current=str(GiB // 2))  # room again
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))


MB = 10**6


def test_pending_pools_of_this_process_count_against_the_cgroups_room(tmp_path, monkeypatch):
    """Two requests of one process (the pin-ahead threads of two ferries) were each checked against the
    same room: with memory.max 100 MB and memory.current 10 MB, two pools of 60 MB were both granted.
    Bytes held (allocated: in memory.current already) are not subtracted again."""
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/job\n")
    node.files("job", memory_max=str(100 * MB), memory_current=str(10 * MB))
    ledger = node_ledger()
    ledger.request(60 * MB, budget=None, what="a host pool")
    room = 100 * MB - 10 * MB - 60 * MB - 5 * MB  # less this process's pending 60 MB and the 5% reserve
    with pytest.raises(HostBudgetError, match=rf"only {room} bytes .* {60 * MB} being allocated by processes") as ei:
        ledger.request(60 * MB, budget=None, what="a host pool")
    assert ei.value.available == room
    assert ledger.usage() == {str(os.getpid()): {"held": 0, "pending": 60 * MB}}
    ledger.settle(60 * MB, allocated=True)  # now resident: counted by memory.current instead
    node.files("job", memory_current=str(70 * MB))
    ledger.request(25 * MB, budget=None, what="a host pool")  # 100 - 70 - 5 = 25 MB of room
    assert ledger.usage() == {str(os.getpid()): {"held": 60 * MB, "pending": 25 * MB}}
    with pytest.raises(HostBudgetError, match="only 0 bytes"):
        ledger.request(1, budget=None, what="a host pool")


def test_pending_pools_of_this_process_count_against_memavailable(tmp_path, monkeypatch):
    MiB = 1 << 20  # meminfo counts kB
    FakeNode(tmp_path, monkeypatch, mem_available=100 * MiB, mem_total=100 * MiB)
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", "0")
    ledger = node_ledger()
    ledger.request(60 * MiB, budget=None, what="a host pool")
    with pytest.raises(HostBudgetError, match=rf"only {40 * MiB} bytes .* free memory"):
        ledger.request(60 * MiB, budget=None, what="a host pool")
    ledger.request(40 * MiB, budget=None, what="a host pool")
    assert ledger.usage()[str(os.getpid())]["pending"] == 100 * MiB


@pytest.mark.parametrize("version", [2, 1])
def test_reclaimable_page_cache_in_the_cgroup_is_room(tmp_path, monkeypatch, version):
    """A cgroup filled with page cache refused every pool: the usage counts the cache, which the
    kernel drops before it OOM-kills; ``inactive_file`` (v1: ``total_inactive_file``) of
    ``memory.stat`` is taken off the usage, as the kubelet does."""
    node = FakeNode(tmp_path, monkeypatch)
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", "0")
    stat = "anon 1000\nfile 60000000\nactive_file 10000000\ninactive_file 50000000\n"
    if version == 2:
        node.own("0::/job\n")
        d = node.files("job", memory_max=str(100 * MB), memory_current=str(95 * MB))
        (d / "memory.stat").write_text(stat)
    else:
        node.own("4:memory:/job\n0::/\n")
        d = node.files("memory/job", memory_limit_in_bytes=str(100 * MB), memory_usage_in_bytes=str(95 * MB))
        (d / "memory.stat").write_text(stat.replace("inactive_file 5", "inactive_file 1") +
                                       "total_inactive_file 50000000\n")  # v1: the total counts
    got = cgroup_memory()
    assert got is not None and (got.headroom, got.usage, got.reclaimable) == (55 * MB, 95 * MB, 50 * MB)
    node_ledger().request(55 * MB, budget=None, what="a host pool")
    with pytest.raises(HostBudgetError, match=rf"only 0 bytes .* \({50 * MB} of them reclaimable page cache"):
        node_ledger().request(1, budget=None, what="a host pool")
    (d / "memory.stat").write_text("inactive_file lots\n")  # unreadable: nothing taken off
    assert cgroup_memory().headroom == 5 * MB  # pyright: ignore[reportOptionalMemberAccess]


def test_the_reserve_applies_to_the_cgroups_limit(tmp_path, monkeypatch):
    """A pool of the cgroup's whole headroom less 1 byte was granted: the same reserve as for
    ``MemAvailable`` applies (``TORCHFERRY_HOST_RESERVE_BYTES``, default 5% of the limit)."""
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/job\n")
    node.files("job", memory_max=str(100 * MB), memory_current=str(10 * MB))
    with pytest.raises(HostBudgetError, match=rf"only {85 * MB} bytes .* a reserve of {5 * MB} bytes"):
        node_ledger().request(90 * MB - 1, budget=None, what="a host pool")
    with pytest.raises(HostBudgetError, match=rf"only {85 * MB} bytes"):
        node_ledger().request(85 * MB + 1, budget=None, what="a host pool")
    node_ledger().request(85 * MB, budget=None, what="a host pool")
    node_ledger().settle(85 * MB, allocated=False)
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", str(20 * MB))
    with pytest.raises(HostBudgetError, match=rf"only {70 * MB} bytes .* a reserve of {20 * MB} bytes"):
        node_ledger().request(70 * MB + 1, budget=None, what="a host pool")
    monkeypatch.setenv("TORCHFERRY_HOST_RESERVE_BYTES", "0")
    node_ledger().request(90 * MB, budget=None, what="a host pool")


@pytest.mark.parametrize("garbled", ["memory.max", "memory.current", "memory.stat", "self/cgroup", "meminfo"])
def test_a_file_of_bytes_that_are_not_text_counts_as_malformed_and_offload_works(tmp_path, monkeypatch, garbled):
    """A byte that is not UTF-8 in any file read for the budget raised ``UnicodeDecodeError`` out of
    every offload; such a file is malformed like any other: no limit at that level, the rest applies."""
    node = FakeNode(tmp_path, monkeypatch, mem_available=3 * GiB, mem_total=4 * GiB)
    node.own("0::/job\n")
    node.files("job", memory_max=str(2 * GiB), memory_current=str(GiB), memory_stat=f"inactive_file {1 << 20}")
    files = {"self/cgroup": node.proc / "self" / "cgroup", "meminfo": node.proc / "meminfo"}
    path = files.get(garbled, node.cgroup / "job" / garbled)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\xff\xfe\n", 1))
    got = cgroup_memory()
    if garbled in ("memory.max", "memory.current", "self/cgroup"):
        assert got is None
    else:
        assert got is not None and got.limit == 2 * GiB and got.usage == GiB
        assert got.reclaimable == (0 if garbled == "memory.stat" else 1 << 20)
    want = {"MemTotal": 4 * GiB, "MemFree": 1024, "MemAvailable": 3 * GiB}
    if garbled == "meminfo":  # its first line garbled: left out
        del want["MemTotal"]
    assert meminfo() == want
    t = torch.arange(1 << 10, dtype=torch.float32)
    ferry = Ferry(t)
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(1 << 10, dtype=torch.float32))


def test_a_meminfo_value_in_another_unit_or_form_is_left_out(tmp_path, monkeypatch):
    """``MemAvailable: 5 MB`` read as 5 bytes refused every pool; only ``kB`` (or no unit) is the kernel's."""
    node = FakeNode(tmp_path, monkeypatch)
    (node.proc / "meminfo").write_text("MemTotal: 8 kB\nMemAvailable: 5 MB\nMemFree: -3 kB\nHugePages_Total: 4\n"
                                       "Cached: \uff15 kB\n")
    assert meminfo() == {"MemTotal": 8192, "HugePages_Total": 4}


# A count of more ASCII digits than int() converts (4,300) is malformed: no limit at that level, no page cache, the
# line left out (before: a ValueError out of every offload).
LONG = "9" * 5000  # ASCII digits, too many for int(): "Exceeds the limit (4300 digits) for integer string conversion"


def _offload_works() -> None:
    t = torch.arange(100.0)
    ferry = Ferry(t)
    ferry.offload()
    assert ferry.residency is Residency.HOST
    ferry.reload()
    assert torch.equal(t, torch.arange(100.0))


@pytest.mark.parametrize("where", ["memory.max", "memory.current"])
def test_a_v2_count_too_long_for_int_counts_as_malformed(tmp_path, monkeypatch, where):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/a\n")
    node.files("a", memory_max=str(8 * GiB), memory_current=str(GiB))
    (node.cgroup / "a" / where).write_text(LONG + "\n")
    assert cgroup_memory() is None  # no limit at that level
    _offload_works()


def test_a_memory_stat_count_too_long_for_int_counts_as_no_page_cache(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    node.own("0::/a\n")
    d = node.files("a", memory_max=str(8 * GiB), memory_current=str(GiB))
    (d / "memory.stat").write_text(f"anon 1\ninactive_file {LONG}\n")
    got = cgroup_memory()
    assert got is not None and got.headroom == 7 * GiB and got.reclaimable == 0
    _offload_works()


def test_a_meminfo_value_too_long_for_int_is_left_out(tmp_path, monkeypatch):
    node = FakeNode(tmp_path, monkeypatch)
    (node.proc / "meminfo").write_text(f"MemTotal:       {LONG} kB\nMemAvailable:   {100 * GiB // 1024} kB\n")
    assert meminfo() == {"MemAvailable": 100 * GiB}
    _offload_works()
