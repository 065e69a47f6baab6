"""Misuse and faults found by adversarial review: each is loud, or keeps the state intact."""

import gc

import pytest
import torch
from torch import nn

from torchferry import Ferry, Residency


def test_second_ferry_over_offloaded_state_is_refused_and_first_state_kept():
    actor, critic = nn.Linear(64, 64), nn.Linear(64, 64)
    critic.weight = nn.Parameter(actor.weight.data)  # same storage, another object
    want = actor.weight.detach().clone()
    a, b = Ferry(actor), Ferry(critic)
    a.offload()
    with pytest.raises(RuntimeError, match=r"critic|Linear.weight .*(already offloaded by another Ferry|released)"):
        b.offload()
    assert b.residency is Residency.DEVICE
    a.reload()
    torch.testing.assert_close(actor.weight.detach(), want, atol=0, rtol=0)
    b.offload()  # fine once the first ferry reloaded
    b.reload()
    torch.testing.assert_close(critic.weight.detach(), want, atol=0, rtol=0)


def test_tensor_viewing_another_ferrys_pool_is_refused():
    t = torch.randn(100)
    Ferry(t).offload()  # t now views that ferry's pool
    with pytest.raises(RuntimeError, match="already offloaded by another Ferry"):
        Ferry(t)


def test_released_storage_is_refused():
    t = torch.randn(100)
    t.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"holds 0 bytes but the tensor needs 400"):
        Ferry(t)


def test_host_views_outlive_the_pool():
    m = nn.Linear(32, 32)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    ferry = Ferry(m)
    ferry.offload()
    sd = m.state_dict()  # host views of the pool
    ferry.reload()
    ferry.close()
    gc.collect()
    for k in want:  # still mapped: the block goes with its last view
        torch.testing.assert_close(sd[k], want[k], atol=0, rtol=0)


def test_ferry_dropped_while_offloaded_leaves_the_host_copy_readable():
    t = torch.randn(4096)
    want = t.clone()
    f = Ferry(t)
    f.offload()
    del f
    gc.collect()
    torch.testing.assert_close(t, want, atol=0, rtol=0)


def test_failed_pool_growth_does_not_break_later_offloads(monkeypatch):
    import torchferry._host_memory as hm

    m = nn.Linear(16, 16)
    opt = torch.optim.Adam(m.parameters())
    ferry = Ferry(m, opt)
    ferry.offload()
    ferry.reload()
    m(torch.randn(2, 16)).sum().backward()
    opt.step()  # the state grows: the next offload needs a larger pool

    def no_memory(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hm, "_Mapping", no_memory)
    with pytest.raises(RuntimeError, match="could not allocate a host pool"):
        ferry.offload()
    monkeypatch.undo()
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # back to the first layout
    ferry.offload()
    ferry.reload()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.randn(3, dtype=torch.complex64).conj(), "conjugate or negative bit"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.randn(4).share_memory_(), "shared memory"),
        (lambda: torch.jit.script(nn.Linear(2, 2)), "TorchScript"),
    ],
)
def test_unsupported_tensors_are_refused(make, match):
    with pytest.raises(NotImplementedError, match=match):
        Ferry(make())


def test_context_manager_does_not_mask_the_exception_and_reloads():
    m = nn.Linear(4, 4)
    want = m.weight.detach().clone()
    with pytest.raises(KeyError):
        with Ferry(m) as f:
            f.offload()
            raise KeyError("user error")
    assert f.residency is Residency.DEVICE
    torch.testing.assert_close(m.weight.detach(), want, atol=0, rtol=0)


def test_optimizer_state_in_lists_and_of_removed_params_moves():
    torch.manual_seed(0)
    m = nn.Linear(64, 1)
    opt = torch.optim.LBFGS(m.parameters(), history_size=3)
    x = torch.randn(8, 64)

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    opt.step(closure)
    st = opt.state[m.weight]
    history = st["old_dirs"] + st["old_stps"]
    storages = [t.untyped_storage() for t in history]
    want = [t.clone() for t in history]
    orphan = torch.randn(5)
    opt.state[nn.Parameter(torch.zeros(1))] = {"momentum_buffer": orphan}  # not in any group
    ferry = Ferry(opt)
    ferry.offload()
    assert all(s.nbytes() == 0 for s in storages)
    assert orphan.untyped_storage().nbytes() > 0 and orphan.untyped_storage().resizable() is False  # pool view
    ferry.reload()
    for t, w in zip(history, want):
        torch.testing.assert_close(t, w, atol=0, rtol=0)
    opt.step(closure)


def test_optimizer_ferry_made_before_the_first_step_finds_its_device_later():
    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    ferry = Ferry(opt)  # no state yet: nothing says where it will live
    assert not ferry._set.device_fixed
    ferry.offload()
    ferry.reload()
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    want = [v.clone() for st in opt.state.values() for v in st.values()]
    ferry.offload()
    assert ferry._set.device_fixed and ferry.device == torch.device("cpu")
    ferry.reload()
    got = [v for st in opt.state.values() for v in st.values()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _interrupt_on_nth_copy(n: int):
    """A Tensor.copy_ replacement whose n-th call raises KeyboardInterrupt."""
    calls = [0]

    def copy_(dst, src, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt("injected between copies")
        return torch._C.TensorBase.copy_(dst, src, *args, **kwargs)

    return copy_


@pytest.mark.parametrize("direction", ["offload", "reload"])
def test_interrupt_between_copies_leaves_a_well_defined_state(monkeypatch, direction):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024))  # 2 MiB weights: one copy each
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 1024)).sum().backward()
    opt.step()
    want = [t.detach().clone() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    ferry = Ferry(m, opt)
    if direction == "reload":
        ferry.offload()
    monkeypatch.setattr(torch.Tensor, "copy_", _interrupt_on_nth_copy(3))
    with pytest.raises(KeyboardInterrupt):
        getattr(ferry, direction)()
    monkeypatch.undo()
    expected = Residency.DEVICE if direction == "offload" else Residency.HOST
    assert ferry.residency is expected
    got = [t.detach() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    if direction == "offload":
        m(torch.randn(2, 1024))  # no guard left behind
    ferry.offload()
    ferry.reload()  # a retry succeeds
    got = [t.detach() for t in list(m.parameters()) + [v for s in opt.state.values() for v in s.values()]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
