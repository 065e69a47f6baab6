"""A model and its optimizer leave the device around a stand-in rollout, come back, and match bit for bit.

    python examples/offload_reload.py

Uses CUDA when it is available, else the CPU (where the same moves run into an
unpinned host pool). Only the public API: ``torchferry.Ferry``.
"""

import torch
from torch import nn

import torchferry

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)

# A small model and its optimizer. The ferry holds its targets weakly: these two
# names keep them alive (a ferry never keeps a dropped model alive).
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step() -> None:
    loss = model(torch.randn(32, 256, device=device)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot() -> list[torch.Tensor]:
    """Every parameter and optimizer-state tensor, cloned to the CPU."""
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [t.to("cpu", copy=True) for t in tensors]


train_step()  # AdamW has state (exp_avg, exp_avg_sq) from here on
before = snapshot()
weight_object = model[0].weight

ferry = torchferry.Ferry(model, optimizer, device=device)
handle = ferry.offload()  # D2H on torchferry's own stream; the device storages are released
handle.wait()  # the host copies are complete
if device.type == "cuda":
    torch.cuda.empty_cache()  # give the freed memory back to the driver, as verl does
print(f"offloaded: {ferry.state_bytes} bytes, residency {ferry.residency.name}, "
      f"weights now on {model[0].weight.device.type}")

# Stand-in rollout: another user of the device takes the room the state freed.
kv_cache = torch.empty(ferry.state_bytes, dtype=torch.uint8, device=device)
kv_cache.fill_(1)
del kv_cache

ferry.reload()  # H2D; the current stream waits for it, so the next kernel needs no host sync
after = snapshot()
exact = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
assert exact, "the round trip changed the state"
assert model[0].weight is weight_object  # the same Parameter object, hooks and all
print(f"reloaded: residency {ferry.residency.name}, bit-exact: {exact} "
      f"({len(after)} tensors, {ferry.stats.offloads} offload, {ferry.stats.reloads} reload)")

train_step()  # training goes on as if nothing had moved
ferry.close()  # no device memory, host memory or hooks left behind
print(f"offload_reload: OK on {device.type}")
