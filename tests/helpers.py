"""Shared test helpers: models with every kind of state, builders (a trained model, FSDP2 models
over a CPU mesh, training steps), snapshots, comparisons."""

from __future__ import annotations

import copy

import torch
from torch import nn

IDS = torch.tensor([[1, 5, 7], [32, 0, 3]])  # token ids for Mixed


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


class WithRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        with torch.inference_mode():
            cache = torch.arange(8.0)
        self.register_buffer("cos", cache)

    def forward(self, x):
        return self.lin(x) * self.cos


def trained(steps: int = 1, seed: int = 0, ids: torch.Tensor | None = None):
    """A ``Mixed`` model and its AdamW after ``steps`` steps on ``ids`` (default ``IDS``): every kind
    of state present (parameters, grads, buffers, optimizer moments and step counters)."""
    ids = IDS if ids is None else ids
    torch.manual_seed(seed)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        m(ids).backward()
        opt.step()
    return m, opt


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
    """Same names, dtypes, shapes and values (NaN equal to NaN). ``torch.equal`` first: where it holds,
    ``assert_close(atol=0, rtol=0)`` holds too, at a tenth of its cost (it was a sixth of a fault
    sweep's time); otherwise ``assert_close`` decides (NaNs) and says what differs."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        x, y = a[k].cpu(), b[k].cpu()
        if not torch.equal(x, y):
            torch.testing.assert_close(x, y, atol=0, rtol=0, equal_nan=True, msg=k)


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


# ----------------------------------------------------------------------- training loops
def train_step(m, opt, x, set_to_none=False):
    """One step: loss, backward, optimizer step, zero_grad; returns the detached loss."""
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss.detach()


def mlp_and_reference(device: str | torch.device, *, layers: int = 8, width: int = 2048, inputs: int = 4):
    """An MLP of ``layers`` ``Linear(width, width)`` and its AdamW after one step, an identical pair
    (to train without offloading), and the ``inputs - 1`` inputs of the steps still to take."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    ref_m = copy.deepcopy(m)
    opt, ref_opt = (torch.optim.AdamW(x.parameters(), lr=1e-3) for x in (m, ref_m))
    xs = [torch.randn(64, width, device=device, generator=torch.Generator(device).manual_seed(i))
          for i in range(inputs)]
    train_step(m, opt, xs[0], set_to_none=True)
    train_step(ref_m, ref_opt, xs[0], set_to_none=True)
    return m, opt, ref_m, ref_opt, xs[1:]


def assert_same_training(m, opt, ref_m, ref_opt) -> None:
    """Parameters and AdamW state (moments, step counters) bit-identical."""
    for p, q in zip(m.parameters(), ref_m.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    for a, b in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def train_steps(models, x_for_step, steps=4, ferry=None, zero=True):
    """``steps`` steps of every (model, optimizer or None) in ``models`` on ``x_for_step(step)``,
    with an offload/reload cycle of ``ferry`` after each step when given."""
    for step in range(steps):
        x = x_for_step(step)
        for model, opt in models:
            loss = model(x).square().mean()
            loss.backward()
            if opt is not None:
                opt.step()
                if zero:
                    opt.zero_grad()
        if ferry is not None:
            ferry.offload()
            ferry.reload()


def differs(ref, ref_opt, m, opt) -> list[str]:
    """Names of the tensors (see ``snapshot``) whose values differ between two runs."""
    a, b = snapshot(ref, ref_opt), snapshot(m, opt)
    return [k for k in a if not torch.equal(a[k], b[k])]


# ------------------------------------------------------------ FSDP2 builders (inside spawned ranks)
def cpu_mesh(world):
    """A 1-D device mesh over the CPU ranks of the process group (gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def build_uneven(mesh, device="cpu"):
    """Linear(16, 11): uneven over 2 ranks; Linear(11, 1): rank 1's shard is empty."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 11), nn.ReLU(), nn.Linear(11, 1), nn.Linear(1, 5)).to(device)
    for layer in (m[0], m[2], m[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def three_units(mesh, grouped=False, explicit_prefetch=False, opt="sgd"):
    """Sequential(Linear, Linear, Linear), each layer a fully_shard unit, root sharded too."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    if grouped:  # FSDP2's own advice for weights shared by two modules: one group for both
        fully_shard([m[1], m[2]], mesh=mesh)
        fully_shard(m[0], mesh=mesh)
    else:
        for layer in m:
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    if explicit_prefetch:
        m[0].set_modules_to_forward_prefetch([m[1]])
        m[1].set_modules_to_forward_prefetch([m[2]])
    if opt == "sgd":
        return m, torch.optim.SGD(m.parameters(), lr=0.1)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def fsdp_params(m):
    """Every FSDPParam of the fully_shard units under ``m``."""
    from torchferry._core._state.fsdp import fsdp_modules

    out = []
    for unit in fsdp_modules(m):
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
        if groups is None:  # torch 2.11: one group per state
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            out += group.fsdp_params
    return out


def node_ledger():
    """The node ledger a ferry made now uses: its folder and reserve from the environment's
    ``TORCHFERRY_LEDGER_DIR`` and ``TORCHFERRY_HOST_RESERVE_BYTES`` (the core reads no environment)."""
    from torchferry._core._host.budget import NodeLedger
    from torchferry._public.env import core_settings

    settings = core_settings()
    return NodeLedger(folder=settings.ledger_dir, reserve=settings.host_reserve_bytes)
