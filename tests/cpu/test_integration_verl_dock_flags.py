"""verl's dock mode against verl 0.9.1's own flags and lifecycle, on the CPU: only what
verl offloads is a state set, what it keeps resident is reserved; every combination of ``param_offload`` /
``optimizer_offload`` trains through a rollout within the budget; a checkpoint loaded while the optimizer was
evicted is counted; an optimizer's first-step state is told from its layout; a dock replaced inside a phase
releases it; an optimizer re-created before or inside a phase is the set moved from then on, and a dropped one's set
leaves before the next decision; only the budget's refusals are worded as such (a ``HostBudgetError`` is raised as
it is); a context nested in one of the other mode fits at its first use. Engines are verl's ``FSDPEngine``
with a plain module, as in ``test_integration_verl_dock.py``."""

import gc
import types

import pytest
import torch

pytest.importorskip("verl.workers.engine_workers", reason="verl's actor code and what it imports are not installed")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry._core._state.host_blocks import in_host_pool  # noqa: E402
from torchferry import HostBudgetError  # noqa: E402
from torchferry.integrations._base import DOCK_ENV, REGISTRY, has_state  # noqa: E402

from verl.workers.engine import base  # noqa: E402

N = 512
P = (N * N + N) * 4  # the parameters' bytes
OPT = 2 * P + 2 * 4  # AdamW's two moments and its two steps (0-dim, on the host: here the device)
B = 4 << 20  # the budget


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(DOCK_ENV, raising=False)
    tf_verl.unpatch()
    REGISTRY.kept.clear()
    yield
    tf_verl.unpatch()
    REGISTRY.kept.clear()


def _engine(param_offload: bool, optimizer_offload: bool, optimizer=torch.optim.AdamW, n: int = N, **kw):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    e = object.__new__(FSDPEngine)
    e.module = torch.nn.Linear(n, n)
    e.optimizer = optimizer(e.module.parameters(), **kw)
    e._is_offload_param, e._is_offload_optimizer = param_offload, optimizer_offload
    e.mode = None
    e.engine_config = types.SimpleNamespace(forward_only=False)
    return e


def _update(e) -> None:
    """update_actor: forward, backward, step, gradients dropped (verl's zero_grad)."""
    with base.BaseEngineCtx(e, "train"):
        e.module(torch.ones(2, e.module.in_features)).sum().backward()
        e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)


def _on_device(e) -> int:
    """Bytes the engine's state holds on its device now (outside every host pool)."""
    ts = [*e.module.parameters(), *(t for s in e.optimizer.state.values() for t in s.values())]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in ts if t.numel() and not in_host_pool(t.data_ptr())}.values())


@pytest.mark.parametrize("param_offload,optimizer_offload,kv,sets,reserved", [
    (True, True, 2 << 20, {"engine0.params", "engine0.optimizer"}, 0),
    (True, False, 3 << 19, {"engine0.params"}, OPT),
    (False, True, 2 << 20, {"engine0.optimizer"}, P),
    (False, False, 1 << 19, set(), P + OPT),
])
def test_dock_counts_what_verl_keeps_resident(param_offload, optimizer_offload, kv, sets, reserved):
    """Reproduces: with param_offload=True, optimizer_offload=False the second update raised "AdamW.step()
    while its state is offloaded"; with param_offload=False 8.41 MB were held against a 6.37 MB budget."""
    tf_verl.patch(dock=B)
    vd, e = tf_verl.docked(), _engine(param_offload, optimizer_offload)
    for _ in range(3):
        _update(e)
        assert set(vd.sets) == sets and vd.dock.in_use == frozenset()
        assert vd.dock.nbytes("engine0.resident") == reserved if reserved else "engine0.resident" not in vd.reserved
        vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": kv})  # the rollout: room made within the budget
        assert _on_device(e) + kv == vd.dock.resident_bytes <= B
        vd.rollout_asleep()
    assert e.optimizer.state[e.module.weight]["step"].item() == 3.0


def test_an_engine_keeping_more_than_the_budget_is_refused_naming_its_flags():
    tf_verl.patch(dock=2 << 20)
    e = _engine(False, True, n=1024)
    with pytest.raises(ValueError, match=r"the eval phase of engine0 does not fit its budget .*: engine0 keeps "
                                         r"4198400 bytes on the device \(param_offload=False: its parameters\), more "
                                         r"than the budget of 2097152 bytes") as err:
        with base.BaseEngineCtx(e, "eval"):
            pass
    assert "\n" not in str(err.value) and e.mode is None and not tf_verl.docked().dock.in_use


def test_a_first_step_of_an_optimizer_kept_resident_that_cannot_fit_is_refused_before_it_runs():
    tf_verl.patch(dock=2 << 20)  # the parameters (1 MB, kept) fit, AdamW's state beside them does not
    e = _engine(False, False)
    before = e.module.weight.detach().clone()
    with pytest.raises(ValueError, match=r"engine0.optimizer would hold about 2101256 bytes after the first step "
                                         r"\(AdamW's state .*\) beside 1050624 bytes held"):
        _update(e)
    assert torch.equal(e.module.weight, before) and not e.optimizer.state


def test_amsgrad_is_refused_at_its_first_step_not_admitted_then_refused_at_the_second():
    """Reproduces: Adam(amsgrad=True) was admitted at step 0 and refused at step 1 (the estimate assumed two
    state tensors per parameter)."""
    tf_verl.patch(dock=P + 3 * P)  # parameters and two moments fit beside them, three do not
    e = _engine(True, True, optimizer=torch.optim.Adam, amsgrad=True)
    with pytest.raises(ValueError, match=r"engine0.optimizer would hold about 3151880 bytes after the first step"):
        _update(e)
    assert not e.optimizer.state
    tf_verl.patch(dock=P + 3 * P + (1 << 20))
    for _ in range(2):  # room for all three: admitted at the first step and at the second alike
        _update(e)
    assert e.optimizer.state[e.module.weight]["max_exp_avg_sq"].shape == (N, N)


def test_a_checkpoint_loaded_while_the_optimizer_is_evicted_is_counted(monkeypatch):
    """Reproduces: verl's load_checkpoint after the rollout evicted the optimizer put the loaded AdamW state
    on the device while the dock counted it evicted (12.61 MB held against an 8.47 MB budget at the next wake)."""
    tf_verl.patch(dock=B)
    vd, e = tf_verl.docked(), _engine(True, True)
    _update(e)
    saved = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in e.optimizer.state_dict()["state"].items()},
             "param_groups": e.optimizer.state_dict()["param_groups"]}
    vd.dock.evict("engine0.optimizer")  # the rollout's room
    manager = types.SimpleNamespace(load_checkpoint=lambda **kw: (e.module.load_state_dict(e.module.state_dict()),
                                                                  e.optimizer.load_state_dict(saved)))
    e.checkpoint_manager = manager
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    e.load_checkpoint("unused")  # verl's own: its helpers load the model, the state lands beside it
    kv = 2 << 20
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": kv})
    assert vd.dock.stats.adoptions == 1 and _on_device(e) + kv == vd.dock.resident_bytes <= B
    vd.rollout_asleep()
    _update(e)
    assert e.optimizer.state[e.module.weight]["step"].item() == 2.0


def test_a_dock_replaced_inside_a_phase_releases_that_phase():
    """Reproduces: patch(dock=B) inside a phase left the old dock's names in use for good."""
    tf_verl.patch(dock=B)
    old, e = tf_verl.docked(), _engine(True, True)
    with base.BaseEngineCtx(e, "train"):
        tf_verl.patch(dock=2 * B)
        assert old.dock.in_use
    assert not old.dock.in_use and e.mode is None
    _update(e)  # the next phase under the new dock: the old one lets the sets go
    new = tf_verl.docked()
    assert new is not old and set(new.sets) == {"engine0.params", "engine0.optimizer"} and not old.sets


def _train_step(e):
    e.module(torch.ones(2, 64)).sum().backward()
    e.optimizer.step()
    e.optimizer.zero_grad()


def _state_tensors(opt):
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]


def test_a_recreated_optimizers_state_is_the_set_the_dock_moves():
    tf_verl.patch(dock=2**20)
    vd = tf_verl.docked()
    e = _engine(True, True, n=64)
    for _ in range(2):
        with base.BaseEngineCtx(e, "eval"):
            pass
        with base.BaseEngineCtx(e, "train"):
            _train_step(e)
    e.optimizer = torch.optim.AdamW(e.module.parameters(), lr=1e-4)  # re-created; the old one is dropped
    gc.collect()
    with base.BaseEngineCtx(e, "train"):
        _train_step(e)
    before = [t.clone() for t in _state_tensors(e.optimizer)]
    # the rollout needs almost the whole budget: every set of the engine must leave
    vd.wake({"rollout.kv_cache": 2**20 - 1000}, torch.device("cpu"), "the rollout's")
    assert all(in_host_pool(t.data_ptr()) for t in _state_tensors(e.optimizer)), \
        "the re-created optimizer's state was not moved by the dock"
    assert vd.dock.ferry("engine0.optimizer").residency.on_host
    vd.asleep()
    with base.BaseEngineCtx(e, "train"):
        assert before and all(torch.equal(a, b) for a, b in zip(before, _state_tensors(e.optimizer), strict=True))


def test_a_phase_dock_takes_the_ferry_a_phase_names_for_its_set():
    """The core's phase dock (SkyRL's helpers use it too): ``enter(..., optimizer=ferry)`` with the ferry of a
    re-created optimizer keeps the first one as ``engine0.optimizer`` without a word."""
    from torchferry import Ferry
    from torchferry.integrations._base import PhaseDock

    m = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(m.parameters())
    _train_step(types.SimpleNamespace(module=m, optimizer=opt))
    pd = PhaseDock(2**20, label="test dock")
    cpu = torch.device("cpu")
    pf, of = Ferry(m), Ferry(opt)
    pd.enter(m, "train", device=cpu, params=pf, optimizer=of)
    pd.leave(m, "train")
    opt2 = torch.optim.AdamW(m.parameters(), lr=1e-4)
    _train_step(types.SimpleNamespace(module=m, optimizer=opt2))
    of2 = Ferry(opt2)
    pd.enter(m, "train", device=cpu, params=pf, optimizer=of2)
    pd.leave(m, "train")
    assert pd.dock.ferry("engine0.optimizer") is of2


def _steps(e, n):
    for _ in range(n):
        with base.BaseEngineCtx(e, "eval"):
            pass
        with base.BaseEngineCtx(e, "train"):
            _train_step(e)


def test_an_optimizer_replaced_inside_a_train_phase_is_moved_and_trains_exactly():
    ref, e = _engine(True, True, n=64), _engine(True, True, n=64)
    e.module.load_state_dict(ref.module.state_dict())
    for _ in range(3):  # verl's own run (nothing patched): 3 steps, the optimizer re-created, 2 steps
        _train_step(ref)
    ref.optimizer = torch.optim.AdamW(ref.module.parameters(), lr=1e-4)
    for _ in range(2):
        _train_step(ref)
    tf_verl.patch(dock=2**20)
    vd = tf_verl.docked()
    _steps(e, 2)
    with base.BaseEngineCtx(e, "train"):
        _train_step(e)
        e.optimizer = torch.optim.AdamW(e.module.parameters(), lr=1e-4)  # re-created inside the phase
        _train_step(e)
    vd.wake({"rollout.kv_cache": 2**20 - 1000}, torch.device("cpu"), "the rollout's")
    assert all(in_host_pool(t.data_ptr()) for t in _state_tensors(e.optimizer))
    assert vd.dock.ferry("engine0.optimizer").residency.on_host
    vd.asleep()
    with base.BaseEngineCtx(e, "train"):
        _train_step(e)
    for a, b in zip(ref.module.parameters(), e.module.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    for a, b in zip(_state_tensors(ref.optimizer), _state_tensors(e.optimizer), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_a_dropped_optimizers_set_leaves_before_the_next_wake():
    tf_verl.patch(dock=2**20)
    vd = tf_verl.docked()
    e = _engine(True, True, n=64)
    _steps(e, 2)
    assert vd.dock.has("engine0.optimizer")
    e.optimizer = torch.optim.AdamW(e.module.parameters(), lr=1e-4)  # no step yet: the old one is dropped
    gc.collect()
    vd.wake({"rollout.kv_cache": 2**20 - 1000}, torch.device("cpu"), "the rollout's")
    assert not vd.dock.has("engine0.optimizer")
    assert vd.dock.ferry("engine0.params").residency.on_host
    vd.asleep()
    _steps(e, 1)  # the new optimizer's first step: its set from then on
    assert vd.dock.has("engine0.optimizer") and has_state(e.optimizer)


def test_a_phase_whose_host_pool_the_node_refuses_raises_host_budget_error(monkeypatch):
    monkeypatch.setenv("TORCHFERRY_HOST_BUDGET_BYTES", "1000")  # the node cannot hold the set's 16,640-byte pool
    tf_verl.patch(dock=10**8)
    e = _engine(True, True, n=64)
    with pytest.raises(HostBudgetError, match=r"needs 16640 bytes .* within the node.s host budget of 1000 bytes"):
        with base.BaseEngineCtx(e, "eval"):
            pass
    assert not tf_verl.docked().dock.in_use and e.mode is None


def test_a_rollout_wake_whose_eviction_the_host_refuses_raises_host_budget_error(monkeypatch):
    tf_verl.patch(dock=2**20)
    vd, e = tf_verl.docked(), _engine(True, True, n=64)
    with base.BaseEngineCtx(e, "eval"):
        pass
    ferry = vd.dock.ferry("engine0.params")

    def refused(*args, **kwargs):
        raise HostBudgetError("torchferry: a host pool needs 16640 bytes of host memory, but only 0 are available",
                              16640, 0)

    monkeypatch.setattr(ferry, "offload", refused)
    with pytest.raises(HostBudgetError):
        vd.wake({"rollout.kv_cache": 2**20 - 1000}, torch.device("cpu"), "the rollout's")
    assert not ferry.residency.on_host and not vd.dock.in_use


def _nested_step(e, n):
    e.module(torch.ones(2, n)).pow(2).sum().backward()
    e.optimizer.step()
    e.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("outer,inner", [("train", "eval"), ("eval", "train")])
def test_a_context_of_the_other_mode_nested_at_its_first_use_fits_and_keeps_the_outer_sets(outer, inner):
    """A context of one mode nested in one of the other before the inner mode was measured fits beside what the
    outer holds in use and opens; the outer keeps its sets (before: the inner's first workspace was the rest of the
    budget less only its own sets, refused as "does not fit its budget")."""
    p = (256 * 256 + 256) * 4
    tf_verl.patch(dock=4 * p + (1 << 20))  # parameters and AdamW's state fit with 1 MiB to spare
    vd = tf_verl.docked()
    e = _engine(True, True, n=256, lr=1e-2)
    with base.BaseEngineCtx(e, outer):  # only the outer mode measured; everything fits the budget
        _nested_step(e, 256) if outer == "train" else None
    assert vd.dock.resident_bytes <= 4 * p + (1 << 20)
    with base.BaseEngineCtx(e, outer):
        with base.BaseEngineCtx(e, inner):  # before: NoRoom "the <inner> phase of engine0 does not fit its budget"
            e.module(torch.ones(2, 256))
        assert "engine0.params" in vd.dock.in_use
        _nested_step(e, 256) if outer == "train" else None
    assert not vd.dock.in_use


def test_a_later_patch_without_dock_keeps_the_dock_in_its_settings(monkeypatch):
    """``patch(dock=B)`` then ``patch(layerwise_reload=False)``: the dock stays, and the settings say so (before:
    ``settings.dock`` read None while the dock stayed active); ``patch(dock=0)`` ends it, in the settings too."""
    monkeypatch.setenv(DOCK_ENV, str(8 << 20))  # the environment's budget does not override the earlier patch's
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    tf_verl.patch(layerwise_reload=False)
    state = REGISTRY.patched["verl"]
    assert state.settings.dock == B and tf_verl.docked() is vd and state.settings.layerwise_reload is False
    tf_verl.patch(dock=0)
    assert REGISTRY.patched["verl"].settings.dock is None and tf_verl.docked() is None
    tf_verl.patch()
    assert REGISTRY.patched["verl"].settings.dock is None and tf_verl.docked() is None


@pytest.mark.parametrize("budget", [1e-5, 0.6, 1 / 3, 8 << 20])
def test_a_later_patch_keeps_any_budget_the_first_accepted_and_passes_it_on_exactly(budget):
    """The earlier budget is kept as a value (before: ``str(budget)`` was parsed again, and ``'1e-05'`` is no
    budget's form: every later ``patch()`` raised); the workers' ``TORCHFERRY_VERL_DOCK`` reads back the same."""
    from torchferry.integrations._base import parse_budget

    tf_verl.patch(dock=budget)
    tf_verl.patch(layerwise_reload=False)
    settings = REGISTRY.patched["verl"].settings
    assert settings.dock == budget
    assert parse_budget(dict(settings.chosen)[DOCK_ENV], DOCK_ENV) == budget


def test_a_budget_of_more_than_30_digits_is_refused_at_the_first_patch():
    with pytest.raises(ValueError, match=r"^torchferry: patch\(dock=...\): 10+ is not a dock budget") as e:
        tf_verl.patch(dock=10**31)
    assert "\n" not in str(e.value) and "verl" not in REGISTRY.patched
