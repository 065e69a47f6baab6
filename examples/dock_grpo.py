"""A Dock over a GRPO-like step: the actor stays resident, only the reference model moves.

    python examples/dock_grpo.py

The step of ``docs/dock.md`` (and of ``torchferry bench-grpo``) on a toy
policy: rollout (a KV-cache claimant with sleep/wake), reference log-probs,
the actor's old log-probs, the actor's update. The budget holds everything but
half the reference, so in steady state the dock moves only the reference, once
out (behind the update, a prefetch for the rollout's room) and once in per
step; made with ``skip_unchanged=True``, its evictions copy nothing once its
host copy exists. The same steps run a second time with everything resident;
the two actors end bit-identical. Uses CUDA when it is available, else the CPU. Only
the public API: ``torchferry.Dock``, ``torchferry.Ferry``.
"""

import copy

import torch
from torch import nn

import torchferry

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, VOCAB, GROUP, PROMPTS, STEPS = 512, 1024, 4, 8, 4


def make_models(seed: int = 0):
    torch.manual_seed(seed)
    actor = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, VOCAB)).to(device)
    ref = copy.deepcopy(actor).requires_grad_(False)  # the frozen reference policy
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    return actor, ref, optimizer


def rollout(step: int):
    """Stand-in for the rollout engine: prompts, sampled responses and GRPO's group-normalised advantages."""
    g = torch.Generator().manual_seed(step)
    prompts = torch.randn(PROMPTS * GROUP, HIDDEN, generator=g)
    responses = torch.randint(VOCAB, (PROMPTS * GROUP,), generator=g)
    rewards = torch.rand(PROMPTS, GROUP, generator=g)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    return prompts.to(device), responses.to(device), adv.flatten().to(device)


def log_prob(model: nn.Module, prompts, responses):
    return torch.log_softmax(model(prompts), -1).gather(1, responses[:, None]).squeeze(1)


def update(actor, optimizer, batch, ref_lp, old_lp):
    """One clipped-surrogate step with a KL penalty to the reference (k3 estimator)."""
    prompts, responses, adv = batch
    lp = log_prob(actor, prompts, responses)
    ratio = torch.exp(lp - old_lp)
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    kl = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1
    (-(surrogate - 0.04 * kl).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # no .grads kept: they would count and move with the set


def step_resident(actor, ref, optimizer, step: int) -> None:
    batch = rollout(step)
    with torch.no_grad():
        ref_lp = log_prob(ref, *batch[:2])
        old_lp = log_prob(actor, *batch[:2])
    update(actor, optimizer, batch, ref_lp, old_lp)


# ---- the docked run
actor, ref, optimizer = make_models()
step_resident(actor, ref, optimizer, 0)  # the first step gives AdamW its state; the dock starts after it

# One ferry per state set. Ferries hold their targets weakly: keep actor, ref and optimizer.
# The reference never changes: with skip_unchanged=True its evictions copy nothing once its
# host copy exists (see docs/ferry.md, "Skipping what did not change").
params_ferry = torchferry.Ferry(actor, device=device)
opt_ferry = torchferry.Ferry(optimizer, device=device)
ref_ferry = torchferry.Ferry(ref, device=device, skip_unchanged=True)
P, A, R = params_ferry.state_bytes, opt_ferry.state_bytes, ref_ferry.state_bytes  # actor, AdamW, reference
kv_bytes = P + A  # a KV cache as large as the actor's state, as in torchferry bench-grpo
fwd_ws, update_ws = P // 8, 2 * P  # what a forward / an update allocate besides the state (estimates)
budget = P + A + max(kv_bytes, update_ws) + R // 2  # everything but half the reference
kv: dict[str, torch.Tensor] = {}

dock = torchferry.Dock(budget_bytes=budget)
dock.add("actor_params", params_ferry)
dock.add("actor_opt", opt_ferry)
dock.add("ref", ref_ferry)
dock.add_claimant("rollout", kv_bytes,
                  wake=lambda: kv.update(cache=torch.empty(kv_bytes, dtype=torch.uint8, device=device)),
                  sleep=kv.clear, empty_cache=device.type == "cuda")
dock.add_claimant("fwd_workspace", fwd_ws)
dock.add_claimant("update_workspace", update_ws)
dock.plan(["rollout", ("ref", "fwd_workspace"), ("actor_params", "fwd_workspace"),
           ("actor_params", "actor_opt", "update_workspace")])
print(f"budget {budget} bytes; actor {P} + AdamW {A} + reference {R} + KV cache {kv_bytes} = "
      f"{P + A + R + kv_bytes} bytes do not fit at once")

sets = {"actor_params": params_ferry, "actor_opt": opt_ferry, "ref": ref_ferry}
moves = []  # per step: (offloads, reloads) of each set
ref_copied = []  # per step: bytes the reference's last eviction copied
for step in range(1, STEPS + 1):
    before = {n: (f.stats.offloads, f.stats.reloads) for n, f in sets.items()}
    with dock.use("rollout"):
        dock.prefetch_next()  # the reference's room, as far as the budget allows
        batch = rollout(step)
    with dock.use("ref", "fwd_workspace"), torch.no_grad():
        dock.prefetch_next()
        ref_lp = log_prob(ref, *batch[:2])
    with dock.use("actor_params", "fwd_workspace"), torch.no_grad():
        dock.prefetch_next()
        old_lp = log_prob(actor, *batch[:2])
    with dock.use("actor_params", "actor_opt", "update_workspace"):
        dock.prefetch_next()  # the reference leaves now, behind the update's compute
        update(actor, optimizer, batch, ref_lp, old_lp)
    moves.append({n: (f.stats.offloads - before[n][0], f.stats.reloads - before[n][1]) for n, f in sets.items()})
    ref_copied.append(ref_ferry.stats.offload_bytes_copied)
dock.wait()

for step, moved in enumerate(moves, 1):
    print(f"step {step}: " + ", ".join(f"{n} {o} out / {r} in" for n, (o, r) in moved.items())
          + f"; the reference's eviction copied {ref_copied[step - 1]} bytes")
steady = moves[1:]  # step 1 settles the sets the first rollout displaced
assert all(m["actor_params"] == (0, 0) and m["actor_opt"] == (0, 0) and m["ref"] == (1, 1) for m in steady), moves
assert ref_copied[0] == R and all(c == 0 for c in ref_copied[1:]), ref_copied
print(f"dock.stats: {dock.stats}")

# ---- the same steps, everything resident, from the same start
actor2, ref2, optimizer2 = make_models()
for step in range(STEPS + 1):
    step_resident(actor2, ref2, optimizer2, step)
exact = all(torch.equal(a.detach().cpu(), b.detach().cpu())
            for a, b in zip(actor.parameters(), actor2.parameters(), strict=True))
assert exact, "the docked actor differs from the resident one"
print(f"dock_grpo: OK on {device.type}: steady steps move only the reference; actor bit-exact vs resident: {exact}")
dock.close()
for f in sets.values():  # the state back on the device before the ferries go (one dropped offloaded warns)
    f.reload().wait()
