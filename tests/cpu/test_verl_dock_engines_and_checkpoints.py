"""verl's dock mode against verl 0.9.1's own flags and lifecycle, more of them (CPU, engines faked as in
``test_integration_verl_dock_flags.py``): two engines in one dock, forward-only engines, ``disable_auto_offload``,
nested contexts, checkpoints while evicted, the rollout's resume / release, and the helper switches through
``patch()``; each trains bit-identical to a run without offload, within the budget."""

import asyncio
import copy
import itertools
import types

import pytest
import torch

pytest.importorskip("verl.workers.engine_workers", reason="verl's actor code and what it imports are not installed")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry._core._state.host_blocks import in_host_pool  # noqa: E402
from torchferry.integrations._base import DOCK_ENV, REGISTRY, settings_of  # noqa: E402

from verl.workers.engine import base  # noqa: E402

N = 256
P = (N * N + N) * 4
OPT = 2 * P + 2 * 4
B = 4 * P + (1 << 20)


@pytest.fixture(autouse=True)
def _clean(monkeypatch, own_ledger):
    monkeypatch.delenv(DOCK_ENV, raising=False)
    for v in ("TORCHFERRY_OPTIMIZER_AT_STEP", "TORCHFERRY_LAYERWISE_RELOAD", "TORCHFERRY_SKIP_UNCHANGED"):
        monkeypatch.delenv(v, raising=False)
    tf_verl.unpatch()
    REGISTRY.kept.clear()
    yield
    tf_verl.unpatch()
    REGISTRY.kept.clear()


def _engine(param_offload=True, optimizer_offload=True, n=N, seed=0, forward_only=False):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    torch.manual_seed(seed)
    e = object.__new__(FSDPEngine)
    e.module = torch.nn.Linear(n, n)
    e.optimizer = torch.optim.AdamW(e.module.parameters(), lr=1e-2)
    e._is_offload_param, e._is_offload_optimizer = param_offload, optimizer_offload
    e.mode = None
    e.engine_config = types.SimpleNamespace(forward_only=forward_only)
    return e


def _step(e):
    e.module(torch.ones(2, e.module.in_features)).pow(2).sum().backward()
    e.optimizer.step()
    e.optimizer.zero_grad(set_to_none=True)


def _update(e, **kw):
    with base.BaseEngineCtx(e, "train", **kw):
        _step(e)


def _eval(e):
    with base.BaseEngineCtx(e, "eval"):
        return e.module(torch.ones(2, e.module.in_features)).detach().clone()


def _on_device(*engines) -> int:
    ts = [t for e in engines for t in (*e.module.parameters(),
                                       *(t for s in e.optimizer.state.values() for t in s.values()))]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in ts if t.numel() and not in_host_pool(t.data_ptr())}.values())


def _rollout_holds_only_the_kept(vd, kv, *engines) -> None:
    """The rollout's KV cache woken: the dock holds it and what the engines keep on the device, within the budget."""
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": kv})
    assert _on_device(*engines) + kv == vd.dock.resident_bytes <= B
    vd.rollout_asleep()


def _reference(steps, seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(N, N)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ref = types.SimpleNamespace(module=m, optimizer=opt)
    for _ in range(steps):
        _step(ref)
    return ref


def _same(e, ref):
    with torch.no_grad():
        for p, q in zip(e.module.parameters(), ref.module.parameters(), strict=True):
            assert torch.equal(p.detach().cpu(), q.detach()), "parameters differ from the run without a dock"


FLAGS = list(itertools.product([True, False], repeat=2))


@pytest.mark.parametrize("actor_flags,critic_flags", list(itertools.product(FLAGS, FLAGS)))
def test_two_engines_in_one_dock_train_through_rollouts_within_the_budget_and_exactly(actor_flags, critic_flags):
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    actor, critic = _engine(*actor_flags, seed=1), _engine(*critic_flags, seed=2)
    kv = B - 2 * P - 2 * OPT  # room for everything kept resident of both engines, at most
    for _ in range(3):
        _eval(actor)
        _update(critic)
        _update(actor)
        assert not vd.dock.in_use
        _rollout_holds_only_the_kept(vd, kv, actor, critic)
    for e, seed in ((actor, 1), (critic, 2)):
        with base.BaseEngineCtx(e, "eval"):
            _same(e, _reference(3, seed))


def test_a_forward_only_engine_beside_a_docked_one_is_left_to_verl():
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    actor, ref = _engine(seed=1), _engine(seed=3, forward_only=True)
    before = [p.detach().clone() for p in ref.module.parameters()]
    for _ in range(2):
        _update(actor)
        _eval(ref)
        vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 2 * P})
        vd.rollout_asleep()
    assert ref not in vd.engines
    assert all(torch.equal(a, b) for a, b in zip(before, ref.module.parameters(), strict=True))


def test_verls_nested_mini_batch_contexts_with_disable_auto_offload_train_exactly():
    """verl's train_batch: an outer train_mode, each mini-batch inside ``train_mode(disable_auto_offload=True)``."""
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=4)
    for _ in range(2):
        with base.BaseEngineCtx(e, "train"):
            for _ in range(2):
                _update(e, disable_auto_offload=True)
        assert not vd.dock.in_use
        vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})  # everything must leave
        assert _on_device(e) == 0
        vd.rollout_asleep()
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(4, 4))


def test_a_disable_auto_offload_context_after_a_manual_load_of_evicted_sets_trains_exactly(monkeypatch):
    """A caller that loads the engine itself (``engine.to(device)``) and runs ``disable_auto_offload`` phases."""
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=5)
    _update(e)
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})  # both sets evicted
    vd.rollout_asleep()
    assert _on_device(e) == 0
    transformer_impl.FSDPEngine.to(e, "cpu", model=True, optimizer=True, grad=True)  # no-op for docked sets
    # verl's manual load is engine.to(get_device_name()): here the helpers' loads directly
    from verl.utils import fsdp_utils
    fsdp_utils.load_fsdp_model_to_gpu(e.module)
    fsdp_utils.load_fsdp_optimizer(e.optimizer, "cpu")
    _update(e, disable_auto_offload=True)
    _update(e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(3, 5))


@pytest.mark.parametrize("outer,inner", [("train", "eval"), ("eval", "train"), ("train", "train"), ("eval", "eval")])
def test_nested_contexts_of_an_engine_keep_its_sets_until_the_outer_exit(outer, inner):
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=6)
    _eval(e)  # each mode measured once: its workspace no longer the rest of the budget
    _update(e)  # the optimizer has state: a set
    with base.BaseEngineCtx(e, outer):
        with base.BaseEngineCtx(e, inner):
            pass
        assert "engine0.params" in vd.dock.in_use, "the outer phase lost its parameters"
        with pytest.raises(RuntimeError, match="do not fit the budget"):  # not what the open phase holds
            vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})
        assert _on_device(e) > 0
        if outer == "train":
            _step(e)
    assert not vd.dock.in_use


def test_save_checkpoint_while_every_set_is_evicted_saves_the_state_and_keeps_the_budget(monkeypatch):
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=7)
    _update(e)
    want_m = {k: v.clone() for k, v in e.module.state_dict().items()}
    want_o = copy.deepcopy(e.optimizer.state_dict()["state"])
    kv = B - 1000
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": kv})
    vd.rollout_asleep()
    saved = {}
    e.checkpoint_manager = types.SimpleNamespace(save_checkpoint=lambda **kw: saved.update(
        model={k: v.clone() for k, v in e.module.state_dict().items()},
        optim=copy.deepcopy(e.optimizer.state_dict()["state"])))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    e.save_checkpoint("unused")
    assert all(torch.equal(v, saved["model"][k]) for k, v in want_m.items())
    for k, s in want_o.items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(saved["optim"][k][n])) for n, v in s.items())
    _rollout_holds_only_the_kept(vd, kv, e)
    _update(e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 7))


@pytest.mark.parametrize("param_offload", [True, False])
def test_load_checkpoint_while_the_sets_are_evicted_is_counted_and_trains(monkeypatch, param_offload):
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(param_offload, True, seed=8)
    _update(e)
    ms = {k: v.clone() for k, v in e.module.state_dict().items()}
    os_ = copy.deepcopy(e.optimizer.state_dict())
    _update(e)  # then roll back to the checkpoint of step 1
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - (0 if param_offload else P) - 1000})
    vd.rollout_asleep()
    e.checkpoint_manager = types.SimpleNamespace(load_checkpoint=lambda **kw: (
        e.module.load_state_dict(ms), e.optimizer.load_state_dict(copy.deepcopy(os_))))
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: None)
    e.load_checkpoint("unused")
    kv = B - (0 if param_offload else P) - 1000
    _rollout_holds_only_the_kept(vd, kv, e)
    _update(e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 8))


class _Rollout:
    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    async def resume(self, tags):
        self.calls.append(("resume", tuple(tags)))
        if self.fail:
            raise RuntimeError("vLLM could not map its memory")

    async def release(self):
        self.calls.append(("release",))


def test_the_rollouts_weights_and_kv_cache_woken_apart_then_released_leave_nothing_counted():
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=9)
    _update(e)
    r = tf_verl.dock_rollout(_Rollout(), P, B - 2 * P)
    asyncio.run(r.resume(["weights"]))
    asyncio.run(r.resume(["kv_cache"]))
    assert _on_device(e) + B - P == vd.dock.resident_bytes <= B
    asyncio.run(r.release())
    assert not vd.awake and vd.dock.resident_bytes == _on_device(e)
    asyncio.run(r.resume(["weights", "kv_cache"]))  # a second step's wake
    asyncio.run(r.release())
    _update(e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 9))


def test_a_rollout_resume_that_raises_keeps_its_claimants_until_the_next_phase():
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=10)
    _update(e)
    r = tf_verl.dock_rollout(_Rollout(fail=True), 0, B - 1000)
    with pytest.raises(RuntimeError, match="could not map"):
        asyncio.run(r.resume(["kv_cache"]))
    _update(e)  # the next phase takes the rollout as asleep
    assert not vd.awake
    r.fail = False
    asyncio.run(r.resume(["kv_cache"]))
    asyncio.run(r.release())
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 10))


@pytest.mark.parametrize("name", ["optimizer_at_step", "layerwise_reload"])
def test_a_switch_turned_off_before_the_dock_stays_off_with_it(name):
    tf_verl.patch(**{name: False})
    tf_verl.patch(dock=B)
    assert settings_of("verl")[name] is False and tf_verl.docked() is not None


@pytest.mark.parametrize("name", ["optimizer_at_step", "layerwise_reload"])
def test_a_switch_turned_off_after_the_dock_keeps_the_dock(name):
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    tf_verl.patch(**{name: False})
    assert settings_of("verl")[name] is False
    assert tf_verl.docked() is vd


@pytest.mark.parametrize("name,env", [("optimizer_at_step", "TORCHFERRY_OPTIMIZER_AT_STEP"),
                                      ("layerwise_reload", "TORCHFERRY_LAYERWISE_RELOAD")])
def test_a_switch_off_in_the_environment_holds_under_the_dock(monkeypatch, name, env):
    monkeypatch.setenv(env, "0")
    tf_verl.patch(dock=B)
    assert settings_of("verl")[name] is False
    vd = tf_verl.docked()
    e = _engine(seed=11)
    for _ in range(2):
        _update(e)
        vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})
        vd.rollout_asleep()
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 11))


@pytest.mark.parametrize("at_step,layerwise", list(itertools.product([True, False], repeat=2)))
def test_the_helpers_switches_under_the_dock_train_exactly_with_verls_own_offloads(monkeypatch, at_step, layerwise):
    """Outside the phases verl's own calls of the helpers (its weight sync, checkpoints) go through the dock."""
    from verl.utils import fsdp_utils

    tf_verl.patch(dock=B, optimizer_at_step=at_step, layerwise_reload=layerwise)
    vd = tf_verl.docked()
    e = _engine(seed=12)
    for _ in range(2):
        _update(e)
        fsdp_utils.load_fsdp_model_to_gpu(e.module)  # the weight sync's read
        fsdp_utils.offload_fsdp_model_to_cpu(e.module)
        vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})
        vd.rollout_asleep()
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(2, 12))


def test_a_first_step_made_outside_the_dock_then_docked_phases_train_exactly_within_the_budget(monkeypatch):
    """verl's train_batch called with ``disable_auto_offload`` by a caller that moves the engine itself
    (``engine.to``): the optimizer's first step and its offload happen outside every docked phase."""
    from verl.utils import fsdp_utils

    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=13)
    _update(e, disable_auto_offload=True)
    fsdp_utils.offload_fsdp_model_to_cpu(e.module)  # verl's engine.to("cpu")
    fsdp_utils.offload_fsdp_optimizer(e.optimizer)
    for _ in range(2):
        _update(e)
        kv = B - 1000
        _rollout_holds_only_the_kept(vd, kv, e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(3, 13))


def test_the_dock_switched_off_while_sets_are_evicted_then_on_again_trains_exactly(monkeypatch):
    from verl.utils import fsdp_utils

    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    e = _engine(seed=14)
    _update(e)
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - 1000})
    vd.rollout_asleep()
    assert _on_device(e) == 0
    tf_verl.patch(dock=0)  # no dock from now on: verl's helpers move the state
    fsdp_utils.load_fsdp_model_to_gpu(e.module)
    fsdp_utils.load_fsdp_optimizer(e.optimizer, "cpu")
    _step(e)
    fsdp_utils.offload_fsdp_model_to_cpu(e.module)
    fsdp_utils.offload_fsdp_optimizer(e.optimizer)
    tf_verl.patch(dock=B)  # the same budget again: its dock
    assert tf_verl.docked() is vd
    _update(e)
    kv = B - 1000
    _rollout_holds_only_the_kept(vd, kv, e)
    with base.BaseEngineCtx(e, "eval"):
        _same(e, _reference(3, 14))


def test_unpatch_with_two_engines_evicted_brings_both_back_exactly():
    tf_verl.patch(dock=B)
    vd = tf_verl.docked()
    actor, critic = _engine(True, True, seed=15), _engine(False, True, seed=16)
    _update(actor)
    _update(critic)
    vd.rollout_wakes(["kv_cache"], {"weights": 0, "kv_cache": B - P - 1000})
    vd.rollout_asleep()
    tf_verl.unpatch()
    for e, seed in ((actor, 15), (critic, 16)):
        assert _on_device(e) == P + OPT
        _same(e, _reference(1, seed))
        _step(e)
        _same(e, _reference(2, seed))
