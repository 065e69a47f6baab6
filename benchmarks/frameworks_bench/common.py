"""What every part of the frameworks bench shares: paths, the schema, logging, the state's snapshots and the timing."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
ROOT = HERE.parent
SCRIPT = HERE / "frameworks.py"  # the command line (the torch_memory_saver child runs it again)
if importlib.util.find_spec("torchferry") is None:
    sys.path.insert(0, str(ROOT / "src"))

SCHEMA = "torchferry.frameworks/1"
TARGET_FRAC = 0.95
FSDP_UTILS = "skyrl.backends.skyrl_train.distributed.fsdp_utils"
SKYRL_OPS = ("offload_model", "offload_optimizer", "load_model", "load_optimizer")
_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:] if len(text) > n else text


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------- state
def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_tensors(model, optimizer=None) -> dict:
    """Every parameter shard, .grad, buffer and optimizer-state tensor, by a stable name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _local(p.detach())
        if p.grad is not None:
            out[name + ".grad"] = _local(p.grad.detach())
    for name, b in model.named_buffers():
        out["buf." + name] = b
    if optimizer is not None:
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v):
                        out[f"opt.{index}.{k}"] = _local(v.detach())
                index += 1
    return out


def _snapshot(tensors: dict, device=None) -> dict:
    """Clones (on ``device`` when given: the host, for the child process), detached."""
    return {k: (v.detach().clone() if device is None else v.detach().to(device, copy=True)) for k, v in tensors.items()}


def _bytes_view(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _compare(snap: dict, now: dict, host_snapshot: bool = False) -> dict:
    """Bitwise comparison of a snapshot with the current tensors (values moved to the snapshot's device).

    ``device_changed`` counts tensors now on another device than when the snapshot was taken (SkyRL's
    own ``load_fsdp_optimizer`` moves AdamW's host ``step`` tensors to the GPU); not counted for a
    snapshot taken on the host on purpose (``host_snapshot``).
    """
    differing, device_changed = [], []
    missing = sorted(set(snap) ^ set(now))
    for k in snap.keys() & now.keys():
        a, b = snap[k], now[k]
        if b.device != a.device:
            if not host_snapshot:
                device_changed.append(f"{k}: {a.device} -> {b.device}")
            b = b.to(a.device)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bytes_view(a), _bytes_view(b)):
            differing.append(k)
    return {"equal": not differing and not missing, "compared": len(snap.keys() & now.keys()),
            "differing": sorted(differing)[:10], "n_differing": len(differing), "missing": missing[:10],
            "device_changed": len(device_changed), "device_changed_examples": sorted(device_changed)[:3]}


def _merge_compares(results: list[dict]) -> dict:
    if not results:
        return {"equal": None, "checks": 0}
    bad = [r for r in results if not r["equal"]]
    first_bad = bad[0] if bad else None
    return {"equal": not bad, "checks": len(results), "compared": results[-1]["compared"],
            "device_changed": max(r["device_changed"] for r in results),
            "device_changed_examples": results[-1]["device_changed_examples"],
            **({"first_mismatch": first_bad} if first_bad else {})}


def _device_bytes(tensors: dict, device) -> int:
    """Bytes of the distinct storages on ``device`` among ``tensors``."""
    seen, total = set(), 0
    for t in tensors.values():
        if t.device.type != device.type:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen and st.nbytes():
            seen.add(key)
            total += st.nbytes()
    return total


def _identities(model, optimizer=None) -> list[int]:
    """ids of the parameter, .grad, buffer and optimizer-state objects (torchferry keeps them)."""
    ids = []
    for p in model.parameters():
        ids += [id(p), id(p.grad)]
    ids += [id(b) for b in model.buffers()]
    if optimizer is not None:
        ids += [id(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return ids


# --------------------------------------------------------------------------------------------- timing
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _ReleaseClock:
    """Seconds spent in ``torch.cuda.empty_cache()`` (returning cached blocks to the driver) during
    timed calls, whoever calls it: SkyRL's and torchferry's helpers (``empty_cache=True``), AReaL's
    ``clear_memory()`` and the patched ``offload()``. ``cudaFree`` waits for the device's pending
    work, so this release cannot run beside the copies; after a training step most of what it frees
    is the step's own cached blocks (activations, all-gather buffers), the same for both paths."""

    def __init__(self) -> None:
        self.s = 0.0
        self._orig = None

    def __enter__(self):
        self.s, orig = 0.0, torch.cuda.empty_cache
        self._orig = orig

        def timed_empty_cache(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.s += time.perf_counter() - t

        torch.cuda.empty_cache = timed_empty_cache
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.empty_cache = self._orig


LAST_RELEASE_S: list[float] = [0.0]  # of the last _timed call


def _timed(device, fn) -> float:
    _sync(device)
    with _ReleaseClock() as clock:
        t = time.perf_counter()
        fn()
        _sync(device)
        s = time.perf_counter() - t
    LAST_RELEASE_S[0] = clock.s
    return s


def _gpu_free(device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def summarise(samples: list[dict], peak: float | None, warmup: int = 1) -> dict:
    """The first cycle apart; median / min / max over the cycles after the ``warmup`` ones; rates
    against ``peak`` (GB/s)."""
    if not samples:
        return {}
    warm = samples[warmup:] or samples
    secs = [s["s"] for s in warm]
    med = statistics.median(secs)
    nbytes = int(statistics.median(s["bytes"] for s in warm))
    out = {"first_s": samples[0]["s"], "first_bytes": samples[0]["bytes"],
           "median_s": med, "min_s": min(secs), "max_s": max(secs), "cycles": len(samples), "warm_cycles": len(warm),
           "all_s": [s["s"] for s in samples], "bytes": nbytes, "bytes_all": [s["bytes"] for s in samples],
           "GBps": None, "frac_of_peak": None, "first_frac_of_peak": None, "max_cycle_frac_of_peak": None}
    for key in ("copied_bytes", "state_bytes", "copy_engine_s", "gpu_freed_bytes", "overhead_s", "release_s"):
        vals = [s[key] for s in samples if s.get(key) is not None]
        if vals:
            out[key + "_all"] = vals
    if peak and nbytes and med > 0:
        out["GBps"] = nbytes / med / 1e9
        out["frac_of_peak"] = out["GBps"] / peak
        fracs = [s["bytes"] / s["s"] / 1e9 / peak for s in warm if s["s"] > 0 and s["bytes"]]
        out["max_cycle_frac_of_peak"] = max(fracs) if fracs else None
        if samples[0]["s"] > 0 and samples[0]["bytes"]:
            out["first_frac_of_peak"] = samples[0]["bytes"] / samples[0]["s"] / 1e9 / peak
        rel = [s["s"] - s["release_s"] for s in warm if s.get("release_s") is not None]
        if rel and statistics.median(rel) > 0:
            out["release_median_s"] = med - statistics.median(rel)
            out["frac_of_peak_excluding_release"] = nbytes / statistics.median(rel) / 1e9 / peak
        ovh = [s["overhead_s"] for s in warm if s.get("overhead_s") is not None]
        if ovh and med - statistics.median(ovh) > 0:
            out["frac_of_peak_excluding_overhead"] = nbytes / (med - statistics.median(ovh)) / 1e9 / peak
    return out


def _combine(parts: list[list[dict]]) -> list[dict]:
    """Per cycle, the sum of several ops' seconds and bytes (the model and the optimizer together)."""
    out = []
    for i in range(min(len(p) for p in parts)):
        row = {"s": sum(p[i]["s"] for p in parts), "bytes": sum(p[i]["bytes"] for p in parts)}
        if all(p[i].get("release_s") is not None for p in parts):
            row["release_s"] = sum(p[i]["release_s"] for p in parts)
        out.append(row)
    return out
