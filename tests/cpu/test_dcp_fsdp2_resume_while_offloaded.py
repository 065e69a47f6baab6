"""A resume into an offloaded FSDP2 model and optimizer that have not stepped (``set_model_state_dict`` /
``set_optimizer_state_dict`` of another run's checkpoint), over 2 gloo ranks, ``skip_unchanged`` off and on, and DCP's
``get_optimizer_state_dict`` of an offloaded SGD with momentum: training after ``reload()`` exactly as the run
without torchferry."""

import pytest
import torch

import torchferry
from tests.cpu.test_dcp_state_dict_while_offloaded import _train_with_cycles


def check_resume(rank, world, skip=False):
    import copy

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import assert_same, build_uneven, snapshot

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = build_uneven(mesh, "cpu")
    ref(x).square().mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    msd = copy.deepcopy(get_model_state_dict(ref))
    osd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt))
    m, opt = build_uneven(mesh, "cpu")
    ferry = torchferry.Ferry(m, opt, skip_unchanged=skip)
    ferry.offload()
    set_model_state_dict(m, msd)
    set_optimizer_state_dict(m, opt, osd)
    ferry.reload()
    _train_with_cycles(ferry, x, (m, opt), (ref, ref_opt))
    assert_same(snapshot(ref, ref_opt), snapshot(m, opt))


def check_resume_skip(rank, world):
    check_resume(rank, world, skip=True)


def check_sgd_momentum(rank, world):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import assert_same, build_uneven, snapshot

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref, _ = build_uneven(mesh, "cpu")
    m, _ = build_uneven(mesh, "cpu")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
    get_optimizer_state_dict(ref, ref_opt)
    ferry = torchferry.Ferry(m, opt, skip_unchanged=True)
    ferry.offload()
    get_optimizer_state_dict(m, opt)
    ferry.reload()
    _train_with_cycles(ferry, x, (m, opt), (ref, ref_opt))
    assert_same(snapshot(ref, ref_opt), snapshot(m, opt))


@pytest.mark.parametrize("fn", [check_resume, check_resume_skip, check_sgd_momentum])
def test_fsdp2_dcp_while_offloaded_two_ranks_gloo(own_ledger, fn):
    from tests.spawn import run_spawned

    run_spawned(fn, world=2, backend="gloo")
