"""``CallTimer``: the seconds of every offload and reload verl's actor makes, wherever it makes them.

[Note: the calls timed]
verl moves its state at two kinds of call site: ``FSDPEngine.to`` (the engine context around
compute_log_prob, the reference's forward and update_actor) and, for FSDP1 and LoRA, the weight sync
itself: ``FSDPEngine.get_per_tensor_param`` (verl 0.9.1, ``verl/workers/engine/fsdp/transformer_impl.py``)
calls ``load_fsdp_model_to_gpu`` before it reads the parameters and ``offload_fsdp_model_to_cpu`` after.
Timing ``FSDPEngine.to`` alone left the weight sync's moves out of ``transfer_at_calls`` (verl's FSDP1
weight_sync phase: 0.344 s exposed, 0 s at calls, in
``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp-full-compute-rich_h100x1_2026-12-06_eba85c2_micro-8-8.json``),
so the two methods could not agree. The timer wraps both: ``FSDPEngine.to``, and the two model helpers
as ``transformer_impl`` binds them, whichever strategy's they are (verl's or torchferry's after
``patch()``); a helper called inside a timed ``to`` is part of that call and is not timed again.
Instrumentation only: each wrapper calls what it wraps with the same arguments.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_step.records import _part_bytes

HELPERS = {"load_fsdp_model_to_gpu": "reload", "offload_fsdp_model_to_cpu": "offload"}


class CallTimer:
    """Records one event per offload/reload call into ``records[label]["events"]``.

    Each event: phase, step, direction, the parts moved, ``host_s`` (seconds inside the call, host clock),
    ``seconds`` (a reload's: from its start until the compute stream may go on, CUDA events, set by
    :meth:`resolve`; an offload's: its host seconds, the copies completed by a synchronisation before it
    returns), ``bytes`` moved (by a torchferry ferry: what its stats counted in the call, so unchanged
    storages an offload skipped and a no-op left out; by verl's helpers: the whole part) and the residency
    after. ``current`` holds the label, phase and step of the running strategy.
    """

    def __init__(self, *, ti: Any, records: dict, current: dict, kinds: dict, cuda: bool,
                 sync: Callable[[], None], ferry_for: Callable, record_stalls: Callable, engine_to: Callable,
                 profile: bool = False):
        import torch

        self.torch, self.ti, self.records, self.current, self.kinds = torch, ti, records, current, kinds
        self.cuda, self.sync, self.ferry_for, self.record_stalls = cuda, sync, ferry_for, record_stalls
        self.engine_to = engine_to
        self.engines: dict[int, Any] = {}  # id(engine.module) -> engine, for the helpers' bytes
        self.inside = False  # within a timed call: the helpers it calls are its own time
        self.saved: dict[str, Callable] | None = None
        self.profile = profile  # diagnosis: each call after the first round under cProfile (slower)
        self.profiles: dict[tuple[str, str, str], cProfile.Profile] = {}

    def install(self) -> None:
        """``FSDPEngine.to`` timed, for every strategy (call once)."""
        timer = self

        def timed_to(engine, device, model=True, optimizer=True, grad=True):
            if timer.cuda:
                direction = "offload" if device == "cpu" else "reload"
            else:  # the CPU check: the part's state before the call (_cpu_engine_to_by_direction)
                off = engine.__dict__.get("_cpu_offloaded", {"model": False, "optimizer": False})
                direction = "reload" if off["model" if model else "optimizer"] else "offload"
            with_optimizer = bool(optimizer and engine.optimizer is not None and engine.optimizer.state)
            return timer._timed(engine, direction, model=bool(model), optimizer=with_optimizer,
                                call=lambda: timer.engine_to(engine, device, model=model, optimizer=optimizer,
                                                             grad=grad))

        self.ti.FSDPEngine.to = timed_to

    def know(self, engine) -> None:
        self.engines[id(engine.module)] = engine

    def wrap_helpers(self) -> None:
        """The model helpers as ``transformer_impl`` binds them now, timed; :meth:`unwrap_helpers` before the
        next ``patch()`` / ``unpatch()`` (they replace only the names they find there)."""
        self.saved = {name: getattr(self.ti, name) for name in HELPERS}
        for name, direction in HELPERS.items():
            setattr(self.ti, name, self._helper(self.saved[name], direction))

    def unwrap_helpers(self) -> None:
        if self.saved is not None:
            for name, fn in self.saved.items():
                setattr(self.ti, name, fn)
            self.saved = None

    def _helper(self, fn: Callable, direction: str) -> Callable:
        timer = self

        def timed(module, *args, **kwargs):
            engine = timer.engines.get(id(module))
            if timer.inside or engine is None:
                return fn(module, *args, **kwargs)
            return timer._timed(engine, direction, model=True, optimizer=False,
                                call=lambda: fn(module, *args, **kwargs))

        return timed

    def _timed(self, engine, direction: str, *, model: bool, optimizer: bool, call: Callable[[], Any]):
        torch, cur = self.torch, self.current
        self.sync()  # a phase boundary: verl's phases end with their outputs on the host
        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        parts = [p for p, on in (("model", model), ("optimizer", optimizer)) if on]
        objs = {"model": engine.module, "optimizer": engine.optimizer}
        before = {p: self._stats(objs[p]) for p in parts}
        prof = None
        if self.profile and cur["step"] >= 1:
            prof = self.profiles.setdefault((cur["label"], cur["phase"], direction), cProfile.Profile())
        t0 = time.perf_counter()
        self.inside = True
        try:
            with self.record_stalls():  # waits inside the call are in its seconds, not in the phase's stalls
                if prof is not None:
                    prof.enable()
                try:
                    out = call()
                finally:
                    if prof is not None:
                        prof.disable()
        finally:
            self.inside = False
        if direction == "offload":
            self.sync()  # the next phase (the rollout) needs the memory: the copies complete here
        host_s = time.perf_counter() - t0
        if end is not None:
            end.record()  # a reload: where the compute stream may go on (no sync: the phase's forward follows)
        residency: dict[str, str | None] = {"model": None, "optimizer": None}
        moved = 0
        for part, obj in objs.items():
            f = None if obj is None else self.ferry_for(obj)
            residency[part] = None if f is None else f.residency.name
            if part not in parts:
                continue
            if f is None:  # verl's helpers (or the resident's, counted 0 below): the whole part
                moved += _part_bytes(engine, part)
                continue
            was = before[part]  # what this call moved: a no-op 0, an offload's skipped storages 0
            if direction == "reload":  # a layer-wise reload counts in the stats only when it completes
                moved += _part_bytes(engine, part) if was is not None and was[0] and not f.residency.on_host else 0
            elif was is None or f.stats.bytes_offloaded != was[1].bytes_offloaded:
                moved += f.stats.offload_bytes_copied
        self.records[cur["label"]]["events"].append({
            "phase": cur["phase"], "step": cur["step"], "direction": direction, "model": model,
            "optimizer": optimizer, "host_s": host_s, "seconds": host_s, "_timing": (start, end),
            "bytes": 0 if self.kinds[cur["label"]] == "resident" else moved,
            "gpu_allocated_after": torch.cuda.memory_allocated() if self.cuda else 0,
            "model_residency_after": residency["model"], "optimizer_residency_after": residency["optimizer"]})
        return out

    def _stats(self, obj):
        """Whether ``obj``'s ferry is on the host now, and its :class:`~torchferry.TransferStats`; ``None``:
        no ferry yet."""
        f = None if obj is None else self.ferry_for(obj)
        return None if f is None else (f.residency.on_host, f.stats)

    def resolve(self, label: str) -> None:
        """After a synchronisation: each reload's seconds from its call until the compute stream could go on."""
        for e in self.records[label]["events"]:
            start, end = e.pop("_timing", (None, None))
            if start is not None and e["direction"] == "reload":
                e["seconds"] = max(start.elapsed_time(end) / 1e3, 0.0)

    def profile_of(self, label: str, top: int = 25) -> dict[str, list[dict]]:
        """``profile``: per "phase direction", the ``top`` functions by cumulative seconds over the calls after
        the first round (cProfile's figures: host time, the profiler's overhead included)."""
        out = {}
        for (lab, phase, direction), prof in self.profiles.items():
            if lab != label:
                continue
            st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            rows = sorted(st.items(), key=lambda kv: -kv[1][3])[:top]
            out[f"{phase} {direction}"] = [
                {"function": f"{Path(f).name}:{line} {name}", "calls": nc, "own_s": tt, "cumulative_s": ct}
                for (f, line, name), (_, nc, tt, ct, _) in rows]
        return out
