"""The host budget within the container's memory limit ([Note: the container's memory limit] in
``torchferry._core._host.node_memory``), on a fake ``/proc`` and cgroup tree: the smallest of
``MemAvailable``, the cgroup's limit less its usage and the user's budget applies, and a refusal
names it.

Reproduces issue 46 item 8: inside a container ``/proc/meminfo`` shows the host, so a pool could
be granted past the cgroup's limit and the kernel ended the worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torchferry._core._host.node_memory as nm
from torchferry import Ferry, HostBudgetError, Residency
from torchferry._core._host.budget import NodeLedger
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
    ledger = NodeLedger()
    with pytest.raises(HostBudgetError, match=(
            rf"needs {2 * GiB} bytes .* only {GiB} bytes .* within the container's memory limit \(cgroup v2 "
            rf"{c1}/memory.max {8 * GiB} bytes, less {7 * GiB} bytes in use in {c1}/memory.current .*"
            r"raise the container's memory limit")) as ei:
        ledger.request(2 * GiB, budget=None, what="a host pool")
    assert ei.value.needed == 2 * GiB and ei.value.available == GiB
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
        NodeLedger().request(3 * GiB + 1, budget=None, what="a host pool")


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
    with pytest.raises(HostBudgetError, match=rf"only {3 * GiB} bytes .* \(cgroup v1 {leaf}/memory.limit_in_bytes"):
        NodeLedger().request(4 * GiB, budget=None, what="a host pool")
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
        NodeLedger().request(3 * GiB, budget=rooms["budget"], what="a host pool")
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
