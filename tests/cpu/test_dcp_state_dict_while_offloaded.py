"""DCP's state-dict API on an offloaded optimizer that has not stepped yet (the ferry made right after building the
model and its optimizer, as verl and SkyRL offload them before the first step): DCP's ``_init_optim_state`` makes the
state with one step that cannot move a parameter (zero ``.grad``s, ``lr`` 0) and restores the ``lr`` after it; that
step runs while offloaded ([Note: a step that changes nothing] in ``_core/_ferry/guards.py``), so the call works as
without torchferry and training after ``reload()`` is exact. Before: the step guard raised inside it, naming a
``step()`` the caller never made, and left ``lr`` at 0.0 and zero ``.grad``s behind (training silently stood still)."""

import pytest
import torch
from torch import nn

import torchferry


def _train_with_cycles(ferry, x, *runs) -> None:
    """Two steps of each (model, optimizer), the ferry's cycled between them."""
    for _ in range(2):
        for mm, oo in runs:
            mm(x).square().mean().backward()
            oo.step()
            oo.zero_grad()
        ferry.offload()
        ferry.reload()


def _fresh():
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def test_get_optimizer_state_dict_of_an_unstepped_optimizer_while_offloaded_keeps_the_lr(own_ledger):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    ref, ref_opt = _fresh()
    get_optimizer_state_dict(ref, ref_opt)  # without torchferry: works, lr kept
    assert ref_opt.param_groups[0]["lr"] == 1e-2

    m, opt = _fresh()
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    got = get_optimizer_state_dict(m, opt)  # before: "AdamW.step() while its state is offloaded", lr left at 0.0
    want = get_optimizer_state_dict(ref, ref_opt)
    assert got["param_groups"] == want["param_groups"]
    for k, st in want["state"].items():
        for name, t in st.items():
            torch.testing.assert_close(got["state"][k][name], t, atol=0, rtol=0)
    ferry.reload()
    assert opt.param_groups[0]["lr"] == 1e-2
    assert all(p.grad is None for p in m.parameters())
    x = torch.randn(3, 4)
    _train_with_cycles(ferry, x, (m, opt), (ref, ref_opt))  # as the run without torchferry
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)


def test_a_step_that_would_change_parameters_is_still_refused_while_offloaded(own_ledger):
    m, opt = _fresh()
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    for p in m.parameters():
        p.grad = torch.ones_like(p)  # a real gradient: the step would move the parameters
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) while its state is offloaded"):
        opt.step()
    ferry.reload()


def test_set_optimizer_state_dict_into_an_unstepped_optimizer_while_offloaded_resumes_exactly(own_ledger):
    """A resume: the checkpoint loaded into a freshly built (never stepped) model and optimizer that are
    offloaded, then reload() and train on: should equal the run that saved it."""
    import copy

    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    ref, ref_opt = _fresh()
    x = torch.randn(3, 4)
    ref(x).square().mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    msd = copy.deepcopy(get_model_state_dict(ref))
    osd = copy.deepcopy(get_optimizer_state_dict(ref, ref_opt))

    m, opt = _fresh()
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    set_model_state_dict(m, msd)
    set_optimizer_state_dict(m, opt, osd)  # before: "AdamW.step() while its state is offloaded"
    ferry.reload()
    _train_with_cycles(ferry, x, (m, opt), (ref, ref_opt))
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)


def check_fsdp2_dcp_init_while_offloaded(rank: int, world: int) -> None:
    """FSDP2 (uneven shards over 2 gloo ranks): DCP's init step on the offloaded DTensors, then training with cycles,
    exactly as the run without torchferry."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import assert_same, build_uneven, snapshot

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref, ref_opt = build_uneven(mesh, "cpu")
    m, opt = build_uneven(mesh, "cpu")
    get_optimizer_state_dict(ref, ref_opt)
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    get_optimizer_state_dict(m, opt)
    ferry.reload()
    _train_with_cycles(ferry, x, (m, opt), (ref, ref_opt))
    assert_same(snapshot(ref, ref_opt), snapshot(m, opt))


def test_dcp_init_of_an_offloaded_fsdp2_optimizer_trains_exactly_two_ranks_gloo(own_ledger):
    from tests.spawn import run_spawned

    run_spawned(check_fsdp2_dcp_init_while_offloaded, world=2, backend="gloo")
