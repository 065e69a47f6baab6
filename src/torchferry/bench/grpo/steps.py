"""The GRPO scenario's machinery: set-up, the two strategies' steps, their calibration and comparison."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchferry import Dock, Ferry, TransferHandle

from .._common.model import build_model
from .._common.setup import shard_fsdp2
from .._common.units import local_of
from .config import PHASES, SCHEDULE, GrpoConfig

__all__ = ["KVCache", "Side", "StepClock", "build_side", "calibrate", "check_room", "compare", "log_prob", "settle",
           "step_dock", "step_torchferry", "train", "workspace"]


# ------------------------------------------------------------------ set-up


def _eager_attention(model: nn.Module) -> None:
    """Eager attention: matmuls and a softmax, deterministic (SDPA's fused backward may use atomics)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")  # pyright: ignore[reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs
    else:  # older transformers read the config at every forward
        model.config._attn_implementation = "eager"  # pyright: ignore[reportArgumentType]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def log_prob(model: nn.Module, batch: torch.Tensor, micro: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(input_ids=batch).logits.float().logsumexp(-1).mean() for _ in range(micro)]).mean()


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, micro: int) -> torch.Tensor:
    for _ in range(micro):  # gradient accumulation, as verl's ppo_micro_batch_size
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class KVCache:
    """The rollout engine's KV cache: ``wake()`` allocates it, ``sleep()`` frees it (vLLM's sleep mode)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        self.buf: torch.Tensor | None = None  # 1D uint8 while awake

    def wake(self) -> None:
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def sleep(self) -> None:
        self.buf = None

    def generate(self, seconds: float) -> None:
        assert self.buf is not None, "the KV cache sleeps"
        self.buf.fill_(1)
        if seconds:
            time.sleep(seconds)


@dataclasses.dataclass(eq=False)
class Side:
    """One strategy's models, ferries and (``torchferry+dock``) its dock."""

    name: str
    actor: nn.Module
    opt: torch.optim.Optimizer
    ref: nn.Module
    ferries: dict[str, Ferry]  # "actor_params", "actor_optimizer", "ref"
    kv: KVCache
    dock: Dock | None = None
    workspace: dict[str, int] = dataclasses.field(default_factory=dict)  # "forward", "update": bytes

    def let_go(self) -> None:
        """The run is done with this side: its dock closed and its models dropped, then its ferries closed, so
        what they hold offloaded goes with the models (a ferry dropped while its models live warns that their
        state stays on the host).

        Raises:
            RuntimeError: a model is still referenced elsewhere while its ferry holds it offloaded.
        """
        if self.dock is not None:
            self.dock.close()
        del self.actor, self.opt, self.ref
        gc.collect()
        for f in self.ferries.values():
            f.close()

    def resident_bytes(self) -> int:
        """Bytes of this side's state and KV cache on the device now."""
        if self.dock is not None:
            return self.dock.resident_bytes
        kv = self.kv.nbytes if self.kv.buf is not None else 0
        return kv + sum(f.state_bytes for f in self.ferries.values() if not f.residency.on_host)


def build_side(name: str, preset: str, config: GrpoConfig, device: torch.device, world: int,
                batch: torch.Tensor, kv_bytes: int) -> Side:
    """Actor (seed 0) + AdamW and reference (seed 1): the same bits for every strategy.

    Two warm-up updates (optimizer state exists, FSDP2 lazily initialised)
    and one reference forward, identical for every strategy.
    """
    actor = build_model(preset, device, layers=config.layers, seed=0)
    ref = build_model(preset, device, layers=config.layers, seed=1)
    for m in (actor, ref):
        if config.deterministic:
            _eager_attention(m)
        shard_fsdp2(m, device, world)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
    train(actor, opt, batch, config.micro_batches)
    log_prob(ref, batch, config.micro_batches)
    ferries = {"actor_params": Ferry(actor, device=device), "actor_optimizer": Ferry(opt, device=device),
               "ref": Ferry(ref, device=device)}
    return Side(name, actor, opt, ref, ferries, KVCache(kv_bytes, device))


def settle(device: torch.device) -> None:
    """Synchronises, then lets the caching allocator free blocks whose stream uses are over.

    Blocks released with ``record_stream`` (an offload's) stay counted in
    ``memory_allocated()`` until the allocator processes their events, at its
    next allocation: a 1-byte allocation is that allocation.
    """
    torch.cuda.synchronize(device)
    torch.empty(1, dtype=torch.uint8, device=device)


def check_room(device: torch.device, dock_holds: int, step_needs: int) -> None:
    """Both strategies share each GPU: the verl-style step runs beside what the dock keeps resident."""
    total = torch.cuda.get_device_properties(device).total_memory
    if dock_holds + step_needs + (2 << 30) > total:
        raise ValueError(
            f"this GPU ({total} bytes) cannot run the verl-style step ({step_needs} bytes) beside what the dock "
            f"keeps resident between its steps ({dock_holds} bytes) with 2 GiB to spare: lower --kv-gb or "
            "--budget-gb, or use fewer --layers")


def workspace(device: torch.device, fn: Callable[[], object]) -> int:
    """Peak bytes ``fn`` allocates on the device beyond what was allocated before it."""
    settle(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


# ------------------------------------------------------------------ timing
class StepClock:
    """Host wall times of phases; GPU times of compute and of every copy (both copy engines).

    Copies: right after a transfer is issued, a probe stream of its direction
    waits for its handle and records an event there, which completes when the
    copy does; its start is that minus the copy engine's ``handle.seconds``.
    """

    def __init__(self, device: torch.device, probes: dict[str, torch.cuda.Stream] | None) -> None:
        self.device, self.probes = device, probes
        self.cuda = device.type == "cuda"
        torch.cuda.synchronize(device) if self.cuda else None
        self.t0 = time.perf_counter()
        self.origin = None
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.phases: list[dict] = []
        self.accounted: list[int] = []  # bytes the strategy counts as held, sampled in every phase
        self._copies: list[tuple[str, TransferHandle, bool, torch.cuda.Event | None]] = []
        self._compute: list[tuple[str, object, object]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self):
        """A point of the current stream's timeline (an event), or of the host's on the CPU."""
        if not self.cuda:
            return self.now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end_phase(self, name: str, start: float, c0, c1, gap_s: float) -> float:
        """Records phase ``name`` (its compute between marks ``c0`` and ``c1``) ending now; sleeps
        ``gap_s`` untimed after it. Returns the phase's wall seconds."""
        end = self.now()
        self.compute(name, c0, c1)
        self.phases.append({"phase": name, "start": start, "end": end})
        if gap_s:
            time.sleep(gap_s)
        return end - start

    def copy(self, name: str, handle: TransferHandle, background: bool = False) -> None:
        if handle.nbytes == 0:  # a no-op
            return
        ev = None
        if self.cuda:
            probe = self.probes[handle.direction]
            handle.wait_stream(probe)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(probe)
        self._copies.append((name, handle, background, ev))

    def compute(self, phase: str, start, end) -> None:
        self._compute.append((phase, start, end))

    def finish(self) -> dict:
        """Everything in seconds from the step's start (call after the step, all copies waited)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

        def at(mark) -> float:
            return mark if isinstance(mark, float) else self.origin.elapsed_time(mark) / 1e3

        copies = []
        for name, h, background, ev in self._copies:
            h.wait()
            seconds = h.seconds or 0.0
            end = at(ev) if ev is not None else h.issued_at - self.t0 + seconds
            copies.append({"engine": h.direction, "name": name, "start": end - seconds, "end": end,
                           "nbytes": h.nbytes, "background": background})
        compute = [{"phase": p, "start": at(a), "end": at(b)} for p, a, b in self._compute]
        return {"phases": self.phases, "compute": compute, "copies": copies}


# ------------------------------------------------------------------ strategies
def step_torchferry(side: Side, batch: torch.Tensor, config: GrpoConfig, clock: StepClock) -> dict:
    """verl: every set reloaded before its phase and offloaded (waited for) after it."""
    dev, f, micro = clock.device, side.ferries, config.micro_batches
    out: dict[str, float] = {}

    def phase(name: str, sets: tuple[str, ...], compute: Callable[[], object], held: int) -> Any:
        start = clock.now()
        for n in sets:
            clock.copy(n, f[n].reload())
        clock.accounted.append(held + sum(f[n].state_bytes for n in sets))
        c0 = clock.mark()
        result = compute()
        c1 = clock.mark()
        _sync(dev)
        handles = []
        for n in sets:
            h = f[n].offload()
            clock.copy(n, h)
            handles.append(h)
        for h in handles:
            h.wait()
        out[name] = clock.end_phase(name, start, c0, c1, config.phase_gap_s)
        return result

    def rollout() -> None:
        side.kv.wake()
        side.kv.generate(config.rollout_s)
        _sync(dev)
        side.kv.sleep()

    w = side.workspace
    phase("rollout", (), rollout, side.kv.nbytes)
    phase("ref_log_prob", ("ref",), lambda: log_prob(side.ref, batch, micro), w["forward"])
    phase("old_log_prob", ("actor_params",), lambda: log_prob(side.actor, batch, micro), w["forward"])
    loss = phase("update_actor", ("actor_params", "actor_optimizer"),
                 lambda: train(side.actor, side.opt, batch, micro), w["update"])
    return {"phase_wall_s": out, "loss": float(loss)}


def step_dock(side: Side, batch: torch.Tensor, config: GrpoConfig, clock: StepClock) -> dict:
    """The dock: each phase a ``use()`` of its names that prefetches the next phase."""
    dock, dev, micro = side.dock, clock.device, config.micro_batches
    assert dock is not None
    out: dict[str, float] = {}
    seen = [max((m.seq for m in dock.moves), default=-1)]

    def record() -> None:
        for m in dock.moves:
            if m.seq > seen[0]:
                if m.handle is not None:
                    clock.copy(m.name, m.handle, m.background)
                seen[0] = m.seq

    def phase(name: str, names: tuple[str, ...], compute: Callable[[], object], last: bool = False) -> Any:
        start = clock.now()
        with dock.use(*names):
            record()
            clock.accounted.append(dock.resident_bytes)
            dock.prefetch_next()
            record()
            c0 = clock.mark()
            result = compute()
            c1 = clock.mark()
            _sync(dev)
        if last:  # what is still moving would hold up the next rollout: counted here
            dock.wait()
        out[name] = clock.end_phase(name, start, c0, c1, config.phase_gap_s)
        return result

    phase("rollout", SCHEDULE[0], lambda: side.kv.generate(config.rollout_s))
    phase("ref_log_prob", SCHEDULE[1], lambda: log_prob(side.ref, batch, micro))
    phase("old_log_prob", SCHEDULE[2], lambda: log_prob(side.actor, batch, micro))
    loss = phase("update_actor", SCHEDULE[3], lambda: train(side.actor, side.opt, batch, micro), last=True)
    return {"phase_wall_s": out, "loss": float(loss)}


_PHASE_SETS = {"rollout": (), "ref_log_prob": ("ref",), "old_log_prob": ("actor_params",),
               "update_actor": ("actor_params", "actor_optimizer")}


def calibrate(side: Side, batch: torch.Tensor, config: GrpoConfig, device: torch.device) -> dict[str, float]:
    """Each phase's compute with its state resident (moves untimed, residency restored after).

    Runs one update of the actor, as every strategy does in every round:
    the actors stay in step for ``bit_exact``.
    """
    if side.dock is not None:
        side.dock.wait()
    micro, f, out = config.micro_batches, side.ferries, {}
    computes = {
        "rollout": None,
        "ref_log_prob": lambda: log_prob(side.ref, batch, micro),
        "old_log_prob": lambda: log_prob(side.actor, batch, micro),
        "update_actor": lambda: train(side.actor, side.opt, batch, micro),
    }
    for phase in PHASES:
        brought = [n for n in _PHASE_SETS[phase] if f[n].residency.on_host]
        for n in brought:
            f[n].reload().wait()
        if phase == "rollout":
            kv = KVCache(side.kv.nbytes, device)
            _sync(device)
            t = time.perf_counter()
            kv.wake()
            kv.generate(config.rollout_s)
            _sync(device)
            kv.sleep()
        else:
            _sync(device)
            t = time.perf_counter()
            computes[phase]()
            _sync(device)
        out[phase] = time.perf_counter() - t
        for n in brought:
            f[n].offload().wait()
    return out



def compare(a: Side, b: Side, device: torch.device) -> dict:
    """Actor parameters and AdamW state of two sides, bit for bit (all ranks)."""
    import torch.distributed as dist

    for side in (a, b):
        for n in ("actor_params", "actor_optimizer"):
            if side.dock is not None:
                side.dock.wait()
            if side.ferries[n].residency.on_host:
                side.ferries[n].reload().wait()
    params_equal, opt_equal, max_diff = True, True, 0.0
    with torch.no_grad():
        for pa, pb in zip(a.actor.parameters(), b.actor.parameters(), strict=False):
            x, y = local_of(pa), local_of(pb)
            params_equal &= bool(torch.equal(x, y))
            if x.numel():
                max_diff = max(max_diff, float((x.float() - y.float()).abs().max()))
        for (_pa, sa), (_pb, sb) in zip(a.opt.state.items(), b.opt.state.items(), strict=False):
            for k in sa:
                if torch.is_tensor(sa[k]):
                    opt_equal &= bool(torch.equal(local_of(sa[k]), local_of(sb[k])))
    flags = torch.tensor([float(params_equal), float(opt_equal), -max_diff], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"actor_params_equal": bool(flags[0]), "optimizer_state_equal": bool(flags[1]),
            "max_abs_diff": float(-flags[2])}
