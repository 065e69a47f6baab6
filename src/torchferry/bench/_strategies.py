"""The ways of moving actor state that the bench compares.

* ``blocking``: before verl PR #7347: ``model.cpu()`` / ``model.to(dev)`` and
  ``state[k] = v.cpu()`` / ``v.to(dev)`` per optimizer tensor.
* ``seed``: verl PR #7347 (``shared/seed/``): ``model.to("cpu", non_blocking=True)``
  and verl's optimizer helpers, which do ``v.to(..., non_blocking=True)``.
* ``torchferry``: one :class:`~torchferry.Ferry` for the model, one for the
  optimizer, pools reserved at setup.

``offload`` returns when the host copies are complete and the device memory
is back in the caching allocator; the caller then calls ``release()``
(``torch.cuda.empty_cache()``, as verl does after every offload) and times it
apart: it costs one ``cudaFree`` per cached segment, whatever moved the bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import Ferry, Prefetch

__all__ = ["STRATEGIES", "Strategy", "make_strategy"]


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
    overlaps_reload = False
    """True if ``reload`` returns before its copies are complete and compute waits for them itself."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device

    def setup(self) -> float:
        """One-time preparation; returns seconds spent pinning host memory (0 if none)."""
        return 0.0

    def offload(self, optimizer: bool) -> None:
        raise NotImplementedError

    def before_forward_only(self) -> None:
        """Called before a forward-only phase (old_log_prob), after the reload."""

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
    name = "blocking"

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
    name = "seed"

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


class Torchferry(Strategy):
    name = "torchferry"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model_ferry = Ferry(self.model, device=self.device)
        self.opt_ferry = Ferry(self.optimizer, device=self.device)

    def setup(self) -> float:
        return self.model_ferry.reserve_host() + self.opt_ferry.reserve_host()

    def offload(self, optimizer: bool) -> None:
        handles = [self.model_ferry.offload()]
        if optimizer:
            handles.append(self.opt_ferry.offload())
        for h in handles:
            h.wait()

    def reload(self, optimizer: bool) -> None:
        handles = [self.model_ferry.reload()]
        if optimizer:
            handles.append(self.opt_ferry.reload())
        for h in handles:
            h.wait()

    def pinned_host_bytes(self) -> int:
        return (self.model_ferry.host_bytes + self.opt_ferry.host_bytes) if self.device.type == "cuda" else 0

    def close(self) -> None:
        self.model_ferry.close()
        self.opt_ferry.close()


class TorchferryPrefetch(Torchferry):
    """torchferry with layer-wise reload ([Note: prefetch reload]): the forward starts as soon
    as the first FSDP unit is back; the optimizer state follows and the step waits for it.
    In the forward-only phase the offload goes in pieces too ([Note: offload during forward])."""

    name = "torchferry+prefetch"
    overlaps_reload = True

    # 2 GiB ahead of the unit computing: reload() issues only the first units and
    # allocates the rest from the forward hooks, while the host runs ahead of the GPU.
    lookahead = Prefetch(lookahead_bytes=2 << 30)

    def reload(self, optimizer: bool) -> None:
        self.model_ferry.reload(prefetch=self.lookahead)
        if optimizer:
            self.opt_ferry.reload(prefetch=self.lookahead)

    def before_forward_only(self) -> None:
        # Offload in pieces: each unit's D2H starts once its forward is done.
        self.model_ferry.offload_during_forward()


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (Blocking, Seed, Torchferry, TorchferryPrefetch)}


def make_strategy(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return STRATEGIES[name](model, optimizer, device)
