"""The ways of moving actor state that the bench compares.

* ``blocking``: before verl PR #7347: ``model.cpu()`` / ``model.to(dev)`` and
  ``state[k] = v.cpu()`` / ``v.to(dev)`` per optimizer tensor.
* ``seed``: verl PR #7347: ``model.to("cpu", non_blocking=True)``
  and verl's optimizer helpers, which do ``v.to(..., non_blocking=True)``.
* ``torchferry``: one :class:`~torchferry.Ferry` for the model, one for the
  optimizer, pools reserved at setup.
* ``torchferry+prefetch``: the same two ferries (:class:`SharedFerries`), with
  a layer-wise reload.
* ``resident`` (the baseline, not selectable): the state stays on the device.

``offload`` returns when the host copies are complete and the device memory
is back in the caching allocator; the caller then calls ``release()``
(``torch.cuda.empty_cache()``, as verl does after every offload) and times it
apart: it costs one ``cudaFree`` per cached segment, whatever moved the bytes.

Strategies of one ``family`` keep the offloaded state in the same form; the
bench hands the state from one family to another untimed:
``prev.reload(optimizer=True); prev.settle(); nxt.offload(optimizer=True); nxt.release()``, with
``prev.leave()`` right before the first offload of another family (the resident baseline in between
keeps the state where ``prev`` put it).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from torchferry import Ferry, Prefetch

__all__ = ["STRATEGIES", "Resident", "ResidentDMA", "SharedFerries", "Strategy", "make_strategy"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _caching_host_bytes() -> int:
    """Bytes PyTorch's caching host allocator holds (pinned), 0 where unknown."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return 0
    s = stats()
    return int(s.get("reserved_bytes.current", s.get("allocated_bytes.current", 0)))


class Strategy:
    """Moves one model's parameters (and optionally its optimizer state) off and on."""

    name = "base"
    family = "base"
    """Strategies of one family keep the offloaded state in the same form (no hand-over between them)."""
    overlaps_reload = False
    """True if ``reload`` returns before its copies are complete and compute waits for them itself."""
    keeps_resident = False
    """True if the state never leaves the device (the resident baseline: no KV-cache allocation)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device

    def setup(self) -> float:
        """One-time preparation; returns seconds spent pinning host memory (0 if none)."""
        return 0.0

    def offload(self, optimizer: bool) -> None:
        raise NotImplementedError

    def begin_phase(self, phase: str) -> None:
        """Called at the start of a phase (``"old_log_prob"``, ``"update_actor"``), before its reload."""

    def before_forward_only(self) -> None:
        """Called before a forward-only phase (old_log_prob), after the reload."""

    def after_step(self) -> None:
        """Called at the end of a step, untimed."""

    def transfer_gpu_s(self) -> dict[str, float | None] | None:
        """Copy-engine seconds of the last offload and of the reload before it
        (``{"d2h", "h2d"}``), ``None`` where not known (all but torchferry; the CPU)."""
        return None

    def settle(self) -> None:
        """After ``reload(optimizer=True)``: makes the whole state resident now (an overlapped
        reload completes), so that another strategy can take it over."""

    def leave(self) -> None:
        """After :meth:`settle`, right before another family frees the state: drops what this
        strategy keeps on the device beside it, which would keep the freed memory reserved."""

    def release(self) -> None:
        """Returns cached device memory to the driver, as verl does after an offload."""
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self, optimizer: bool) -> None:
        raise NotImplementedError

    def pinned_host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class Blocking(Strategy):
    name = family = "blocking"

    @torch.no_grad()
    def offload(self, optimizer: bool) -> None:
        self.model.cpu()
        if optimizer:
            for st in self.optimizer.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and v.device.type != "cpu":
                        st[k] = v.cpu()
        _sync(self.device)

    @torch.no_grad()
    def reload(self, optimizer: bool) -> None:
        self.model.to(self.device)
        if optimizer:
            for st in self.optimizer.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "step":
                        st[k] = v.to(self.device)
        _sync(self.device)


class Seed(Strategy):
    name = family = "seed"

    @torch.no_grad()
    def offload(self, optimizer: bool) -> None:
        self.model.to("cpu", non_blocking=True)
        if optimizer:
            for st in self.optimizer.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v):
                        st[k] = v.to("cpu", non_blocking=True)
        _sync(self.device)

    @torch.no_grad()
    def reload(self, optimizer: bool) -> None:
        self.model.to(self.device, non_blocking=True)
        if optimizer:
            for st in self.optimizer.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "step":
                        st[k] = v.to(self.device, non_blocking=True)
        _sync(self.device)

    def pinned_host_bytes(self) -> int:
        return _caching_host_bytes()


class SharedFerries:
    """One model :class:`~torchferry.Ferry` and one optimizer ferry, shared by the torchferry
    strategies: one pinned pool, and no hand-over between them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                 skip_unchanged: bool = False) -> None:
        self.model = Ferry(model, device=device, skip_unchanged=skip_unchanged)
        self.optimizer = Ferry(optimizer, device=device, skip_unchanged=skip_unchanged)
        self.pin_s: float | None = None
        """Host seconds the first ``reserve()`` spent pinning."""

    def reserve(self) -> float:
        """Reserves both pools once; returns the seconds the first reservation spent."""
        if self.pin_s is None:
            # reserve_host() without background=True returns the seconds (a float), never a Future
            self.pin_s = cast(float, self.model.reserve_host()) + cast(float, self.optimizer.reserve_host())
        return self.pin_s

    def close(self) -> None:
        self.model.close()
        self.optimizer.close()


class Torchferry(Strategy):
    name = "torchferry"
    family = "torchferry"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 ferries: SharedFerries | None = None) -> None:
        super().__init__(model, optimizer, device)
        self.ferries = ferries or SharedFerries(model, optimizer, device)
        self.model_ferry, self.opt_ferry = self.ferries.model, self.ferries.optimizer
        self._gpu_s: dict[str, float | None] | None = None

    def setup(self) -> float:
        """Reserves the shared pools; a second strategy on the same ferries reports the first's seconds."""
        return self.ferries.reserve()

    def ferries_moved(self, optimizer: bool) -> list[Ferry]:
        """The ferries an offload or reload with ``optimizer`` moves: the model's, and the optimizer's if so."""
        return [self.model_ferry, self.opt_ferry] if optimizer else [self.model_ferry]

    def offload(self, optimizer: bool) -> None:
        ferries = self.ferries_moved(optimizer)
        handles = [f.offload() for f in ferries]
        for h in handles:
            h.wait()
        if self.device.type == "cuda":
            def total(xs):
                return None if any(x is None for x in xs) else sum(xs)
            self._gpu_s = {"d2h": total([h.seconds for h in handles]),
                           "h2d": total([f.stats.last_reload_s for f in ferries])}

    def reload(self, optimizer: bool) -> None:
        handles = [f.reload() for f in self.ferries_moved(optimizer)]
        for h in handles:
            h.wait()

    def transfer_gpu_s(self) -> dict[str, float | None] | None:
        return self._gpu_s

    def settle(self) -> None:
        for f in (self.model_ferry, self.opt_ferry):
            f.reload().wait()  # completes a layer-wise reload under way: everything resident

    def leave(self) -> None:
        # Another family replaces the tensors instead of emptying their storages (model.cpu()):
        # the ferries' cached plans and reload-arena fillers would keep the whole state's memory
        # reserved through its steps (seen on an H200: 7.3 GB left offloaded instead of 1.4).
        # Dropped right before that other offload, not earlier: while the state stays resident
        # (the resident baseline's steps) the fillers keep activations out of the segment's tail.
        for f in (self.model_ferry, self.opt_ferry):
            f.forget_plan()

    def pinned_host_bytes(self) -> int:
        return (self.model_ferry.host_bytes + self.opt_ferry.host_bytes) if self.device.type == "cuda" else 0

    def close(self) -> None:
        self.ferries.close()


class TorchferryPrefetch(Torchferry):
    """torchferry with layer-wise reload ([Note: prefetch reload]): ``reload()`` issues the copies of
    every FSDP unit at once, in forward order (``Prefetch()``: no look-ahead limit), and each unit's
    forward waits only for its own; the optimizer state follows and the step waits for it.
    In the forward-only phase the offload goes in pieces too ([Note: offload during forward]).
    Shares its ferries with ``torchferry`` when both run."""

    name = "torchferry+prefetch"
    overlaps_reload = True

    # Every group issued at reload(): the copy engine streams them back to back. (A 2 GiB look-ahead
    # issued later copies from the forward hooks, behind the compute already queued.)
    lookahead = Prefetch()

    def reload(self, optimizer: bool) -> None:
        for f in self.ferries_moved(optimizer):
            f.reload(prefetch=self.lookahead)

    def before_forward_only(self) -> None:
        # Offload in pieces: each unit's D2H starts once its forward is done.
        self.model_ferry.offload_during_forward()


class Resident(Strategy):
    """The baseline: the state stays on the device; reload, offload and release do nothing.

    Its steps time the phases' compute with nothing to wait for ([Note: exposed time against a
    resident baseline] in ``overlap``); with a :class:`~torchferry.bench.rl_step.timer.UnitTimer`, it
    also times each FSDP unit in the first forward of each phase.
    """

    name = family = "resident"
    keeps_resident = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 timer=None) -> None:
        super().__init__(model, optimizer, device)
        self.timer = timer

    def offload(self, optimizer: bool) -> None:
        pass

    def reload(self, optimizer: bool) -> None:
        pass

    def release(self) -> None:
        pass

    def begin_phase(self, phase: str) -> None:
        if self.timer is not None:
            self.timer.arm(phase)

    def after_step(self) -> None:
        if self.timer is not None:
            self.timer.collect()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.remove()


class ResidentDMA(Resident):
    """A second baseline: the state stays on the device, and each reload copies as many bytes as the
    real one, H2D on a stream of its own that nothing waits for ([Note: the copies' own cost]).

    The bytes go from a 1 GiB pinned host buffer to a 1 GiB device scratch buffer, round and round,
    in 16 MiB pieces each followed by a 1 KiB copy of its first bytes again, the switch points of
    torchferry's reload ([Note: switch points] in ``torchferry._core._transfer.switch``), queued at
    once with ``copy_`` from the caller's thread: its issue time includes waits for a full stream
    queue (large states), its compute span any copies still running. The buffers are set up
    outside the timed spans; the device one lives only during the baseline's own steps. CUDA only.
    """

    name = "resident+dma"
    overlaps_reload = True

    RING_BYTES = 1 << 30  # the host and device buffers the copies cycle through (bytes)
    PIECE_BYTES = 16 << 20  # torchferry's H2D switch interval (bytes)
    SEPARATOR_BYTES = 1 << 10

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 sizes: dict[str, int]) -> None:
        super().__init__(model, optimizer, device)
        self.sizes = sizes
        self._host: torch.Tensor | None = None  # 1D uint8, RING_BYTES, pinned
        self._dev: torch.Tensor | None = None  # 1D uint8, RING_BYTES, on the device: during a step only
        self._stream: torch.cuda.Stream | None = None

    def begin_phase(self, phase: str) -> None:
        """Sets the buffers up, untimed (the host one once; the device one per step, freed after it)."""
        if self._host is None:
            self._host = torch.empty(self.RING_BYTES, dtype=torch.uint8, pin_memory=True)
            self._stream = torch.cuda.Stream(self.device)
        if self._dev is None:
            self._dev = torch.empty(self.RING_BYTES, dtype=torch.uint8, device=self.device)

    def reload(self, optimizer: bool) -> None:
        host, dev, stream = self._host, self._dev, self._stream
        assert host is not None and dev is not None and stream is not None, "begin_phase() sets the buffers up"
        left = self.sizes["params"] + (self.sizes["grads"] + self.sizes["optimizer"] if optimizer else 0)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        off = 0
        with torch.cuda.stream(stream):
            while left:
                n = min(left, self.PIECE_BYTES, self.RING_BYTES - off)
                dev[off:off + n].copy_(host[off:off + n], non_blocking=True)
                sep = min(n, self.SEPARATOR_BYTES)
                dev[off:off + sep].copy_(host[off:off + sep], non_blocking=True)
                off = (off + n) % self.RING_BYTES
                left -= n

    def offload(self, optimizer: bool) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # the copies are done before the next phase

    def after_step(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._dev = None  # the device buffer goes (the next strategy's empty_cache returns it)
        super().after_step()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._host = self._dev = None
        super().close()


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (Blocking, Seed, Torchferry, TorchferryPrefetch)}
"""The strategies a user can select (not the resident baseline, which always runs)."""


def make_strategy(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, *,
                  ferries: SharedFerries | None = None) -> Strategy:
    """A strategy by name (``"resident"`` too); torchferry strategies use ``ferries`` if given.

    Raises:
        ValueError: an unknown name.
    """
    if name == Resident.name:
        return Resident(model, optimizer, device)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    cls = STRATEGIES[name]
    if issubclass(cls, Torchferry):
        return cls(model, optimizer, device, ferries=ferries)
    return cls(model, optimizer, device)
