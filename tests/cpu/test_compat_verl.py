"""The seed's four helpers: same signatures, backed by a ferry per object."""

import gc
import weakref
import inspect

import pytest
import torch
from torch import nn

from torchferry.compat import verl
from tests.helpers import Mixed, assert_same, snapshot

IDS = torch.tensor([[1, 2, 3]])

# verl.utils.fsdp_utils after verl PR #7347: the contract callers rely on.
SEED_SIGNATURES = {
    "offload_fsdp2_model_to_cpu": "(model, empty_cache: bool = True)",
    "load_fsdp2_model_to_gpu": "(model)",
    "offload_fsdp_optimizer": "(optimizer)",
    "load_fsdp_optimizer": "(optimizer, device_id)",
}


@pytest.mark.parametrize("name, params", SEED_SIGNATURES.items())
def test_signatures_match_the_seed(name, params):
    sig = inspect.signature(getattr(verl, name))
    names = [p.name for p in sig.parameters.values()]
    defaults = {p.name: p.default for p in sig.parameters.values() if p.default is not inspect.Parameter.empty}
    want = [s.split(":")[0].split("=")[0].strip() for s in params.strip("()").split(",")]
    assert names == want
    assert defaults == ({"empty_cache": True} if "empty_cache" in params else {})


def test_helpers_round_trip_model_and_optimizer():
    torch.manual_seed(0)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters())
    verl.offload_fsdp_optimizer(opt)  # no state yet: a no-op, as in verl
    assert verl.ferry_for(opt) is None
    m(IDS).backward()
    opt.step()
    before = snapshot(m, opt)
    verl.offload_fsdp2_model_to_cpu(m)
    verl.offload_fsdp_optimizer(opt)
    # The seed's contract: offloaded tensors are CPU tensors.
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert verl.ferry_for(m).residency.on_host and verl.ferry_for(opt).residency.on_host
    verl.load_fsdp2_model_to_gpu(m)
    verl.load_fsdp_optimizer(opt, "cpu")
    assert_same(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_load_optimizer_on_another_device_is_refused():
    m = nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), momentum=0.9)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    verl.offload_fsdp_optimizer(opt)
    with pytest.raises(ValueError, match=r"device_id=.*offloaded from cpu"):
        verl.load_fsdp_optimizer(opt, "meta")
    assert verl.ferry_for(opt).residency.on_host  # state untouched
    verl.load_fsdp_optimizer(opt, "cpu")


def test_ferries_go_with_their_model():
    m = nn.Linear(3, 3)
    verl.offload_fsdp2_model_to_cpu(m)
    verl.load_fsdp2_model_to_gpu(m)
    ferry = weakref.ref(verl.ferry_for(m))
    assert ferry() is not None
    del m
    gc.collect()
    assert ferry() is None  # the ferry went with its model


def test_load_without_offload_is_a_no_op():
    m = nn.Linear(3, 3)
    w = m.weight.detach().clone()
    verl.load_fsdp2_model_to_gpu(m)
    assert torch.equal(m.weight, w) and verl.ferry_for(m) is None
