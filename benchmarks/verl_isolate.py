"""The verl step bench's strategies in processes of their own: turn-taking, exact fingerprints of the
final state (compared across processes), and what a step leaves on the device.

[Note: one process per strategy]
Run in one process, the strategies shared one caching allocator: several 25 GB actors of Qwen2.5-1.5B
(parameters, gradients, AdamW state) on one GPU, each step's allocation pattern depending on what the
previous strategy left cached, and one strategy's peak only estimated by subtracting the others' bytes
at its start. That estimate put torchferry's step at 45.7 GB against verl's 30.9
(``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02_fa3c43b_dock-tight.json``,
``strategies.*.peak_gpu_bytes``); each in a process of its own, its update_actor peaked at 30.93 GB against
30.87 (``..._2026-12-03_6420de7_micro-2-4.json``, ``phase_peak_gpu_bytes``). So each strategy runs in a
process of its own (its own CUDA context and caching allocator, as a colocated worker has), the
processes take turns through a folder (:class:`Turns`: one step at a time, the order rotated each round,
as before), and everything a process allocates is its strategy's.
"""

from __future__ import annotations

import gc
import os
import resource
import threading
import time
from pathlib import Path

__all__ = ["Turns", "fingerprint", "StepProbe", "context_bytes", "pin_cpus", "blocking_sync"]

_C = 0x2545F4914F6CDD1D  # odd multiplier of the word index (< 2**63: an int64)
_MASK = (1 << 64) - 1
_CHUNK = 1 << 28  # bytes compared per device chunk


# A waiting process polls the turn file, every 1 ms at first, backing off to every 20 ms: a turn is
# taken at most 20 ms late (outside any step's timing), and the processes waiting (all but one strategy's
# ranks) do not wake 500 times a second each, for the whole run, on the CPUs of the one whose turn it is.
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.02


class Turns:
    """One process's side of the turn-taking (``--turns DIR``): ticket ``t`` runs once the folder's
    ``turn`` file reads ``t``; :meth:`done` moves it on. Builds take tickets ``0..n-1``; round ``r``'s
    step at position ``p`` of that round's order takes ``n + r * n + p``.

    Args:
        folder: the shared folder (created by the launcher; ``None``: one process, no turns).
        rank: this process's rank in its strategy's process group (rank 0 writes).
        timeout_s: seconds to wait for a turn before giving up.

    Raises:
        SystemExit: another process failed (the launcher wrote ``failed``) or the wait timed out.
    """

    def __init__(self, folder: str | None, rank: int, timeout_s: float = 1800.0) -> None:
        self.folder = Path(folder) if folder else None
        self.rank, self.timeout_s = rank, timeout_s

    def _read(self, name: str) -> str | None:
        assert self.folder is not None
        try:
            return (self.folder / name).read_text()
        except FileNotFoundError:
            return None

    def _write(self, name: str, text: str) -> None:
        assert self.folder is not None
        tmp = self.folder / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, self.folder / name)

    def wait(self, ticket: int) -> None:
        if self.folder is None:
            return
        t0 = time.monotonic()
        pause = _POLL_FIRST_S
        while (self._read("turn") or "0").strip() != str(ticket):
            if (self.folder / "failed").exists():
                raise SystemExit(f"error: another strategy's process failed (see {self.folder / 'failed'})")
            if time.monotonic() - t0 > self.timeout_s:
                raise SystemExit(f"error: no turn {ticket} after {self.timeout_s:.0f} s of waiting")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def done(self, ticket: int) -> None:
        if self.folder is not None and self.rank == 0:
            self._write("turn", str(ticket + 1))

    def stop_round(self) -> int | None:
        """The round the processes stop before (``--max-round-seconds``), once one was decided."""
        if self.folder is None:
            return None
        text = self._read("stop")
        return int(text) if text else None

    def decide_stop(self, round_: int, max_round_s: float) -> bool:
        """At the first ticket of ``round_``: past ``max_round_s`` seconds of rounds (at least 2 run),
        no process starts round ``round_`` (written for the others; rank 0 decides)."""
        if self.folder is None or self.rank != 0:
            return False
        if round_ == 0:
            self._write("rounds_t0", repr(time.time()))
            return False
        started = float(self._read("rounds_t0") or time.time())
        if round_ >= 2 and max_round_s and time.time() - started > max_round_s:
            self._write("stop", str(round_))
            return True
        return False


def fingerprint(t, device) -> str:
    """An exact fingerprint of a tensor's bytes: dtype, shape and two 64-bit sums over its 8-byte words
    (the plain sum and the sum weighted by an odd multiple of each word's index, both modulo 2**64),
    computed on ``device`` in 256 MiB chunks (host tensors are copied there first). Equal bytes give
    equal fingerprints; a change of any word changes the weighted sum unless the changes cancel, which
    for differing bytes of real runs has a chance near 2**-64 (not a cryptographic hash). Comparing two
    processes' states this way costs a few seconds where sha256 on the host took the run's last minute.
    """
    import torch

    t = t.detach()
    head = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    if t.numel() == 0:
        return head
    b = t.contiguous().reshape(-1).view(torch.uint8)
    s1 = s2 = 0
    for off in range(0, b.numel(), _CHUNK):
        c = b[off:off + _CHUNK].to(device)
        pad = (-c.numel()) % 8
        if pad:
            c = torch.cat([c, c.new_zeros(pad)])
        w = c.view(torch.int64)
        k = torch.arange(off // 8, off // 8 + w.numel(), device=device, dtype=torch.int64).mul_(_C).add_(1)
        s1 = (s1 + int(w.sum())) & _MASK
        s2 = (s2 + int((w * k).sum())) & _MASK  # not in place: w may be the tensor itself
    return f"{head}:{s1:016x}{s2:016x}"


def context_bytes(device) -> int | None:
    """Device bytes this process holds outside the caching allocator (its CUDA context), from NVML's
    per-process figure less the allocator's reserved bytes; ``None`` where NVML does not tell."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device() if device.index is None else device.index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory:
                held = int(p.usedGpuMemory) - torch.cuda.memory_reserved(device)
                return held if held >= 0 else None
    except Exception:  # NVML missing or not answering for this process (a container's pid namespace)
        return None
    return None


def _cpu_jiffies() -> dict[str, int]:
    """The machine's CPU time by kind, in clock ticks (``/proc/stat``'s first line); empty where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return {}
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {k: int(v) for k, v in zip(names, fields, strict=False)}


def thread_ticks() -> dict[int, tuple[str, int, int]]:
    """Each thread of this process: its name, its CPU time (user + system, in clock ticks) and its
    involuntary context switches (``/proc/self/task``); a thread that ends while read is left out."""
    out: dict[int, tuple[str, int, int]] = {}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
            with open(f"/proc/self/task/{tid}/status") as f:
                nivcsw = next((int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt")), 0)
        except (OSError, ValueError):
            continue
        fields = rest.split()
        out[tid] = (head.partition("(")[2], int(fields[11]) + int(fields[12]), nivcsw)
    return out


def threads_over(before: dict, after: dict, main_tid: int) -> dict[str, dict[str, float]]:
    """CPU seconds and involuntary switches per thread name between two :func:`thread_ticks` readings (the
    calling process's main thread as ``main``; threads of one name summed; those under 0.01 s left out, and
    those that ended before the second reading)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, float]] = {}
    for tid, (name, ticks, nivcsw) in after.items():
        _, t0, n0 = before.get(tid, (name, 0, 0))
        row = out.setdefault("main" if tid == main_tid else name, {"cpu_s": 0.0, "involuntary_switches": 0})
        row["cpu_s"] += (ticks - t0) / tick
        row["involuntary_switches"] += nivcsw - n0
    return {k: {"cpu_s": round(v["cpu_s"], 3), "involuntary_switches": v["involuntary_switches"]}
            for k, v in sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]) if v["cpu_s"] >= 0.01 or k == "main"}


def cpu_cores(cpus: list[int], sysfs: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """``cpus`` grouped by physical core (the kernel's ``thread_siblings_list``; a CPU whose siblings cannot be
    read is a core of its own), each core's CPUs ascending, the cores in order of their first CPU."""
    cores: dict[tuple[int, ...], list[int]] = {}
    allowed = set(cpus)
    for c in sorted(cpus):
        try:
            with open(f"{sysfs}/cpu{c}/topology/thread_siblings_list") as f:
                key = tuple(sorted(_cpu_list(f.read()) & allowed)) or (c,)
        except (OSError, ValueError):
            key = (c,)
        cores.setdefault(key, []).append(c)
    return [sorted(v) for v in sorted(cores.values())]


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as ``0-3,8,10-11``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_cpus(slot: int, slots: int, local_rank: int = 0, local_world: int = 1) -> list[int]:
    """Pin this process (and the threads it starts later) to its own share of the CPUs it may run on: the
    physical cores (:func:`cpu_cores`) in ``slots`` equal contiguous shares, ``slot``'s split again among
    the node's ranks, so that no two processes share a core through its hyperthreads where the kernel
    shows them (a virtual machine's CPUs may share a host's core without showing it: ``host_reference_s``
    in ``probe_per_step`` then varies from step to step). Where there are fewer cores than processes x
    ranks, the same on CPUs; where fewer CPUs too, all of them, unpinned. Returns the CPUs the process
    runs on."""
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpu_share(cpus, cpu_cores(cpus), slot, slots, local_rank, local_world)
    if not mine:
        return cpus
    repin(mine)
    return mine


def cpu_share(cpus: list[int], cores: list[list[int]], slot: int, slots: int, local_rank: int = 0,
              local_world: int = 1) -> list[int]:
    """:func:`pin_cpus`'s share: whole cores where there are enough, else single CPUs; empty where there
    are fewer CPUs than processes x ranks."""
    units = cores if len(cores) >= slots * local_world else [[c] for c in cpus]
    per = len(units) // slots
    share = units[slot * per:(slot + 1) * per]
    per_rank = len(share) // local_world
    return sorted(c for core in share[local_rank * per_rank:(local_rank + 1) * per_rank] for c in core)


def repin(cpus: list[int]) -> bool:
    """Puts every thread of this process back on ``cpus``; returns whether any had left them. Something in
    the setup (torch's, NCCL's or verl's initialisation) resets the main thread's affinity: a 2026-12-06 run
    on one H100 pinned three processes to 5 CPUs each and found all 16 again at every step
    (``probe_per_step[*].affinity_cpus``), so the step loop calls this before each step."""
    want, moved = set(cpus), False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) != want:
                os.sched_setaffinity(tid, want)
                moved = True
        except OSError:  # the thread ended meanwhile
            continue
    return moved


def blocking_sync(device_index: int) -> str:
    """Diagnosis: a host thread that waits on the GPU sleeps instead of spinning (the primary context's
    ``CU_CTX_SCHED_BLOCKING_SYNC``, set through the driver before CUDA starts), so that a process's CPU
    seconds count its host work only: by default CUDA spins inside a synchronisation, and a step that waits
    on the GPU burns as much CPU time as one that works on the host. Returns what it did, for the record."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"not set: {e}"
    dev = ctypes.c_int()
    set_flags = getattr(cu, "cuDevicePrimaryCtxSetFlags_v2", None) or cu.cuDevicePrimaryCtxSetFlags
    rcs = (cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), device_index), set_flags(dev, 0x04))
    return "set" if rcs == (0, 0, 0) else f"not set: CUresult {rcs}"


class StepProbe:
    """What a step costs besides its work, per step: the caching allocator's retries (a retry frees the
    whole cache and synchronises), the garbage collector's collections and seconds, the process's CPU
    seconds, page faults and context switches (an involuntary one: another thread took the core), the
    caching allocator's cudaMalloc and cudaFree calls, the CPUs the process may run on, a fixed pure-Python
    workload's seconds before and after the step and the step thread's CPU clock at both ends (``cpu_mhz_at_*``,
    where the machine tells it), the machine's CPU ticks by kind (``steal``: the hypervisor ran something
    else), the SM and memory clocks and the GPU's temperature at the step's end, and, over the step, the
    seconds NVML counted the GPU's
    clocks held down by its power or thermal limit and the energy it drew (NVML's cumulative counters;
    ``None`` where it does not answer), and each thread's CPU seconds and involuntary switches by name
    (``threads``; ``main``: the thread that runs the step), which say whether the step's own thread was
    kept off its CPU, and the process's CPU seconds between its last step and this one
    (``cpu_s_since_last_step``: while the other processes step, this one should sleep). A clock read at
    the step's end cannot see a cap that came and went inside the step; the counters do."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._main_tid = threading.get_native_id()
        self._last_end: float | None = None
        self._gc_s = 0.0
        self._gc_n = 0
        self._gc_t0: float | None = None
        gc.callbacks.append(self._on_gc)
        self._nvml = None
        if self.cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
            except Exception:  # NVML not there: no clock readings
                self._nvml = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_n += 1
            self._gc_t0 = None

    def _allocator(self) -> tuple[int, int, int]:
        """The caching allocator's retries and its cudaMalloc / cudaFree calls so far."""
        import torch

        if not self.cuda:
            return 0, 0, 0
        st = torch.cuda.memory_stats(self.device)
        return (int(st.get("num_alloc_retries", 0)), int(st.get("num_device_alloc", 0)),
                int(st.get("num_device_free", 0)))

    @staticmethod
    def host_reference_s() -> float:
        """Seconds of a fixed pure-Python workload (the least of three), taken before the step: a host whose
        speed varies between steps (frequency, a neighbour on the core) shows here with no GPU involved."""
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            acc = 0
            for i in range(100_000):
                acc += i * i
            best = min(best, time.perf_counter() - t0)
        return best

    @staticmethod
    def cpu_mhz(cpu: int | None) -> float | None:
        """CPU ``cpu``'s clock now, MHz: the kernel's ``cpufreq`` reading, else ``/proc/cpuinfo``'s ``cpu MHz``
        line for it; ``None`` where neither is there (many virtual machines show a fixed or no figure)."""
        if cpu is None:
            return None
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq") as f:
                return int(f.read()) / 1e3  # kHz
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/cpuinfo") as f:
                current = None
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() == "processor":
                        current = int(value)
                    elif key.strip() == "cpu MHz" and current == cpu:
                        return float(value)
        except (OSError, ValueError):
            return None
        return None

    @staticmethod
    def main_cpu() -> int | None:
        """The CPU the calling thread last ran on (``/proc/thread-self/stat``'s field 39)."""
        try:
            with open("/proc/thread-self/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[36])
        except (OSError, IndexError, ValueError):
            return None

    def _gpu_counters(self) -> dict[str, float | None]:
        """NVML's cumulative counters now: seconds capped by power and by temperature, joules drawn."""
        out: dict[str, float | None] = {"power_capped_s": None, "thermal_capped_s": None, "energy_j": None}
        if self._nvml is None:
            return out
        nv, h = self._nvml
        for key, policy in (("power_capped_s", "NVML_PERF_POLICY_POWER"),
                            ("thermal_capped_s", "NVML_PERF_POLICY_THERMAL")):
            try:
                out[key] = nv.nvmlDeviceGetViolationStatus(h, getattr(nv, policy)).violationTime / 1e9
            except Exception:  # not supported by this GPU, driver or binding
                out[key] = None
        try:
            out["energy_j"] = nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3  # mJ since the driver loaded
        except Exception:
            out["energy_j"] = None
        return out

    def begin(self) -> None:
        self._waiting = (time.process_time() - self._last_end) if self._last_end is not None else None
        self._threads0 = thread_ticks()
        self._gpu0 = self._gpu_counters()
        cpu = self.main_cpu()
        self._ref = (self.host_reference_s(), cpu, self.cpu_mhz(cpu))
        self._at = (self._allocator(), self._gc_s, self._gc_n, time.process_time(),
                    resource.getrusage(resource.RUSAGE_SELF), _cpu_jiffies())

    def end(self) -> dict:
        r0, g0, n0, c0, u0, j0 = self._at
        u1, j1 = resource.getrusage(resource.RUSAGE_SELF), _cpu_jiffies()
        a1 = self._allocator()
        out = {"alloc_retries": a1[0] - r0[0], "device_mallocs": a1[1] - r0[1], "device_frees": a1[2] - r0[2],
               "affinity_cpus": len(os.sched_getaffinity(0)), "gc_s": self._gc_s - g0,
               "host_reference_s": self._ref[0], "main_cpu_at_start": self._ref[1], "main_cpu_at_end": self.main_cpu(),
               "cpu_mhz_at_start": self._ref[2],
               "gc_collections": self._gc_n - n0,
               "cpu_s": time.process_time() - c0, "minor_faults": u1.ru_minflt - u0.ru_minflt,
               "major_faults": u1.ru_majflt - u0.ru_majflt, "involuntary_switches": u1.ru_nivcsw - u0.ru_nivcsw,
               "machine_ticks": {k: j1[k] - j0[k] for k in j1 if k in j0},
               "threads": threads_over(self._threads0, thread_ticks(), self._main_tid),
               "cpu_s_since_last_step": self._waiting,
               "sm_clock_mhz": None, "clocks_throttle_reasons": None, "mem_clock_mhz": None, "gpu_temp_c": None}
        g1 = self._gpu_counters()
        for key, v0 in self._gpu0.items():  # over the step: None where either reading is missing
            v1 = g1[key]
            out[f"gpu_{key}"] = None if v0 is None or v1 is None else v1 - v0
        if self._nvml is not None:
            nv, h = self._nvml
            try:
                out["sm_clock_mhz"] = int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
                out["clocks_throttle_reasons"] = int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
            except Exception:  # an older NVML binding or driver: the clock alone
                out["clocks_throttle_reasons"] = None
            for key, read in (("mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                              ("gpu_temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))):
                try:
                    out[key] = int(read())
                except Exception:
                    out[key] = None
        # After the step as before it: slow at both ends, the host was slow through the step; at the start
        # only, the core was waking up.
        cpu = self.main_cpu()
        out["cpu_mhz_at_end"] = self.cpu_mhz(cpu)
        out["host_reference_end_s"] = self.host_reference_s()
        self._last_end = time.process_time()
        return out
