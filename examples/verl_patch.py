"""verl's FSDP offload helpers routed through torchferry by ``patch()``, then restored by ``unpatch()``.

    python examples/verl_patch.py

Needs verl importable (the test command installs it: ``pip install --no-deps
verl==0.9.1`` after ``pip install -e '.[test]'``). ``patch()`` replaces
verl's helpers in ``verl.utils.fsdp_utils`` and in the verl modules that
imported them by name; here verl's own ``offload_fsdp_model_to_cpu`` /
``load_fsdp_model_to_gpu`` and ``offload_fsdp_optimizer`` /
``load_fsdp_optimizer`` move a plain module and its AdamW state (verl sends
a module that is not FSDP1 to the FSDP2 path, which torchferry takes over).
In verl itself the same calls come from its FSDP workers; see
``docs/verl-quickstart.md``. Uses CUDA when it is available, else the CPU.
"""

import sys

import torch
from torch import nn

import torchferry.integrations.verl as tf_verl

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

try:
    replaced = tf_verl.patch()  # idempotent; returns the "module.attribute" names replaced
except RuntimeError as e:  # verl not importable, or its helpers are not the ones this was written for
    sys.exit(f"verl_patch: {e}")
import verl.utils.fsdp_utils as fsdp_utils  # noqa: E402  (imported by patch() already)

print(f"patch() replaced {len(replaced)} helpers:")
for name in replaced:
    print(f"  {name}")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)).to(device)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(16, 128, device=device)).sum().backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
before = [t.detach().cpu().clone() for t in model.parameters()]
before += [v.cpu().clone() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]

# verl's own call sites, as its FSDP workers make them around a phase.
fsdp_utils.offload_fsdp_model_to_cpu(model)  # empty_cache=True: waits for the copies, then empties the cache
fsdp_utils.offload_fsdp_optimizer(optimizer)
model_ferry, opt_ferry = tf_verl.ferry_for(model), tf_verl.ferry_for(optimizer)  # one ferry each, made by the helpers
assert model_ferry is not None and opt_ferry is not None
print(f"offloaded through torchferry: model {model_ferry.residency.name} ({model_ferry.state_bytes} bytes), "
      f"optimizer {opt_ferry.residency.name} ({opt_ferry.state_bytes} bytes)")
try:
    model(torch.randn(1, 128, device=device))
except RuntimeError as e:  # a forward while offloaded is refused by name
    print(f"forward while offloaded: RuntimeError ({str(e).splitlines()[0][:60]}...)")

fsdp_utils.load_fsdp_model_to_gpu(model)
fsdp_utils.load_fsdp_optimizer(optimizer, device_id=torch.cuda.current_device() if device.type == "cuda" else "cpu")
after = [t.detach().cpu() for t in model.parameters()]
after += [v.cpu() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
exact = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
assert exact, "the round trip through verl's patched helpers changed the state"
stats = model_ferry.stats
print(f"reloaded: model {model_ferry.residency.name}, bit-exact: {exact}; model ferry stats: "
      f"{stats.offloads} offload, {stats.reloads} reload, {stats.bytes_offloaded} bytes")

tf_verl.unpatch()  # verl's own helpers again (reload what torchferry offloaded first, as above)
restored = not tf_verl.is_patched() and not hasattr(fsdp_utils.offload_fsdp_model_to_cpu, "__torchferry_original__")
assert restored
print(f"verl_patch: OK on {device.type}: unpatch() restored verl's helpers: {restored}")
