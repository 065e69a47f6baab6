"""On a GPU: an offload keeps a device storage that a tensor the ferry does not know still views
(copied to the pool, not freed), so that tensor stays readable on the device, and frees it once
nothing else holds it ([Note: a storage shared with a tensor the ferry does not know] in
``_state/holders.py``; the CPU tests are ``tests/cpu/test_shared_storage.py``)."""

import pytest
import torch
from torch import nn

from torchferry import Ferry, Residency

pytestmark = pytest.mark.gpu


def test_the_base_of_an_offloaded_slice_stays_readable_on_the_device():
    b = torch.randn(1 << 20, device="cuda")
    want = b.clone()
    ferry = Ferry(b[10:20])
    ferry.offload()
    torch.cuda.synchronize()
    assert ferry.residency is Residency.HOST
    assert torch.equal(b, want)  # read on the device: the storage was kept
    ferry.reload().wait()
    torch.cuda.synchronize()
    assert torch.equal(b, want)


def test_a_weight_view_held_across_an_offload_reads_right_and_follows_the_reload():
    torch.manual_seed(0)
    m = nn.Linear(2048, 2048, device="cuda")
    v = m.weight[0]
    want = m.weight.detach().clone()
    ferry = Ferry(m)
    ferry.offload()
    torch.cuda.synchronize()
    assert torch.equal(v, want[0])
    assert m.weight.device.type == "cpu" and torch.equal(m.weight, want.cpu())
    ferry.reload().wait()
    torch.cuda.synchronize()
    assert torch.equal(m.weight, want) and m.weight.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    with torch.no_grad():
        v.add_(1.0)  # a write through the view after the reload is the weight's
    torch.cuda.synchronize()
    assert torch.equal(m.weight[0], want[0] + 1.0)


def test_a_held_state_dict_keeps_its_storages_until_dropped_then_they_are_freed():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    sd = m.state_dict()
    ferry = Ferry(m, skip_unchanged=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    ferry.offload()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= base  # all kept: the state dict's tensors view every storage
    assert all(torch.equal(sd[k], want[k]) for k in want)
    ferry.reload().wait()
    del sd
    ferry.offload()
    torch.cuda.synchronize()
    state = sum(t.numel() * t.element_size() for t in want.values())
    assert torch.cuda.memory_allocated() <= base - state + (1 << 20)  # nothing else holds them: freed
    ferry.reload().wait()
    assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)
