"""Shared test helpers: models with every kind of state, snapshots, comparisons."""

from __future__ import annotations

import torch
from torch import nn


class Mixed(nn.Module):
    """A module with tied weights, buffers of several dtypes and a bf16 branch."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.emb = nn.Embedding(33, 8, device=device)
        self.proj = nn.Linear(8, 7, device=device)
        self.head = nn.Linear(8, 33, bias=False, device=device)
        self.head.weight = self.emb.weight  # tied
        self.low = nn.Linear(7, 3, device=device, dtype=torch.bfloat16)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64, device=device))
        self.register_buffer("mask", torch.tensor([True, False, True], device=device))
        self.register_buffer("cplx", torch.randn(3, dtype=torch.complex64, device=device))
        self.register_buffer("empty", torch.empty(0, 4, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        logits = self.head(h).float()
        side = self.low(self.proj(h).to(torch.bfloat16)).float()
        return logits.sum() + side.sum()


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Clones of every parameter, grad, buffer and optimizer-state tensor, as local tensors."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach().clone()

    out = {}
    for n, p in module.named_parameters():
        out[n] = local(p)
        if p.grad is not None:
            out[n + ".grad"] = local(p.grad)
    for n, b in module.named_buffers():
        out["buf." + n] = local(b)
    if optimizer is not None:
        for i, (p, st) in enumerate(optimizer.state.items()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"opt.{i}.{k}"] = local(v)
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        torch.testing.assert_close(a[k].cpu(), b[k].cpu(), atol=0, rtol=0, equal_nan=True, msg=k)


def identities(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[int]:
    ids = []
    for p in module.parameters():
        ids.append(id(p))
        ids.append(id(p.grad))
    ids += [id(b) for b in module.buffers()]
    if optimizer is not None:
        ids += [id(v) for st in optimizer.state.values() for v in st.values()]
    return ids


def rss_bytes() -> int:
    """Resident set size of this process, bytes (Linux)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
