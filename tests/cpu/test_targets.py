"""The walk over modules, optimizers and tensors (``_state/targets.py``) and its checks: what is
collected (wrapped and listed optimizer state, inference-mode buffers), and what is refused up
front, by name (unsupported, nested, released or foreign tensors, bad targets).

Inference-mode buffers and nested tensors reproduce reports made against commit
df8fb81; so do the refusals of state another ferry holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import Mixed, WithRotary
from torchferry import Ferry, Residency
from torchferry._core._state.plan import build_plan


@pytest.mark.parametrize(
    "targets, exc, match",
    [
        ((), ValueError, "at least one target"),
        ((nn.Linear(2, 2), "weights"), TypeError, r"targets\[1\] is str"),
        ((torch.empty(3, device="meta"),), NotImplementedError, r"meta tensor .*t.shape=torch.Size\(\[3\]\)"),
        ((torch.from_numpy(np.zeros(4)),), NotImplementedError, "cannot be resized"),
        ((torch.eye(3).to_sparse(),), NotImplementedError, "layout"),
        ((list(nn.Linear(2, 2).parameters()),), TypeError, r"targets\[0\] is list \(pass tensors as separate arguments"),
    ],
)
def test_bad_targets_raise_clear_errors(targets, exc, match):
    with pytest.raises(exc, match=match):
        build_plan(list(targets))


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


def test_nested_tensor_is_refused_as_nested():
    with pytest.raises(NotImplementedError, match="is a nested tensor"):
        Ferry(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))


def test_second_ferry_over_offloaded_state_is_refused_and_first_state_kept():
    actor, critic = nn.Linear(64, 64), nn.Linear(64, 64)
    critic.weight = nn.Parameter(actor.weight.data)  # same storage, another object
    want = actor.weight.detach().clone()
    a, b = Ferry(actor, critic.weight), Ferry(critic)  # a knows both objects over the storage: it releases it
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


def test_inference_mode_buffers_move_and_come_back():
    m = WithRotary()
    want = m.cos.clone()
    ferry = Ferry(m)
    for prefetch in (False, True):
        ferry.offload()
        assert m.cos.device.type == "cpu" and torch.equal(m.cos, want)
        ferry.reload(prefetch=prefetch)
        assert m.cos.is_inference() and torch.equal(m.cos, want)
        with torch.no_grad():
            m(torch.ones(2, 8))


def test_module_tree_walks_like_named_modules_parameters_and_buffers():
    """``module_tree`` (the stack walk behind ``walk`` and the guards) yields what PyTorch's own
    walks yield, in the same order: shared submodules and tied weights once, ``None`` entries
    skipped; a class overriding ``named_modules`` gets PyTorch's walk."""
    from torchferry._core._state.tree import members, module_tree

    shared = nn.Linear(3, 3)
    m = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(3, 3, bias=False)), nn.BatchNorm1d(3),
                      nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Embedding(5, 3)}))
    m[3]["b"].weight = m[3]["a"].weight  # tied across branches (shape aside)
    m.add_module("missing", None)
    m.register_buffer("none_buf", None)
    models = [m, Mixed()]
    peft = pytest.importorskip("peft")

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))

    models.append(peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["q", "0"])))

    class Custom(nn.Module):
        def named_modules(self, *args, **kwargs):
            return super().named_modules(*args, **kwargs)

    c = Custom()
    c.lin = nn.Linear(2, 2)
    models.append(nn.Sequential(c, nn.Linear(2, 2)))
    for model in models:
        tree = module_tree(model)
        assert [(n, id(x)) for n, x in tree] == [(n, id(x)) for n, x in model.named_modules()]
        for kind, ref in (("_parameters", model.named_parameters()), ("_buffers", model.named_buffers())):
            assert [(n, id(t)) for n, t in members(tree, kind)] == [(n, id(t)) for n, t in ref]


def test_a_root_overriding_named_parameters_and_buffers_is_asked_for_them():
    """A root whose ``named_parameters`` / ``named_buffers`` yield tensors outside ``_parameters`` /
    ``_buffers``: those move too (the stack walk left them behind)."""

    class WithExtra(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self._extra = [nn.Parameter(torch.randn(1024))]
            self.stash = torch.randn(256)

        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            yield prefix + "extra", self._extra[0]

        def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            yield prefix + "stash", self.stash

    m = WithExtra()
    want = m._extra[0].detach().clone(), m.stash.clone()
    ferry = Ferry(m)
    ferry.offload()
    assert ferry.state_bytes == (16 + 4 + 1024 + 256) * 4
    ferry.reload()
    torch.testing.assert_close(m._extra[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(m.stash, want[1], atol=0, rtol=0)


def test_ids_of_mixed_targets_follow_the_walk():
    """``Targets.ids`` (tensor targets without a generator each) lists the same tensors in the same
    order as :func:`walk`, grads and optimizer state included, and sees a tensor replaced."""
    from torchferry._core._state.targets import Targets, walk

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    a, b = torch.randn(3), torch.randn(2, 2)
    targets = Targets([a, model, b, opt])
    want = [id(t) for _, t in walk([a, model, b, opt])]
    assert targets.ids() == want
    assert len(want) == 2 + 4 + 4 + 4 * 3  # tensors; params; grads; step, exp_avg, exp_avg_sq per param
    model[0].weight = nn.Parameter(torch.randn(3, 4))
    assert targets.ids() != want


def test_tensors_are_the_walks_tensors():
    """``tensors`` (what every offload's fingerprint and reload's check read, no names made) yields
    :func:`walk`'s tensors in its order: tied weights and shared submodules once, ``None`` entries
    skipped, grads after their parameters, a root overriding ``named_parameters`` asked for them,
    a TorchScript module and a bad target refused as :func:`walk` refuses them."""
    from torchferry._core._state.targets import tensors, walk

    shared = nn.Linear(3, 3)
    m = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(3, 3, bias=False)), nn.BatchNorm1d(3),
                      nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Embedding(5, 3)}))
    m[3]["b"].weight = m[3]["a"].weight
    m.add_module("missing", None)
    m.register_buffer("none_buf", None)
    m[1](m[0](torch.randn(4, 3))).sum().backward()  # grads on three parameters only

    class Extra(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self._extra = [nn.Parameter(torch.randn(3))]

        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            yield prefix + "extra", self._extra[0]

    opt = torch.optim.Adam(m.parameters())
    opt.step()
    targets = [torch.randn(2), m, Extra(), Mixed(), opt]
    want = [id(t) for _, t in walk(targets)]
    assert [id(t) for t in tensors(targets)] == want
    mixed = targets[3]
    n_mixed = len(list(mixed.parameters())) + len(list(mixed.buffers()))
    assert len(want) == 1 + (7 + 3 + 3) + 3 + n_mixed + 3 * 3  # tensor; m's params, grads, buffers; Extra; Adam
    with pytest.raises(NotImplementedError, match="TorchScript"):
        tensors([torch.jit.script(nn.Linear(2, 2))])
    with pytest.raises(TypeError, match=r"targets\[1\] is dict"):
        tensors([m, {}])


def test_ids_names_the_bad_target_by_its_position():
    from torchferry._core._state.targets import Targets

    with pytest.raises(TypeError, match=r"targets\[1\] is list"):
        Targets([torch.randn(2), [torch.randn(1)]]).ids()


def test_a_file_mapped_tensor_is_refused_naming_its_cause_and_the_way_out(tmp_path):
    """``torch.from_file`` storages report ``is_shared()``: the refusal named only ``share_memory_()``,
    which the user never called."""
    path = tmp_path / "w.bin"
    torch.arange(8, dtype=torch.float32).numpy().tofile(path)
    m = nn.Linear(8, 1)
    m.bias = nn.Parameter(torch.from_file(str(path), size=1, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match=r"^torchferry: Linear\.bias is in shared memory \(share_memory_\(\), "
                                                  r"a file mapped by torch\.from_file.*\(t\.data = t\.data\.clone\(\)\); "
                                                  r"nothing was moved$"):
        Ferry(m)
    assert m.bias.item() == 0.0
    m.bias.data = m.bias.data.clone()
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()
    assert m.bias.item() == 0.0
