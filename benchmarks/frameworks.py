#!/usr/bin/env python3
"""SkyRL's and AReaL's own offload/onload functions, unpatched and patched with torchferry, on the
same model in one run: seconds, bytes, the fraction of the same run's link peak, bit-exactness.

    PYTHONPATH=src python benchmarks/frameworks.py --preset qwen2.5-1.5b --json OUT.json
    PYTHONPATH=src python benchmarks/frameworks.py --tiny --json OUT.json    # the CPU check (gloo)

One process, world size 1, FSDP2 (``fully_shard`` on a 1-rank process group: NCCL on a GPU,
gloo on the CPU). In order:

1. the link peak: pinned 1 GiB copies, H2D and D2H (``torchferry.bench._common.link``);
2. SkyRL 0.4.0 (``skyrl.backends.skyrl_train.distributed.fsdp_utils``, called as module
   attributes, as its ``FSDPStrategy.offload_to_cpu`` / ``backload_to_gpu`` call them): the preset
   (fp32 parameters, bf16 compute, the bench's FSDP2 units) with AdamW after one training step;
   ``offload_fsdp2_model_to_cpu``, ``offload_fsdp_optimizer``, ``load_fsdp2_model_to_gpu``,
   ``load_fsdp_optimizer`` each timed (synchronised before and after: the seed's copies are
   ``non_blocking``), first cycle apart from the warm ones; SkyRL's own helpers first, then the
   same model with ``torchferry.integrations.skyrl.patch()``. Then a forward-only model (no
   optimizer, a reference model) with a forward between cycles, both ways: bytes copied per offload;
3. AReaL 1.0.4 (``areal.engine.fsdp_engine.FSDPEngine``, built from a saved config and tokenizer
   with ``init_from_scratch=True``, trained one ``train_batch``): ``offload()`` / ``onload()`` with
   ``torchferry.integrations.areal.patch()``, an actor (with optimizer) and a reference engine (no
   optimizer, ``forward_batch`` between cycles). AReaL's own methods need torch_memory_saver with
   its ``LD_PRELOAD`` hook from process start (``TMS_INIT_ENABLE=1``,
   ``TMS_INIT_ENABLE_CPU_BACKUP=1``, as AReaL's launchers set them): they run in a child process
   of this script (``--_tms-child``) when the hook can be found; otherwise, and when the child
   fails, the JSON says why;
4. one JSON (schema ``torchferry.frameworks/1``) and a table.

Bit-exact: every parameter shard, ``.grad``, buffer and optimizer-state tensor is cloned before the
cycles and compared bitwise (``torch.equal`` of the bytes) after every reload (the child compares
once, after its last cycle, against host copies). ``frac_of_peak`` is bytes / seconds / the peak
of the direction (D2H for offloads, H2D for loads); it is reported raw, and any value above 1.0 is
flagged in ``flags``. Without a GPU the seconds are Python overhead: transfer rates are null.

Not SkyRL/AReaL: where ``ray`` is not installed, ``benchmarks/verl_raystub`` stands in for it
(AReaL's modules import it; nothing here uses it). On Python < 3.12, where SkyRL's
``skyrl.backends`` package ``__init__`` (the Tinker engine backend) fails to import, the package is
registered bare and only SkyRL's own ``fsdp_utils`` module is run (recorded in the JSON). On the
CPU, SkyRL's ``load_*`` helpers call ``torch.cuda.current_device()``, which is made to answer
``"cpu"`` around the unpatched calls.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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


# --------------------------------------------------------------------------------------------- imports
def import_skyrl_fsdp_utils():
    """SkyRL's ``fsdp_utils`` and how it was imported.

    Natively first (Python >= 3.12: ``skyrl.backends.__init__`` imports the Tinker engine backend,
    pydantic and cloudpathlib among its needs). Where that fails (Python 3.11: pydantic refuses
    the backend's ``typing.TypedDict``), ``skyrl.backends`` is registered as the bare package it is
    on disk, its ``__init__`` not run; every module under it is SkyRL's own file.
    """
    try:
        return importlib.import_module(FSDP_UTILS), "native"
    except Exception as e:  # SkyRL's own import-time errors, or an ImportError
        first = _error(e)
    for name in [n for n in sys.modules if n == "skyrl.backends" or n.startswith("skyrl.backends.")]:
        del sys.modules[name]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.cpu.skyrl_import import apply  # the CPU tests' shim: skyrl.backends as a bare package

    if importlib.util.find_spec("skyrl") is None:
        raise ImportError(f"skyrl is not installed ({first})")
    apply(force=True)
    module = importlib.import_module(FSDP_UTILS)
    return module, (f"skyrl.backends registered bare (its __init__, the Tinker engine backend, not run); "
                    f"the native import failed: {first[:300]}")


def use_ray_stub_if_needed() -> bool:
    """``benchmarks/verl_raystub`` on sys.path when ray does not import (AReaL's modules import it at
    module level; nothing here uses it); whether the stand-in is used."""
    try:
        import ray
    except ImportError:
        for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
            del sys.modules[name]
        stub = str(HERE / "verl_raystub")
        if stub not in sys.path:
            sys.path.insert(0, stub)  # only where ray itself did not import
        import ray
    return bool(getattr(ray, "STUB", False))


def import_areal():
    stub = use_ray_stub_if_needed()
    module = importlib.import_module("areal.engine.fsdp_engine")
    return module, stub


# --------------------------------------------------------------------------------------------- context
class Run:
    def __init__(self, args, device, peak) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak = peak  # dict or None
        self.flags: list[str] = []

    def peak_of(self, op: str) -> float | None:
        if not self.peak:
            return None
        return self.peak["d2h"] if op.startswith("offload") else self.peak["h2d"]

    def gap(self) -> None:
        if self.args.gap_s > 0:
            time.sleep(self.args.gap_s)


def _cycles(args) -> int:
    return args.warmup + args.cycles


@contextlib.contextmanager
def _cpu_current_device(cuda: bool):
    """On the CPU: ``torch.cuda.current_device()`` answers "cpu" (SkyRL's load helpers call it)."""
    if cuda:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def _release_host(cuda: bool) -> None:
    from torchferry.bench._common.link import release_host_cache

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    release_host_cache()


def _pinned_cache_bytes(cuda: bool) -> int | None:
    if not cuda or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    hs = torch.cuda.host_memory_stats()
    return int(hs.get("reserved_bytes.current", hs.get("allocated_bytes.current", 0)))


# --------------------------------------------------------------------------------------------- SkyRL
def _skyrl_models(run: Run, with_optimizer: bool, seed: int):
    from torchferry.bench._common.model import build_model
    from torchferry.bench._common.setup import shard_fsdp2
    from torchferry.bench._common.units import reshard

    model = build_model(run.args.preset, run.device, layers=run.args.layers, seed=seed)
    shard_fsdp2(model, run.device, 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, run.args.seq_len), generator=g).to(run.device)
    opt = None
    if with_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(input_ids=ids)
        reshard(model)
    return model, opt, ids


def _train_step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _skyrl_full_cycles(run: Run, fu, model, opt, ids, patched: bool, tf_skyrl) -> dict:
    """Offload model, offload optimizer, (gap), load model, load optimizer; each timed; compared with the
    state before the offload; then one training step (untimed), so that every offload follows a step
    and moves state the step wrote, as SkyRL's after a policy update."""
    dev = run.device
    device_id = torch.cuda.current_device() if run.cuda else "cpu"
    samples: dict[str, list[dict]] = {op: [] for op in SKYRL_OPS}
    compares, freed = [], []
    ids0 = _identities(model, opt)
    ids_kept = True
    with _cpu_current_device(run.cuda):
        for _ in range(_cycles(run.args)):
            before = _state_tensors(model, opt)
            snap = _snapshot(before)
            model_bytes = _device_bytes({k: v for k, v in before.items() if not k.startswith("opt.")}, dev)
            opt_bytes = _device_bytes({k: v for k, v in before.items() if k.startswith("opt.")}, dev)
            free0 = _gpu_free(dev)
            s_om = _timed(dev, lambda: fu.offload_fsdp2_model_to_cpu(model, empty_cache=True))
            r_om = LAST_RELEASE_S[0]
            s_oo = _timed(dev, lambda: fu.offload_fsdp_optimizer(opt))
            r_oo = LAST_RELEASE_S[0]
            if run.cuda:
                torch.cuda.empty_cache()  # as SkyRL's FSDPStrategy.offload_to_cpu does after the helpers
            free1 = _gpu_free(dev)
            run.gap()
            s_lm = _timed(dev, lambda: fu.load_fsdp2_model_to_gpu(model))
            r_lm = LAST_RELEASE_S[0]
            s_lo = _timed(dev, lambda: fu.load_fsdp_optimizer(opt, device_id))
            r_lo = LAST_RELEASE_S[0]
            after = _state_tensors(model, opt)
            compares.append(_compare(snap, after))
            del snap, before, after
            ids_kept = ids_kept and _identities(model, opt) == ids0
            _train_step(model, opt, ids)
            if free0 is not None and free1 is not None:
                freed.append(free1 - free0)
            rec = {"offload_model": (s_om, model_bytes), "offload_optimizer": (s_oo, opt_bytes),
                   "load_model": (s_lm, model_bytes), "load_optimizer": (s_lo, opt_bytes)}
            released = {"offload_model": r_om, "offload_optimizer": r_oo, "load_model": r_lm, "load_optimizer": r_lo}
            if patched:
                fm, fo = tf_skyrl.ferry_for(model), tf_skyrl.ferry_for(opt)
                for f in (fm, fo):
                    if f is not None and f.last_handle is not None:
                        f.last_handle.done()  # completes the stats of a handle already synchronised
                for op, f in (("offload_model", fm), ("offload_optimizer", fo)):
                    st = f.stats
                    samples[op].append({"s": rec[op][0], "bytes": st.offload_bytes_copied,
                                        "state_bytes": st.last_offload_bytes, "copied_bytes": st.offload_bytes_copied,
                                        "release_s": released[op]})
                for op, f in (("load_model", fm), ("load_optimizer", fo)):
                    st = f.stats
                    samples[op].append({"s": rec[op][0], "bytes": st.last_reload_bytes,
                                        "copy_engine_s": st.last_reload_s, "release_s": released[op]})
            else:
                for op, (s, b) in rec.items():
                    samples[op].append({"s": s, "bytes": b, "copied_bytes": b if op.startswith("offload") else None,
                                        "release_s": released[op]})
    w = run.args.warmup
    out: dict = {"ops": {op: summarise(samples[op], run.peak_of(op), w) for op in SKYRL_OPS}}
    out["ops"]["offload"] = summarise(_combine([samples["offload_model"], samples["offload_optimizer"]]),
                                      run.peak_of("offload"), w)
    out["ops"]["load"] = summarise(_combine([samples["load_model"], samples["load_optimizer"]]), run.peak_of("load"), w)
    out["bit_exact"] = _merge_compares(compares)
    out["identities_kept"] = ids_kept
    out["gpu_freed_bytes_by_offload"] = freed
    return out


def _skyrl_forward_only_cycles(run: Run, fu, model, ids, snap, patched: bool, tf_skyrl) -> dict:
    """Offload, (gap), load, a forward (then FSDP2's reshard(): the root stays unsharded after a
    forward, and its transient unsharded copies are no state to offload)."""
    from torchferry.bench._common.units import reshard

    dev = run.device
    off, load, copied, compares, out_equal = [], [], [], [], []
    with torch.no_grad():
        ref_out = model(input_ids=ids).logits.detach().clone()
    reshard(model)
    with _cpu_current_device(run.cuda):
        for _ in range(_cycles(run.args)):
            nbytes = _device_bytes(_state_tensors(model), dev)
            s_off = _timed(dev, lambda: fu.offload_fsdp2_model_to_cpu(model, empty_cache=True))
            run.gap()
            s_on = _timed(dev, lambda: fu.load_fsdp2_model_to_gpu(model))
            compares.append(_compare(snap, _state_tensors(model)))
            with torch.no_grad():  # the forward between cycles (no weight change)
                out_equal.append(bool(torch.equal(model(input_ids=ids).logits, ref_out)))
            reshard(model)
            if patched:
                f = tf_skyrl.ferry_for(model)
                if f.last_handle is not None:
                    f.last_handle.done()
                st = f.stats
                c = st.offload_bytes_copied
                off.append({"s": s_off, "bytes": c, "copied_bytes": c, "state_bytes": st.last_offload_bytes})
                load.append({"s": s_on, "bytes": st.last_reload_bytes})
            else:
                c = nbytes  # model.to("cpu") copies every storage
                off.append({"s": s_off, "bytes": c, "copied_bytes": c, "state_bytes": nbytes})
                load.append({"s": s_on, "bytes": nbytes})
            copied.append(c)
    res = {"ops": {"offload_model": summarise(off, run.peak_of("offload"), run.args.warmup),
                   "load_model": summarise(load, run.peak_of("load"), run.args.warmup)},
           "offload_bytes_copied": copied,
           "copies_nothing_after_first": all(c == 0 for c in copied[1:]) if len(copied) > 1 else None,
           "bit_exact": _merge_compares(compares), "forward_outputs_equal": all(out_equal)}
    if patched:
        f = tf_skyrl.ferry_for(model)
        res["ferry_skip_unchanged"] = getattr(getattr(f, "_set", None), "unchanged", None) is not None
        res["ferry"] = repr(f)
    return res


def run_skyrl(run: Run, res: dict) -> dict:
    """Fills ``res`` as it goes (what ran before a failure stays in the JSON)."""
    res["available"] = False
    try:
        fu, how = import_skyrl_fsdp_utils()
        import torchferry.integrations.skyrl as tf_skyrl
    except Exception as e:
        res["reason"] = f"SkyRL's fsdp_utils does not import here: {_error(e)}"
        say(f"skyrl: skipped ({res['reason'][:200]})")
        return res
    res.update(available=True, version=_version("skyrl"))
    res["import"] = how
    res["functions"] = [f"{FSDP_UTILS}.{n}" for n in ("offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer",
                                                     "load_fsdp2_model_to_gpu", "load_fsdp_optimizer")]
    if not run.cuda:
        res["cpu_stand_ins"] = ["torch.cuda.current_device() answers 'cpu' around SkyRL's own load helpers"]
    tf_skyrl.unpatch()
    # ---- full state: model + AdamW
    say("skyrl: building the model and one training step")
    model, opt, ids = _skyrl_models(run, with_optimizer=True, seed=0)
    t = _state_tensors(model, opt)
    res["state_bytes"] = {"model": _device_bytes({k: v for k, v in t.items() if not k.startswith("opt.")}, run.device),
                          "optimizer": _device_bytes({k: v for k, v in t.items() if k.startswith("opt.")}, run.device)}
    del t
    paths: dict = {}
    res["paths"] = paths
    say("skyrl: SkyRL's own helpers")
    paths["unpatched"] = _skyrl_full_cycles(run, fu, model, opt, ids, False, tf_skyrl)
    paths["unpatched"]["pinned_host_bytes"] = _pinned_cache_bytes(run.cuda)
    _release_host(run.cuda)
    say("skyrl: patched")
    paths["patched"] = {"patched": tf_skyrl.patch(import_call_sites=False)}
    try:
        paths["patched"].update(_skyrl_full_cycles(run, fu, model, opt, ids, True, tf_skyrl))
        fm, fo = tf_skyrl.ferry_for(model), tf_skyrl.ferry_for(opt)
        paths["patched"]["ferries"] = [repr(fm), repr(fo)]
        paths["patched"]["pinned_host_bytes"] = sum(f.pinned_bytes for f in (fm, fo))
        paths["patched"]["ferry_state_bytes"] = {"model": fm.state_bytes, "optimizer": fo.state_bytes}
        del fm, fo  # their pools go with the model
    finally:
        tf_skyrl.unpatch()
    del model, opt, ids
    _release_host(run.cuda)

    # ---- forward-only: a reference model, no optimizer, a forward between cycles
    say("skyrl: forward-only model")
    ref, _, ids = _skyrl_models(run, with_optimizer=False, seed=1)
    snap = _snapshot(_state_tensors(ref))
    fo_res: dict = {"state_bytes": _device_bytes(_state_tensors(ref), run.device)}
    res["forward_only"] = fo_res
    fo_res["unpatched"] = _skyrl_forward_only_cycles(run, fu, ref, ids, snap, False, tf_skyrl)
    _release_host(run.cuda)
    tf_skyrl.patch(import_call_sites=False)
    try:
        fo_res["patched"] = _skyrl_forward_only_cycles(run, fu, ref, ids, snap, True, tf_skyrl)
    finally:
        tf_skyrl.unpatch()
    del ref, snap, ids
    _release_host(run.cuda)
    return res


# --------------------------------------------------------------------------------------------- AReaL
def write_model_dir(path: Path, preset: str, layers: int | None) -> None:
    """A Qwen2 config at the preset's sizes and a word-level tokenizer: what FSDPEngine loads from ``path``
    with ``init_from_scratch=True`` (the weights are random; no download)."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    from torchferry.bench._common.presets import PRESETS

    sizes = dataclasses.asdict(PRESETS[preset])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    cfg = Qwen2Config(**sizes, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # pyright: ignore[reportAttributeAccessIssue]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def _areal_engine(path: str, cuda: bool, lr: float | None, seed: int):
    """AReaL's FSDPEngine as its trainer builds one (an optimizer when ``lr``, else forward-only)."""
    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    config = TrainEngineConfig(experiment_name="torchferry", trial_name="frameworks", path=path, attn_impl="sdpa",
                               init_from_scratch=True, backend="fsdp:d1",
                               dtype="bfloat16" if cuda else "float32", optimizer_dtype="float32",
                               optimizer=None if lr is None else OptimizerConfig(lr=lr))
    engine = FSDPEngine(config)
    engine.create_process_group()
    torch.manual_seed(seed)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
    return engine


def _areal_batch(seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, seq, dtype=torch.bool)
    mask[1, seq * 2 // 3:] = False
    return {"input_ids": torch.randint(0, 62, (2, seq), generator=g), "attention_mask": mask}


def _areal_loss(logprobs, entropy, mb_input, **kwargs):
    return -logprobs.sum()


def _areal_weight(mb_input):
    return torch.tensor(float(mb_input["input_ids"].numel()), device=mb_input["input_ids"].device)


def _areal_state(engine) -> dict:
    return _state_tensors(engine.model, getattr(engine, "optimizer", None))


def _areal_cycles(run_args, device, engine, fsdp_engine, *, mode: str, snap: dict | None, batch=None,
                  tf_areal=None) -> dict:
    """``offload()``, (gap), ``onload()``, each timed; ``forward_batch`` between cycles for a reference
    engine (``batch``). ``mode``: "patched" (bytes from the ferry's stats) or "tms" (AReaL's own
    methods under torch_memory_saver: bytes = GPU memory the pause released, which it backed up)."""
    import torch.distributed as dist

    platform = fsdp_engine.current_platform
    off, on, compares, out_equal = [], [], [], []
    ref_out = None
    if batch is not None:
        ref_out = engine.forward_batch(batch).detach().clone()
    for _ in range(run_args.warmup + run_args.cycles):
        state_bytes = _device_bytes(_areal_state(engine), device)
        platform.clear_memory()  # what offload() does first; here too so that the reserved figure is the pause's
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
        free0 = _gpu_free(device)
        s_off = _timed(device, engine.offload)
        r_off = LAST_RELEASE_S[0]
        free1 = _gpu_free(device)
        freed = None if free0 is None or free1 is None else free1 - free0
        if run_args.gap_s > 0:
            time.sleep(run_args.gap_s)
        s_on = _timed(device, engine.onload)
        # AReaL's offload() besides the move: clear_memory (gc.collect, empty_cache), synchronize,
        # a barrier, two memory-stats logs; timed alone, with the state resident.
        ovh = _timed(device, lambda: (platform.clear_memory(), platform.synchronize(),
                                      dist.barrier(group=engine.cpu_group),
                                      engine.get_device_stats().log("torchferry frameworks: overhead probe")))
        if mode == "patched":
            f = tf_areal.ferry_for(engine)
            if f.last_handle is not None:
                f.last_handle.done()  # completes the stats of the reload (onload() synchronised)
            st = f.stats
            off.append({"s": s_off, "bytes": st.offload_bytes_copied, "copied_bytes": st.offload_bytes_copied,
                        "state_bytes": st.last_offload_bytes, "gpu_freed_bytes": freed, "overhead_s": ovh,
                        "copy_engine_s": st.last_offload_s, "release_s": r_off})
            on.append({"s": s_on, "bytes": st.last_reload_bytes, "copy_engine_s": st.last_reload_s})
        else:
            moved = freed if freed and freed > 0 else 0
            off.append({"s": s_off, "bytes": moved, "copied_bytes": moved, "state_bytes": state_bytes,
                        "gpu_freed_bytes": freed, "reserved_bytes": reserved, "overhead_s": ovh, "release_s": r_off})
            on.append({"s": s_on, "bytes": moved})
        if snap is not None and mode == "patched":
            compares.append(_compare(snap, _areal_state(engine)))
        if batch is not None:
            out_equal.append(bool(torch.equal(engine.forward_batch(batch), ref_out)))
    return {"offload": off, "onload": on, "compares": compares,
            "forward_outputs_equal": all(out_equal) if out_equal else None}


def _areal_summary(run: Run, raw: dict) -> dict:
    out = {"ops": {"offload": summarise(raw["offload"], run.peak_of("offload"), run.args.warmup),
                   "onload": summarise(raw["onload"], run.peak_of("load"), run.args.warmup)}}
    if raw.get("forward_outputs_equal") is not None:
        out["forward_outputs_equal"] = raw["forward_outputs_equal"]
    copied = [s.get("copied_bytes") for s in raw["offload"]]
    out["offload_bytes_copied"] = copied
    out["copies_nothing_after_first"] = all(c == 0 for c in copied[1:]) if len(copied) > 1 else None
    return out


def run_areal(run: Run, res: dict, workdir: Path) -> dict:
    """Fills ``res`` as it goes (what ran before a failure stays in the JSON)."""
    res["available"] = False
    try:
        fsdp_engine, stub = import_areal()
        import torchferry.integrations.areal as tf_areal
    except Exception as e:
        res["reason"] = f"areal.engine.fsdp_engine does not import here: {_error(e)}"
        say(f"areal: skipped ({res['reason'][:200]})")
        return res
    res.update(available=True, version=_version("areal"),
               ray="stand-in (benchmarks/verl_raystub)" if stub else "installed",
               functions=["areal.engine.fsdp_engine.FSDPEngine.offload", "areal.engine.fsdp_engine.FSDPEngine.onload"])
    model_dir = workdir / "areal_model"
    write_model_dir(model_dir, run.args.preset, run.args.layers)
    res["model_dir"] = "a Qwen2 config at the preset's sizes and a 64-token word-level tokenizer (init_from_scratch)"
    seq = run.args.areal_seq_len
    paths: dict = {}
    res["paths"] = paths
    names = tf_areal.patch()
    try:
        say("areal: building the actor (with optimizer) and one train_batch")
        actor = _areal_engine(str(model_dir), run.cuda, 1e-5, seed=0)
        actor.train_batch(_areal_batch(seq, 0), _areal_loss, _areal_weight)
        t = _areal_state(actor)
        res["state_bytes"] = {
            "model": _device_bytes({k: v for k, v in t.items() if not k.startswith("opt.")}, run.device),
            "optimizer": _device_bytes({k: v for k, v in t.items() if k.startswith("opt.")}, run.device),
            "grads_included": any(k.endswith(".grad") for k in t)}
        snap = _snapshot(t)
        ids0 = _identities(actor.model, actor.optimizer)
        del t
        say("areal: patched offload/onload (actor)")
        raw = _areal_cycles(run.args, run.device, actor, fsdp_engine, mode="patched", snap=snap, tf_areal=tf_areal)
        p = _areal_summary(run, raw)
        p["bit_exact"] = _merge_compares(raw["compares"])
        p["identities_kept"] = _identities(actor.model, actor.optimizer) == ids0
        f = tf_areal.ferry_for(actor)
        p["ferry"] = repr(f)
        p["pinned_host_bytes"] = f.pinned_bytes
        p["patched"] = names
        paths["patched"] = p
        del snap, f
        actor.destroy()
        del actor
        _release_host(run.cuda)

        say("areal: patched offload/onload (forward-only reference engine)")
        ref = _areal_engine(str(model_dir), run.cuda, None, seed=1)
        snap = _snapshot(_areal_state(ref))
        raw = _areal_cycles(run.args, run.device, ref, fsdp_engine, mode="patched", snap=snap,
                            batch=_areal_batch(seq, 1), tf_areal=tf_areal)
        fo = _areal_summary(run, raw)
        fo["bit_exact"] = _merge_compares(raw["compares"])
        f = tf_areal.ferry_for(ref)
        fo["ferry_skip_unchanged"] = getattr(getattr(f, "_set", None), "unchanged", None) is not None
        fo["ferry"] = repr(f)
        fo["state_bytes"] = f.state_bytes
        res["forward_only"] = {"patched": fo}
        del snap, f
        ref.destroy()
        del ref
    finally:
        tf_areal.unpatch()
    _release_host(run.cuda)
    if run.cuda:
        torch.cuda.empty_cache()
    # ---- AReaL's own offload()/onload(): torch_memory_saver, in a child process
    tms = run_tms_child(run, model_dir)
    why = tms.get("reason") or "the child did not get to it (torch_memory_saver.child.error)"
    res["paths"]["unpatched"] = tms.pop("actor", None) or {"skipped": why}
    res.setdefault("forward_only", {})["unpatched"] = tms.pop("ref", None) or {"skipped": why}
    res["torch_memory_saver"] = tms
    return res


# --------------------------------------------------------------------------------------------- torch_memory_saver
def _loaded_lib_dirs(names: tuple[str, ...]) -> list[str]:
    """Folders of the shared libraries this process has loaded whose file name starts with one of ``names``."""
    dirs: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                base = os.path.basename(path)
                if any(base.startswith(n) for n in names):
                    d = os.path.dirname(path)
                    if d not in dirs:
                        dirs.append(d)
    except OSError:
        pass
    return dirs


def tms_preload_library() -> tuple[str | None, dict]:
    """The preload hook for this torch's CUDA major, or ``None`` and why; with what AReaL itself would preload."""
    info: dict = {"version": _version("torch_memory_saver")}
    if info["version"] is None:
        return None, {**info, "reason": "torch_memory_saver is not installed (pip install --no-deps "
                                        "torch_memory_saver; a cp39-abi3 wheel with _cu12 and _cu13 builds)"}
    try:
        import torch_memory_saver as tms
        from torch_memory_saver.utils import get_binary_path_from_package

        path = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except Exception as e:
        return None, {**info, "reason": f"torch_memory_saver's preload hook cannot be found: {_error(e)}"}
    areal_path = os.path.join(os.path.dirname(os.path.dirname(tms.__file__)),
                              "torch_memory_saver_hook_mode_preload.abi3.so")
    info["areal_get_tms_env_vars_would_preload"] = areal_path if os.path.exists(areal_path) else None
    info["preload"] = path
    return path, info


def run_tms_child(run: Run, model_dir: Path) -> dict:
    """AReaL's own offload()/onload() under torch_memory_saver (LD_PRELOAD from process start) in a child."""
    if not run.cuda:
        return {"reason": "no CUDA: AReaL's own offload() needs torch_memory_saver, which pauses CUDA allocations "
                          "(it raises RuntimeError without TMS_INIT_ENABLE=1)"}
    if run.args.skip_tms:
        return {"reason": "--skip-tms"}
    lib, info = tms_preload_library()
    if lib is None:
        return info
    lib_dirs = _loaded_lib_dirs(("libcudart.so", "libcuda.so"))
    env = dict(os.environ)
    env.update(LD_PRELOAD=lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else ""),
               TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env["PYTHONPATH"] = ":".join([str(ROOT / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        env.pop("PYTORCH_CUDA_ALLOC_CONF")  # torch_memory_saver refuses expandable segments
    timeout = min(run.args.tms_timeout_s, run.args.budget_s - (time.perf_counter() - _T0) - 15)
    if timeout < 60:
        return {**info, "reason": f"not run: {timeout:.0f} s of --budget-s {run.args.budget_s:.0f} left for it "
                                  "(at least 60 s needed)"}
    out_json = Path(tempfile.mkdtemp(prefix="tf_tms_")) / "child.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_tms-child", str(out_json), "--model-dir", str(model_dir),
           "--preset", run.args.preset, "--cycles", str(run.args.cycles), "--warmup", str(run.args.warmup),
           "--gap-s", str(run.args.gap_s), "--areal-seq-len", str(run.args.areal_seq_len)]
    if run.args.layers is not None:
        cmd += ["--layers", str(run.args.layers)]
    info.update(env={k: env[k] for k in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP")},
                ld_library_path_added=lib_dirs, hook_mode="preload")
    say(f"areal: AReaL's own offload/onload under torch_memory_saver, in a child process (LD_PRELOAD={lib})")
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {**info, "reason": f"the torch_memory_saver child ran past its {timeout:.0f} s (--tms-timeout-s, "
                                  "--budget-s)", "stderr_tail": _tail(err)}
    info["child_s"] = time.perf_counter() - t
    info["returncode"] = p.returncode
    child = None
    if out_json.exists():
        try:
            child = json.loads(out_json.read_text())
        except ValueError:
            child = None
    shutil.rmtree(out_json.parent, ignore_errors=True)
    info["stderr_tail"] = _tail(p.stderr, 2000)
    if child is None or not (child.get("actor") or child.get("ref")):
        why = (child or {}).get("error") or f"the child exited {p.returncode} without results"
        say(f"areal: the torch_memory_saver child failed: {why.splitlines()[0][:300]}")
        return {**info, "reason": f"AReaL's own offload/onload under torch_memory_saver failed: {_tail(why, 1500)}",
                **({"partial": child} if child else {})}
    if child.get("error"):  # the actor ran, the reference engine did not
        run.flags.append(f"areal.unpatched: the torch_memory_saver child failed part-way: "
                         f"{child['error'].splitlines()[0][:300]}")
    info["child"] = {k: v for k, v in child.items() if k not in ("actor", "ref")}
    result: dict = info
    for role in ("actor", "ref"):
        raw = child.get(role)
        if not raw:
            continue
        s = _areal_summary(run, raw)
        s["bit_exact"] = raw.get("bit_exact")
        s["bytes_note"] = ("bytes = GPU memory the pause released (cudaMemGetInfo before/after): every allocation "
                           "torch_memory_saver hooked is backed up to the host and unmapped, free blocks included")
        s["state_bytes"] = raw["offload"][0].get("state_bytes") if raw["offload"] else None
        warm = raw["offload"][run.args.warmup:] or raw["offload"]
        if warm and s["state_bytes"]:
            med = statistics.median(x["s"] for x in warm)
            s["state_frac_of_peak"] = s["state_bytes"] / med / 1e9 / run.peak["d2h"] if run.peak and med else None
        freed = [x.get("gpu_freed_bytes") or 0 for x in raw["offload"]]
        if s["state_bytes"] and max(freed) < 0.5 * s["state_bytes"]:
            run.flags.append(f"areal.unpatched.{role}: torch_memory_saver's pause released {max(freed)} bytes of "
                             f"{s['state_bytes']} state bytes: the preload hook may not see PyTorch's allocations")
        result[role] = s
    return result


def tms_child_main(args) -> None:
    """In the child: AReaL's own offload()/onload() (torch_memory_saver), an actor, then a reference engine."""
    out: dict = {"pid": os.getpid(), "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                 "TMS_INIT_ENABLE": os.environ.get("TMS_INIT_ENABLE")}
    try:
        from torchferry.bench._common.setup import init_distributed
        from torchferry.bench._common.units import reshard

        cuda = torch.cuda.is_available()
        _, _, device = init_distributed(cuda)
        fsdp_engine, stub = import_areal()
        from areal.utils.offload import is_tms_enabled

        out.update(tms_enabled=is_tms_enabled(), ray_stub=stub, torch=torch.__version__, cuda=torch.version.cuda)
        src = fsdp_engine.FSDPEngine.offload
        out["offload_is_areals"] = not hasattr(src, "__torchferry_original__")
        torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
        seq = args.areal_seq_len
        for role, lr, seed in (("actor", 1e-5, 0), ("ref", None, 1)):
            say(f"tms child: {role}")
            engine = _areal_engine(args.model_dir, cuda, lr, seed=seed)
            batch = None
            if lr is not None:
                engine.train_batch(_areal_batch(seq, 0), _areal_loss, _areal_weight)
            else:
                batch = _areal_batch(seq, 1)
            host = _snapshot(_areal_state(engine), device=torch.device("cpu"))  # off the GPU: the pause takes it all
            raw = _areal_cycles(args, device, engine, fsdp_engine, mode="tms", snap=None, batch=batch)
            reshard(engine.model)  # the root stays unsharded after the last forward_batch
            raw["bit_exact"] = _merge_compares([_compare(host, _areal_state(engine), host_snapshot=True)])
            raw["bit_exact"]["note"] = "compared once, after the last cycle, against host copies"
            out[role] = raw
            del host
            engine.destroy()
            del engine
            gc.collect()
    except BaseException as e:  # the parent reports it
        out["error"] = f"{_error(e)}\n{traceback.format_exc()}"
    Path(args._tms_child).write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown under the preload hook


# --------------------------------------------------------------------------------------------- report
def _checks(result: dict) -> dict:
    """What the issue asks of the run: each patched full-state path at >= TARGET_FRAC of the peak, the
    forward-only patched offloads copying nothing after the first, every round trip bit-exact."""
    fw = result["frameworks"]
    sky, ar = fw.get("skyrl", {}), fw.get("areal", {})
    entries, fwd, exact = [], {}, {}
    for name, r, ops in (("skyrl", sky, SKYRL_OPS), ("areal", ar, ("offload", "onload"))):
        done = ((r.get("paths") or {}).get("patched") or {}).get("ops")
        if r.get("available") and r.get("paths") is not None:
            entries += [(name, op, (done or {}).get(op, {}).get("frac_of_peak"),
                         (done or {}).get(op, {}).get("frac_of_peak_excluding_release")) for op in ops]
    for name, r in (("skyrl", sky), ("areal", ar)):
        for path in ("unpatched", "patched"):
            for key, node in ((f"{name}.{path}", (r.get("paths") or {}).get(path)),
                              (f"{name}.forward_only.{path}", (r.get("forward_only") or {}).get(path))):
                be = (node or {}).get("bit_exact")
                if isinstance(be, dict):
                    exact[key] = be.get("equal")
        fo = (r.get("forward_only") or {}).get("patched")
        if fo:
            fwd[name] = fo.get("copies_nothing_after_first")
    fracs = [f for _, _, f, _ in entries]
    fracs_x = [x if x is not None else f for _, _, f, x in entries]

    def at(vals):
        return None if not vals or any(v is None for v in vals) else all(v >= TARGET_FRAC for v in vals)

    return {
        "target_frac_of_peak": TARGET_FRAC,
        "patched_frac_of_peak": [{"framework": a, "op": b, "frac_of_peak": f,
                                  "at_target": None if f is None else f >= TARGET_FRAC,
                                  "frac_of_peak_excluding_release": x} for a, b, f, x in entries],
        "all_patched_at_target": at(fracs),
        "all_patched_at_target_excluding_release": at(fracs_x),
        "forward_only_copies_nothing_after_first": fwd,
        "bit_exact": exact,
        "all_bit_exact": all(v is True for v in exact.values()) if exact else None,
    }


def _settle_peak(result: dict, run: Run, after: dict) -> None:
    """The link peak is the faster of the measurements before and after the frameworks, per
    direction (the link's rate drifted by some 3% between runs, and a low first measurement put
    the frameworks' copies above it); every ``*frac_of_peak*`` computed against the first is
    rescaled to it. Both measurements stay in the JSON."""
    before = dict(result["link_peak_GBps"])
    settled = {k: max(before[k], after[k]) for k in ("h2d", "d2h", "bidir")}
    settled["nbytes"] = before["nbytes"]
    settled["before"], settled["after"] = before, after
    result["link_peak_GBps"] = settled
    result["link_peak_note"] = ("per direction the faster of two measurements (fastest of 5 bursts of 4 pinned "
                                "1 GiB copies each), one before and one after the frameworks, this process")
    run.peak = settled

    def rescale(summary: dict, direction: str) -> None:
        for k, v in list(summary.items()):
            if "frac_of_peak" in k and isinstance(v, (int, float)):
                summary[k] = v * before[direction] / settled[direction]

    for fw in result["frameworks"].values():
        for branch in ((fw.get("paths") or {}).values(), (fw.get("forward_only") or {}).values()):
            for path in branch:
                if isinstance(path, dict) and isinstance(path.get("ops"), dict):
                    for op, summary in path["ops"].items():
                        rescale(summary, "d2h" if op.startswith("offload") else "h2d")


def _flag_over_peak(result: dict, run: Run) -> None:
    def walk(node, path):
        if isinstance(node, dict):
            for key in ("frac_of_peak", "max_cycle_frac_of_peak", "first_frac_of_peak"):
                v = node.get(key)
                if isinstance(v, (int, float)) and v > 1.0:
                    run.flags.append(f"{path}.{key} = {v:.4f} > 1.0: faster than the link peak measured in this run "
                                     "(the peak or the timing is off; reported raw, not capped)")
            for k, v in node.items():
                if k != "checks":
                    walk(v, f"{path}.{k}" if path else k)

    walk(result.get("frameworks", {}), "frameworks")


def print_table(result: dict) -> None:
    rows = []
    fw = result["frameworks"]

    def add(name, path, op, s):
        if not s:
            return
        rows.append([name, path, op, f"{s['first_s']:.4f}",
                     f"{s['median_s']:.4f} [{s['min_s']:.4f}-{s['max_s']:.4f}]", f"{s['bytes'] / 1e9:.3f}",
                     "-" if s.get("GBps") is None else f"{s['GBps']:.1f}",
                     "-" if s.get("frac_of_peak") is None else f"{s['frac_of_peak']:.3f}",
                     "-" if s.get("release_median_s") is None else f"{s['release_median_s'] * 1e3:.1f}",
                     "-" if s.get("frac_of_peak_excluding_release") is None
                     else f"{s['frac_of_peak_excluding_release']:.3f}"])

    for name in ("skyrl", "areal"):
        r = fw.get(name, {})
        if not r.get("available"):
            rows.append([name, "-", f"skipped: {r.get('reason', '?')[:90]}", "", "", "", "", "", "", ""])
            continue
        if r.get("error"):
            rows.append([name, "-", f"failed part-way: {r['error'].splitlines()[0][:90]}", "", "", "", "", "", "", ""])
        for path in ("unpatched", "patched"):
            p = (r.get("paths") or {}).get(path) or {}
            if "ops" not in p:
                rows.append([name, path, f"not run: {str(p.get('skipped') or '-')[:90]}", "", "", "", "", "", "", ""])
                continue
            for op, s in p["ops"].items():
                add(name, path + (" *" if p.get("bit_exact", {}).get("equal") else " !"), op, s)
        for path in ("unpatched", "patched"):
            p = (r.get("forward_only") or {}).get(path) or {}
            if "ops" not in p:
                continue
            for op, s in p["ops"].items():
                add(name, f"fwd-only {path}", op, s)
            rows.append([name, f"fwd-only {path}", "bytes copied per offload",
                         " ".join(f"{c / 1e9:.3f}" for c in p.get("offload_bytes_copied") or []), "", "", "", "", "",
                         ""])
    header = ["framework", "path", "op", "first s", "warm median s [min-max]", "GB", "GB/s", "of peak",
              "empty_cache ms", "of peak w/o it"]
    peak = result.get("link_peak_GBps")
    title = (f"link peak H2D {peak['h2d']:.1f} / D2H {peak['d2h']:.1f} GB/s" if peak else "no link peak (no GPU)")
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"SkyRL / AReaL offload functions ({title}); * bit-exact, ! not")
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        console = Console()
        (console if console.is_terminal else Console(width=170)).print(table)
    except ImportError:
        print(title)
        for row in [header, *rows]:
            print(" | ".join(row))
    c = result["checks"]
    print(f"all patched at >= {TARGET_FRAC} of peak: {c['all_patched_at_target']} "
          f"(without empty_cache: {c['all_patched_at_target_excluding_release']}); forward-only copies nothing: "
          f"{c['forward_only_copies_nothing_after_first']}; all bit-exact: {c['all_bit_exact']}")
    for flag in result["flags"]:
        print(f"flag: {flag}")


# --------------------------------------------------------------------------------------------- main
def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="a torchferry.bench preset (default qwen2.5-1.5b; tiny with --tiny)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset and short inputs (the CPU check)")
    ap.add_argument("--cycles", type=int, default=3, help="timed cycles after the warm-up (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="first cycles, reported apart (default %(default)s)")
    ap.add_argument("--gap-s", type=float, default=None,
                    help="idle seconds between offload and reload (a rollout's place; 1 on a GPU, 0 on the CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens of the SkyRL models' inputs")
    ap.add_argument("--areal-seq-len", type=int, default=None, help="tokens per sequence of AReaL's batches")
    ap.add_argument("--frameworks", default="skyrl,areal", help="comma-separated: skyrl, areal")
    ap.add_argument("--skip-tms", action="store_true", help="do not run AReaL's own methods (torch_memory_saver child)")
    ap.add_argument("--tms-timeout-s", type=float, default=150.0, help="limit for the torch_memory_saver child")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="the child gets at most what is left of this since the start (default %(default)s)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_tms-child", dest="_tms_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.preset is None:
        args.preset = "tiny" if args.tiny else "qwen2.5-1.5b"
    if args.seq_len is None:
        args.seq_len = 16 if args.tiny else 256
    if args.areal_seq_len is None:
        args.areal_seq_len = 6 if args.tiny else 64
    if args.cycles < 1 or args.warmup < 0:
        ap.error("--cycles must be >= 1 and --warmup >= 0")
    return args


def _command(argv: list[str]) -> str:
    try:
        script = str(Path(__file__).resolve().relative_to(Path.cwd()))
    except ValueError:
        script = str(Path(__file__).resolve())
    return " ".join(["python", script, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args._tms_child:
        if args.gap_s is None:
            args.gap_s = 1.0
        tms_child_main(args)
        return 0
    from torchferry.bench._common.setup import env_record, init_distributed

    use_cuda = torch.cuda.is_available()
    if not use_cuda and args.preset != "tiny":
        print(f"error: preset {args.preset!r} needs a GPU; on a machine without CUDA use --tiny", file=sys.stderr)
        return 2
    if args.gap_s is None:
        args.gap_s = 1.0 if use_cuda else 0.0
    _, world, device = init_distributed(use_cuda)
    env = env_record(device, world)
    env["command"] = _command(argv)
    env.update(python=sys.version.split()[0], transformers=_version("transformers"), skyrl=_version("skyrl"),
               areal=_version("areal"), torch_memory_saver=_version("torch_memory_saver"),
               cuda=torch.version.cuda)
    peak = None
    if use_cuda:
        from torchferry.bench._common.link import measure_link_peak

        say("link peak")
        lp = measure_link_peak(device)
        peak = {"h2d": lp.h2d, "d2h": lp.d2h, "bidir": lp.bidir, "nbytes": lp.nbytes}
    run = Run(args, device, peak)
    result: dict = {
        "schema": SCHEMA,
        "env": env,
        "config": {"preset": args.preset, "layers": args.layers, "tiny": args.tiny, "warmup_cycles": args.warmup,
                   "timed_cycles": args.cycles, "gap_s": args.gap_s, "seq_len": args.seq_len,
                   "areal_seq_len": args.areal_seq_len, "world_size": world,
                   "skyrl_model": "Qwen2 at the preset's sizes, random init, fp32 parameters, FSDP2 units as "
                                  "torchferry.bench (each decoder layer, the root; bf16 compute), AdamW after one step",
                   "areal_engine": "FSDPEngine(init_from_scratch=True, optimizer_dtype=float32, dtype=bfloat16 on a "
                                   "GPU / float32 on the CPU, attn_impl=sdpa, backend fsdp:d1), one train_batch"},
        "units": "seconds from the call until its copies are complete (synchronised before and after); bytes moved; "
                 "GB/s = 1e9 B/s; frac_of_peak = bytes / median warm seconds / the link peak of the direction "
                 "(D2H for offloads, H2D for loads), reported raw; first = the first cycle, apart from the warm ones",
        "link_peak_GBps": peak,
        "link_peak_note": "fastest of 5 bursts of 4 pinned 1 GiB copies, this process, before the frameworks"
        if peak else "no GPU: no transfer rates (the seconds are Python overhead)",
        "frameworks": {},
        "flags": run.flags,
    }
    wanted = {x.strip() for x in args.frameworks.split(",") if x.strip()}
    workdir = Path(tempfile.mkdtemp(prefix="tf_frameworks_"))
    try:
        for name, fn in (("skyrl", lambda r: run_skyrl(run, r)), ("areal", lambda r: run_areal(run, r, workdir))):
            res = result["frameworks"][name] = {}
            if name not in wanted:
                res.update(available=False, reason="not asked for (--frameworks)")
                continue
            try:
                fn(res)
            except Exception as e:
                say(f"{name}: failed: {_error(e)}")
                res["error"] = f"{_error(e)}\n{traceback.format_exc()}"
                run.flags.append(f"{name}: the run failed part-way ({_error(e)[:200]}); what ran is in the JSON")
            _release_host(use_cuda)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if use_cuda and peak:
        say("link peak again")
        lp2 = measure_link_peak(device)
        _settle_peak(result, run, {"h2d": lp2.h2d, "d2h": lp2.d2h, "bidir": lp2.bidir, "nbytes": lp2.nbytes})
    _flag_over_peak(result, run)
    result["checks"] = _checks(result)
    result["wall_s"] = time.perf_counter() - _T0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        say(f"wrote {args.json}")
    print_table(result)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
